"""The FastAPI application: routes, API-key check, error envelope.

``build_app(state)`` wires the routes to a ``ServerState``. Every error
leaves as the OpenAI envelope: our ``APIError`` with its status, a 404/405
for unknown routes, a 400 for anything FastAPI itself would have made a 422,
and a 500 with a generic message for everything else (the details go to the
log only). The API-key check is pure ASGI middleware (so client
disconnects still reach the routes) and leaves only ``/health``, ``/ready``
and ``/metrics`` open; keys are compared as SHA-256 digests with
``hmac.compare_digest`` against every configured key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve import __version__
from kvserve.server.lora_routes import add_lora_routes
from kvserve.server.metrics import CONTENT_TYPE
from kvserve.server.openapi import openapi_document
from kvserve.server.protocol import (
    INTERNAL_ERROR_MESSAGE,
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from kvserve.server.responses import add_routes as add_responses_routes
from kvserve.server.serving import OpenAIServing, read_body
from kvserve.server.state import ServerState

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` matches a configured key."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.digests = [_digest(key) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self.digests or scope["method"] == "OPTIONS"
                or scope["path"] in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        presented = _digest(token.strip() if scheme.lower() == "bearer" else "")
        matched = False
        for digest in self.digests:  # no early exit: the time does not depend on which key
            matched |= hmac.compare_digest(presented, digest)
        if matched:
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "a valid API key is required: send "
                                     "'Authorization: Bearer <key>'")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        # a 405 keeps Starlette's Allow header (the route's methods)
        return _error_response(APIError(exc.status_code, str(exc.detail),
                                        headers=exc.headers))

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
        return _error_response(APIError(400, f"invalid request: {errors[:3]}"[:500],
                                        param or None))

    async def on_internal_error(request: Request, exc: Exception) -> Response:
        logger.error("internal error on %s %s", request.method, request.url.path,
                     exc_info=exc)
        return _error_response(APIError(500, INTERNAL_ERROR_MESSAGE))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_internal_error)


def _probe(state: ServerState, ready: bool) -> Response:
    problem = state.problem(ready)
    if problem is None:
        return JSONResponse({"status": "ok"})
    return _error_response(APIError(503, problem, headers={"Retry-After": "5"}))


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app serving ``state`` (its lifespan loads the engine if needed)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvserve = state
    serving = OpenAIServing(state)
    created = int(time.time())  # /v1/models reports when this server started
    _install_error_handlers(app)
    if state.config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=state.config.api_keys)

    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    add_responses_routes(app, state)

    @app.get("/health")
    async def health() -> Response:
        return _probe(state, ready=False)

    @app.get("/ready")
    async def ready() -> Response:
        return _probe(state, ready=True)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return JSONResponse(openapi_document(state.config.allow_runtime_lora_updating))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": _model_cards(state, created)})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        serving.check_model(model_id)
        return JSONResponse(next(c for c in _model_cards(state, created)
                                 if c["id"] == model_id))

    _add_tokenizer_routes(app, state, serving)
    if state.config.allow_runtime_lora_updating:
        add_lora_routes(app, state)
    return app


def _model_cards(state: ServerState, created: int) -> list[dict[str, Any]]:
    """The served model's names, then its LoRA adapters (``parent``: the model,
    ``root``: the adapter's directory), as vLLM lists them; ``created``: Unix time."""
    client = state.client
    max_model_len = client.processor.max_model_len if client is not None else None
    base = [{
        "id": name, "object": "model", "created": created, "owned_by": "kvserve",
        "root": client.config.model if client is not None else None, "parent": None,
        "max_model_len": max_model_len,
    } for name in state.config.served_model_names]
    return base + [{
        "id": lora.lora_name, "object": "model", "created": created, "owned_by": "kvserve",
        "root": lora.lora_path, "parent": state.config.model_name,
        "max_model_len": max_model_len,
    } for lora in state.config.lora_requests]


def _add_tokenizer_routes(app: FastAPI, state: ServerState, serving: OpenAIServing) -> None:
    limit = state.config.max_request_body_bytes

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = TokenizeRequest.parse(await read_body(request, limit))
        body.check()
        serving.check_model(body.model)
        processor = state.require_engine().processor
        tokenizer = processor.tokenizer
        try:
            if body.messages is not None:
                token_ids = processor.apply_chat_template(
                    [m.to_template() for m in body.messages], body.add_generation_prompt)
            else:
                assert body.prompt is not None
                token_ids = tokenizer.encode(body.prompt, body.add_special_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages" if body.messages else "prompt") from None
        result: dict[str, Any] = {"count": len(token_ids),
                                  "max_model_len": processor.max_model_len, "tokens": token_ids}
        if body.return_token_strs:
            result["token_strs"] = tokenizer.convert_ids_to_tokens(token_ids)
        return JSONResponse(result)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        processor = state.require_engine().processor
        return JSONResponse({**processor.tokenizer.info(),
                             "model_max_length": processor.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = DetokenizeRequest.parse(await read_body(request, limit))
        serving.check_model(body.model)
        processor = state.require_engine().processor
        vocab_size = processor.vocab_size
        for i, token_id in enumerate(body.tokens):
            if not 0 <= token_id < vocab_size:
                raise APIError(400, f"tokens[{i}]={token_id} is invalid: token ids must be in "
                               f"[0, {vocab_size - 1}]", "tokens")
        return JSONResponse({"prompt": processor.tokenizer.decode(body.tokens)})
