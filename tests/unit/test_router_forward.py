"""The router's forwarding, against in-process stand-in backends (httpx's
MockTransport): a 503 or an unreachable backend is skipped for the next, none
left gives 503 with Retry-After, a stream cut short ends with an error frame,
probes take backends out and put them back. The real thing, with kvserve
servers and SIGKILL, is tests/e2e/test_router.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx

from kvserve.router.app import RouterState, build_app
from kvserve.router.backends import BackendPool
from kvserve.router.policy import RoundRobinPolicy
from kvserve.router.prompt_key import PromptKeyer

A, B = "http://a:1", "http://b:1"
BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


class CutStream(httpx.AsyncByteStream):
    """One SSE frame, then the connection breaks."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "hi"}]}\n\ndata: {"choi'
        raise httpx.RemoteProtocolError("peer closed connection")


Handler = Callable[[httpx.Request], httpx.Response]


def router(handlers: dict[str, Handler]) -> tuple[RouterState, httpx.AsyncClient]:
    def dispatch(request: httpx.Request) -> httpx.Response:
        return handlers[f"http://{request.url.host}:{request.url.port}"](request)

    backend_client = httpx.AsyncClient(transport=httpx.MockTransport(dispatch))
    pool = BackendPool([A, B], backend_client)
    for backend in pool.backends:
        backend.healthy = True
    state = RouterState(pool, RoundRobinPolicy([A, B]), PromptKeyer(None, 4), backend_client)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)),
                               base_url="http://router")
    return state, client


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"served_by": request.url.host,
                                     "body": json.loads(request.content)})


def busy(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"error": {"message": "queue full"}},
                          headers={"Retry-After": "1"})


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def metric(state: RouterState, name: str, **labels: str) -> float:
    value = state.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_a_refusing_backend_is_skipped_for_the_next() -> None:
    async def run() -> None:
        state, client = router({A: busy, B: ok})
        for _ in range(3):
            response = await client.post("/v1/completions", json=BODY)
            assert response.status_code == 200 and response.json()["served_by"] == "b"
            assert response.json()["body"] == BODY  # passed through unchanged
        assert metric(state, "kvserve:router_errors_total", backend=A, kind="refused") >= 1
        assert state.pool.by_url[A].healthy  # busy is not dead

        state, client = router({A: refuse, B: ok})
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200 and response.json()["served_by"] == "b"
        assert not state.pool.by_url[A].healthy
        assert metric(state, "kvserve:router_errors_total", backend=A, kind="connect") == 1

    asyncio.run(run())


def test_no_backend_left_gives_503_with_retry_after() -> None:
    async def run() -> None:
        _, client = router({A: busy, B: refuse})
        response = await client.post("/v1/chat/completions",
                                     json={"model": "m", "messages": []})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        message = response.json()["error"]["message"]
        assert A in message and B in message
        assert (await client.get("/health")).status_code == 200  # A is busy, not down
        bad = await client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]

    asyncio.run(run())


def test_a_stream_cut_short_ends_with_an_error_frame() -> None:
    def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=CutStream(),
                              headers={"content-type": "text/event-stream"})

    async def run() -> None:
        state, client = router({A: cut, B: cut})
        response = await client.post("/v1/completions", json={**BODY, "stream": True})
        frames = [f for f in response.text.split("\n\n") if f]
        assert frames[0] == 'data: {"choices": [{"text": "hi"}]}'  # the half frame is dropped
        assert json.loads(frames[1].removeprefix("data: "))["error"]["code"] == "backend_failed"
        assert frames[2] == "data: [DONE]" and len(frames) == 3
        assert metric(state, "kvserve:router_errors_total", backend=A, kind="stream") == 1
        assert state.pool.by_url[A].in_flight == 0 and not state.pool.by_url[A].healthy

    asyncio.run(run())


def test_probes_take_a_backend_out_and_put_it_back() -> None:
    alive = {"a": True}
    forgotten: list[str] = []

    def backend(request: httpx.Request) -> httpx.Response:
        if not alive["a"]:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text="kvserve:num_requests_waiting{model_name=\"m\"} 4\n")
        return httpx.Response(200)

    async def run() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(backend))
        pool = BackendPool([A], client, unhealthy_after=2, on_recovered=forgotten.append)
        assert await pool.wait_healthy(1.0) == [] and forgotten == [A]
        assert pool.backends[0].waiting == 4.0
        alive["a"] = False
        await pool.probe_all()
        assert pool.backends[0].healthy  # one failed probe is not enough
        await pool.probe_all()
        assert not pool.backends[0].healthy and pool.candidates(set()) == []
        alive["a"] = True
        await pool.probe_all()
        assert pool.backends[0].healthy and forgotten == [A, A]

    asyncio.run(run())
