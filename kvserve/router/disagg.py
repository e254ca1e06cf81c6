"""The router's disaggregated mode (``kvserve router --prefill URL --decode URL``):
each request goes first to a prefill engine, then to a decode engine.

The prefill engine (``kvserve serve --kv-role prefill``) is sent the request
with ``max_tokens=1``, no streaming, no stop strings or logprobs, and
``kv_transfer_params={"do_remote_decode": true}``; its answer's
``kv_transfer_params`` say where the prompt's KV waits. The decode engine
(``--kv-role decode``) is sent the client's request unchanged plus those
params: it pulls the KV, computes the last prompt token itself (so the first
token, its logprobs and the usage are the decode engine's, exactly as one
engine would give them; the prefill engine's token is dropped) and answers
the client, streaming relayed frame by frame as in the plain router.

When no prefill engine answers (all down, or each fails before answering),
the decode engine gets the request without params and computes the prompt
itself: a dead prefill engine slows requests down but fails none. A decode
engine that dies mid-stream ends that stream with an error frame, as in the
plain router. Refused with 400: ``n > 1``, a list of several prompts, and
``echo`` with ``logprobs`` (prompt logprobs need the prompt computed where
they are asked). This module does the HTTP only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.router.app import (
    FORWARDED_HEADERS,
    METRICS_CONTENT_TYPE,
    ClientGone,
    Forwarder,
    RouterState,
    add_forwarding_routes,
    error_response,
)
from kvserve.router.backends import Backend
from kvserve.router.metrics import RouterMetrics

logger = logging.getLogger("kvserve.router")

# fields the prefill engine is not sent: it computes the prompt and one token only
_PREFILL_DROPPED = ("stream", "stream_options", "stop", "logprobs", "top_logprobs", "n",
                    "max_completion_tokens", "min_tokens", "echo")


@dataclass
class _AllBackends:
    """The prefill and decode backends together, for one metrics registry."""

    backends: list[Backend]


def check_disagg_request(payload: dict[str, Any]) -> str | None:
    """Why the request cannot be disaggregated (a 400 message), or None."""
    n = payload.get("n", 1)
    if n not in (None, 1):
        return (f"n={n} is invalid with disaggregated prefill / decode: must be 1 (send n "
                "requests)")
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return (f"prompt: a list of {len(prompt)} prompts is invalid with disaggregated "
                    "prefill / decode: send one prompt per request")
    if payload.get("echo") and payload.get("logprobs") is not None:
        return ("echo with logprobs is invalid with disaggregated prefill / decode: the "
                "prompt's logprobs are not computed where it is decoded")
    if payload.get("kv_transfer_params") is not None:
        return "kv_transfer_params: set by the router, not by clients"
    return None


def prefill_body(payload: dict[str, Any]) -> bytes:
    """What the prefill engine is sent: the prompt, one token, keep the KV."""
    body = {key: value for key, value in payload.items() if key not in _PREFILL_DROPPED}
    body.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return json.dumps(body).encode()


class DisaggForwarder:
    """Prefill first, then decode, over two pools of backends."""

    def __init__(self, prefill: RouterState, decode: RouterState) -> None:
        self.prefill_state, self.decode_state = prefill, decode
        self.prefill, self.decode = Forwarder(prefill), Forwarder(decode)
        self.num_prefill_fallbacks = 0

    async def forward(self, request: Request, path: str) -> Response:
        try:
            payload = json.loads(await request.body())
        except ValueError as exc:
            return error_response(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(payload, dict):
            return error_response(400, "the request body must be a JSON object")
        refusal = check_disagg_request(payload)
        if refusal is not None:
            return error_response(400, refusal)
        key = await asyncio.to_thread(self.prefill_state.keyer.key, path, payload)
        headers = {name: value for name, value in request.headers.items()
                   if name in FORWARDED_HEADERS}
        try:
            answer = await self.prefill._send(request, path, prefill_body(payload), headers,
                                              key, stream=False)
            if answer.status_code == 200:
                params = json.loads(bytes(answer.body)).get("kv_transfer_params")
                if isinstance(params, dict):
                    payload["kv_transfer_params"] = params
            elif answer.status_code < 500:  # bad input: the decode engine would say the same
                return answer
            if "kv_transfer_params" not in payload:
                self.num_prefill_fallbacks += 1
                logger.warning("no prefill engine answered (%d): the decode engine computes "
                               "the prompt", answer.status_code)
            return await self.decode._send(request, path, json.dumps(payload).encode(), headers,
                                           key, stream=payload.get("stream") is True)
        except ClientGone:
            return Response(status_code=499)


def build_disagg_app(prefill: RouterState, decode: RouterState,
                     on_start: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The router application in disaggregated mode."""
    backends = _AllBackends(prefill.pool.backends + decode.pool.backends)
    metrics = RouterMetrics(backends, lambda: 0)  # type: ignore[arg-type]
    prefill.metrics = decode.metrics = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            await on_start()
        prefill.pool.start()
        decode.pool.start()
        try:
            yield
        finally:
            await prefill.pool.stop()
            await decode.pool.stop()
            await prefill.client.aclose()

    app = FastAPI(title="kvserve router (prefill / decode)", lifespan=lifespan,
                  openapi_url=None)
    forwarder = DisaggForwarder(prefill, decode)
    add_forwarding_routes(app, forwarder.forward, forwarder.decode.get_any)

    def probe() -> Response:
        healthy = decode.pool.num_healthy  # prefill engines are optional (see above)
        if healthy:
            return JSONResponse({"status": "ok", "healthy_backends": healthy,
                                 "healthy_prefill_backends": prefill.pool.num_healthy})
        return error_response(503, "every decode backend is down",
                              retry_after_s=decode.retry_after_s)

    app.add_api_route("/health", probe, methods=["GET"])
    app.add_api_route("/ready", probe, methods=["GET"])

    @app.get("/metrics")
    async def render_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app
