"""The router's HTTP front: OpenAI routes forwarded to backends, probes, metrics.

``/v1/completions`` and ``/v1/chat/completions`` go to the backend the
policy picks; the body and the ``Authorization`` header pass through
unchanged, and the backend's answer comes back as it is (a stream relayed
frame by frame). A backend that cannot be reached, or refuses with 503 / 429
before starting, is skipped for the next choice (so is one that fails before
a non-streamed answer: the client has received nothing yet); when none is
left the client gets 503 with ``Retry-After``. A backend that goes away mid-stream
ends that stream with an OpenAI error frame and ``[DONE]``; a client that
goes away closes the backend connection, which aborts the request there.
``/v1/models`` comes from any healthy backend; ``/health`` and ``/ready``
are 200 while one backend is healthy. This module does the HTTP only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.router.backends import Backend, BackendPool
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import PrefixAwarePolicy, PrefixKey, RoutingPolicy
from kvserve.router.prompt_key import PromptKeyer

logger = logging.getLogger("kvserve.router")

RETRY_STATUSES = (429, 503)
DISCONNECT_POLL_S = 0.25
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
T = TypeVar("T")


@dataclass
class RouterState:
    """Everything the routes share."""

    pool: BackendPool
    policy: RoutingPolicy
    keyer: PromptKeyer
    client: httpx.AsyncClient
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        policy = self.policy
        entries = (lambda: policy.num_entries) if isinstance(policy, PrefixAwarePolicy) else (
            lambda: 0)
        self.metrics = RouterMetrics(self.pool, entries)


class ClientGone(Exception):
    """The client closed its connection while the router waited on a backend."""


def error_response(status: int, message: str, retry_after_s: int | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 502: "BadGatewayError",
            503: "ServiceUnavailableError"}.get(status, "APIError")
    code = "service_unavailable" if status == 503 else None
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}}, status_code=status, headers=headers)


def _stream_error_frame(backend: Backend, exc: BaseException) -> bytes:
    message = (f"the backend serving this request failed mid-stream "
               f"({type(exc).__name__}: {exc}); the output above is incomplete")
    body = {"error": {"message": message, "type": "BadGatewayError", "param": None,
                      "code": "backend_failed"}}
    logger.warning("backend %s failed mid-stream: %s", backend.url, exc)
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone (``work`` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Forwarder:
    """Sends one client request to a backend, retrying on refusals."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as exc:
            return error_response(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(payload, dict):
            return error_response(400, "the request body must be a JSON object")
        # tokenizing and hashing a long prompt takes milliseconds: off the event loop
        key = await asyncio.to_thread(self.state.keyer.key, path, payload)
        headers = {name: value for name, value in request.headers.items()
                   if name in FORWARDED_HEADERS}
        try:
            return await self._send(request, path, body, headers, key,
                                    stream=payload.get("stream") is True)
        except ClientGone:
            return Response(status_code=499)

    async def _send(self, request: Request, path: str, body: bytes, headers: dict[str, str],
                    key: PrefixKey, stream: bool) -> Response:
        state, tried = self.state, set[str]()
        reasons: list[str] = []
        while candidates := state.pool.candidates(tried):
            decision = state.policy.choose(candidates, key)
            backend = state.pool.by_url[decision.url]
            tried.add(backend.url)
            state.metrics.decisions.labels(backend.url, decision.reason).inc()
            state.metrics.prefix_matched_blocks.labels(backend.url).inc(decision.matched_blocks)
            state.metrics.requests.labels(backend.url).inc()
            backend.in_flight += 1
            released = False
            try:
                outgoing = state.client.build_request("POST", backend.url + path, content=body,
                                                      headers=headers)
                response = await _until_disconnect(request, state.client.send(outgoing,
                                                                              stream=True))
                if response.status_code in RETRY_STATUSES:
                    await response.aclose()
                    state.metrics.errors.labels(backend.url, "refused").inc()
                    reasons.append(f"{backend.url} answered {response.status_code}")
                    continue
                if stream and response.status_code == 200:
                    released = True  # the relay releases it
                    return StreamingResponse(self._relay(backend, response),
                                             media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
                content = await _until_disconnect(request, self._read(response))
                return Response(content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"))
            except httpx.TransportError as exc:
                state.metrics.errors.labels(backend.url, "connect").inc()
                state.pool.mark_down(backend, f"{type(exc).__name__}: {exc}")
                reasons.append(f"{backend.url}: {type(exc).__name__}")
            finally:
                if not released:
                    backend.in_flight -= 1
        state.metrics.unavailable.inc()
        detail = "; ".join(reasons) or "every backend is down"
        return error_response(503, f"no backend could take the request ({detail}); retry "
                                   "later", retry_after_s=state.retry_after_s)

    @staticmethod
    async def _read(response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        finally:
            await response.aclose()

    async def _relay(self, backend: Backend, response: httpx.Response) -> AsyncIterator[bytes]:
        """The backend's SSE frames, whole frames only; an error frame if it fails."""
        buffer = b""
        try:
            async for chunk in response.aiter_raw():
                buffer += chunk
                end = buffer.rfind(b"\n\n")
                if end >= 0:
                    yield buffer[:end + 2]
                    buffer = buffer[end + 2:]
            if buffer:
                yield buffer
        except httpx.TransportError as exc:
            self.state.metrics.errors.labels(backend.url, "stream").inc()
            self.state.pool.mark_down(backend, f"failed mid-stream: {exc}")
            yield _stream_error_frame(backend, exc)
        finally:
            backend.in_flight -= 1
            await response.aclose()

    async def get_any(self, request: Request, path: str) -> Response:
        """A GET answered by the first healthy backend that answers."""
        tried: set[str] = set()
        while candidates := self.state.pool.candidates(tried):
            backend = self.state.pool.by_url[candidates[0].url]
            tried.add(backend.url)
            try:
                response = await self.state.client.get(
                    backend.url + path, headers={k: v for k, v in request.headers.items()
                                                 if k == "authorization"})
            except httpx.TransportError as exc:
                self.state.pool.mark_down(backend, f"{type(exc).__name__}: {exc}")
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        return error_response(503, "every backend is down; retry later",
                              retry_after_s=self.state.retry_after_s)


def build_app(state: RouterState,
              on_start: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The router application; ``on_start`` runs before the first request."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            await on_start()
        state.pool.start()
        try:
            yield
        finally:
            await state.pool.stop()
            await state.client.aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan, openapi_url=None)
    forwarder = Forwarder(state)
    add_forwarding_routes(app, forwarder.forward, forwarder.get_any)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await forwarder.get_any(request, f"/v1/models/{model_id}")

    def probe() -> Response:
        healthy = state.pool.num_healthy
        if healthy:
            return JSONResponse({"status": "ok", "healthy_backends": healthy})
        return error_response(503, "every backend is down", retry_after_s=state.retry_after_s)

    app.add_api_route("/health", probe, methods=["GET"])
    app.add_api_route("/ready", probe, methods=["GET"])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app


def add_forwarding_routes(app: FastAPI, forward: Callable[[Request, str], Awaitable[Response]],
                          get_any: Callable[[Request, str], Awaitable[Response]]) -> None:
    """The generation routes, forwarded with ``forward(request, path)``, and
    ``/v1/models`` from any healthy backend."""

    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    async def models(request: Request) -> Response:
        return await get_any(request, "/v1/models")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])


def backend_summary(pool: BackendPool) -> dict[str, Any]:
    """Each backend's state, for the start-up log."""
    return {b.url: ("healthy" if b.healthy else f"down ({b.last_error})") for b in pool.backends}
