"""Loading and unloading LoRA adapters at run time, as vLLM's server does:
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST
/v1/unload_lora_adapter {"lora_name"}``, answering ``200`` with a plain-text
``Success: ...`` line.

The routes exist only with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; off by default: anyone who can reach
the server could otherwise make it read any directory), and sit behind the
API key like every route but the probes. The engine loads or forgets the
adapter on its own thread, between two steps. Each loaded adapter gets a
``lora_int_id`` never used before in this server, so KV blocks cached under
an unloaded adapter can never be reused by a new one. An adapter that does
not fit is refused with 400 naming the problem, and other requests keep
running; an adapter still used by unfinished requests is not unloaded (400).
An engine that dies (or hangs past the watchdog) while a load or unload is
queued answers it at once with 503 naming the failure. ``LoadLoRAAdapterRequest``
and ``UnloadLoRAAdapterRequest`` validate the bodies (and describe them in
the served OpenAPI document).
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from kvserve.engine.core_client import EngineDeadError
from kvserve.lora.request import LoRARequest
from kvserve.server.protocol import APIError, APIRequest
from kvserve.server.serving import read_body
from kvserve.server.state import ServerState


class LoadLoRAAdapterRequest(APIRequest):
    """``POST /v1/load_lora_adapter``: a PEFT adapter directory, served as ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(APIRequest):
    """``POST /v1/unload_lora_adapter``: the adapter to forget."""

    lora_name: str = Field(min_length=1)


def _engine_failed(exc: EngineDeadError, name: str, doing: str) -> APIError:
    return APIError(503, f"The lora adapter '{name}' was not {doing}: the engine failed "
                    f"({exc})", "lora_name")


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Register the two routes on ``app``."""
    limit = state.config.max_request_body_bytes
    config = state.config

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = LoadLoRAAdapterRequest.parse(await read_body(request, limit))
        name, path = body.lora_name, body.lora_path
        if name in config.served_model_names or config.lora_request(name) is not None:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           "lora_name")
        client = state.require_engine()
        lora = LoRARequest(name, state.next_lora_int_id, path)
        state.next_lora_int_id += 1
        try:
            await client.add_lora(lora)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        except EngineDeadError as exc:
            raise _engine_failed(exc, name, "loaded") from None
        config.lora_requests.append(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        name = UnloadLoRAAdapterRequest.parse(await read_body(request, limit)).lora_name
        lora = config.lora_request(name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                           code="model_not_found")
        client = state.require_engine()
        config.lora_requests.remove(lora)  # new requests no longer find it
        try:
            await client.remove_lora(lora.lora_int_id)
        except ValueError as exc:
            config.lora_requests.append(lora)
            raise APIError(400, f"The lora adapter '{name}' cannot be unloaded now: {exc}",
                           "lora_name") from None
        except EngineDeadError as exc:
            config.lora_requests.append(lora)
            raise _engine_failed(exc, name, "unloaded") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
