"""The server under stress: client disconnects (streaming and not, queued and
running), backpressure, a forward that raises or hangs, and SIGTERM draining.

Servers here slow each forward down a little with the test-only
``KVSERVE_FAULT_INJECT=step_delay_s=...`` hook, so "still in flight" does not
depend on how fast the machine is. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess, launch

LONG: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 110,
                        "ignore_eos": True}
StartServer = Callable[..., ServerProcess]


async def _first_token_then_leave(client: httpx.AsyncClient, url: str) -> bool:
    """Stream a long request and hang up after its first token."""
    async with client.stream("POST", url + "/v1/completions",
                             json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return True
    return False


async def _leave_early(client: httpx.AsyncClient, url: str, after_s: float) -> None:
    with pytest.raises(httpx.TimeoutException):
        await client.post(url + "/v1/completions", json=LONG, timeout=after_s)


def wait_idle(server: ServerProcess, timeout_s: float = 10.0) -> None:
    """Wait until nothing runs or waits and the KV cache is empty again."""
    deadline = time.monotonic() + timeout_s
    names = ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
             "kvserve:kv_cache_usage_perc")
    while time.monotonic() < deadline:
        values = [server.metric(name) for name in names]
        if values == [0.0, 0.0, 0.0]:
            return
        time.sleep(0.1)
    pytest.fail(f"the engine did not go idle: {dict(zip(names, values))}")


def wait_aborted(server: ServerProcess, expected: float, timeout_s: float = 5.0) -> None:
    """Wait until ``request_success_total{finished_reason="abort"}`` reaches ``expected``."""
    deadline = time.monotonic() + timeout_s
    while (value := server.metric("kvserve:request_success_total",
                                  'finished_reason="abort"')) < expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert value == expected


@pytest.fixture(scope="module")
def slow_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """8 running, 64 queued, every forward 10 ms slower."""
    server = launch(tiny_model, tmp_path_factory.mktemp("slow") / "server.log", [
        "--max-num-seqs", "8", "--max-queued-requests", "64", "--num-kv-blocks", "256",
    ], {"KVSERVE_FAULT_INJECT": "step_delay_s=0.01"})
    yield server
    server.stop()


def test_streaming_cancellation_frees_everything(slow_server: ServerProcess) -> None:
    url = slow_server.url
    aborted = slow_server.metric("kvserve:request_success_total", 'finished_reason="abort"')

    async def main() -> list[bool]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*[_first_token_then_leave(client, url)
                                          for _ in range(50)])

    assert all(asyncio.run(asyncio.wait_for(main(), 60)))
    start = time.monotonic()
    fresh = httpx.post(url + "/v1/completions",
                       json={**LONG, "max_tokens": 8}, timeout=30)
    assert fresh.status_code == 200 and fresh.json()["usage"]["completion_tokens"] == 8
    assert time.monotonic() - start < 10
    wait_idle(slow_server)
    wait_aborted(slow_server, aborted + 50)


def test_non_streaming_disconnect_aborts(slow_server: ServerProcess) -> None:
    """12 requests (8 running, 4 queued) whose clients leave after 0.3 s."""
    url = slow_server.url
    aborted = slow_server.metric("kvserve:request_success_total", 'finished_reason="abort"')

    async def main() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
            await asyncio.gather(*[_leave_early(client, url, 0.3) for _ in range(12)])

    asyncio.run(asyncio.wait_for(main(), 30))
    wait_idle(slow_server, timeout_s=5)  # 110 tokens x 12 would take far longer
    wait_aborted(slow_server, aborted + 12)


def test_backpressure(start_server: StartServer) -> None:
    server = start_server(["--max-num-seqs", "2", "--max-queued-requests", "2"],
                          {"KVSERVE_FAULT_INJECT": "step_delay_s=0.05"})

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60,
                                     limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*[
                client.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 30})
                for _ in range(10)])

    responses = asyncio.run(asyncio.wait_for(main(), 60))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 4 + [503] * 6, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"].isdigit()
            assert response.json()["error"]["type"] == "ServiceUnavailableError"
        else:
            assert response.json()["usage"]["completion_tokens"] == 30
    assert server.metric("kvserve:admission_rejections_total", 'reason="queue_full"') == 6
    wait_idle(server)


async def _stream_frames(client: httpx.AsyncClient, url: str) -> tuple[int, list[str]]:
    """Status and SSE frames of a long streaming request."""
    async with client.stream("POST", url + "/v1/completions",
                             json={**LONG, "stream": True}) as response:
        body = (await response.aread()).decode()
    return response.status_code, [f for f in body.split("\n\n") if f]


def test_forward_raising_fails_everything_and_exits(start_server: StartServer) -> None:
    """Four requests in flight (forwards slowed to 0.3 s) when the 5th forward raises."""
    server = start_server(env={"KVSERVE_FAULT_INJECT": "raise_on_step=5,step_delay_s=0.3"})

    async def main() -> list[Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [_stream_frames(client, server.url) for _ in range(2)]
            plain = [client.post(server.url + "/v1/completions", json=LONG) for _ in range(2)]
            return list(await asyncio.gather(*streams, *plain))

    *streams, plain_a, plain_b = asyncio.run(asyncio.wait_for(main(), 60))
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503
    for response in (plain_a, plain_b):
        assert response.status_code == 500
        assert response.json()["error"]["message"] == (
            "The server had an error while processing your request.")
    for status, frames in streams:
        if status == 200:  # the stream had started: an error frame, then [DONE]
            assert json.loads(frames[-2][6:])["error"]["type"] == "InternalServerError"
            assert frames[-1] == "data: [DONE]"
        else:
            assert status == 500
    exit_code = server.wait_exit(20)
    assert exit_code not in (None, 0), server.log()[-3000:]
    assert "InjectedFault" in server.log()


def test_hung_forward_trips_health_and_watchdog(start_server: StartServer) -> None:
    server = start_server(["--engine-watchdog-s", "2", "--health-stall-s", "0.5"],
                          {"KVSERVE_FAULT_INJECT": "hang_on_step=5"})

    async def main() -> tuple[int, tuple[int, list[str]]]:
        async with httpx.AsyncClient(timeout=30) as client:
            stream = asyncio.create_task(_stream_frames(client, server.url))
            deadline = time.monotonic() + 10
            status = 200
            while status == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                status = (await client.get(server.url + "/health")).status_code
            return status, await stream

    health_status, (status, frames) = asyncio.run(asyncio.wait_for(main(), 30))
    assert health_status == 503
    assert status == 200 and json.loads(frames[-2][6:])["error"]["type"] == "InternalServerError"
    assert frames[-1] == "data: [DONE]"
    exit_code = server.wait_exit(20)
    assert exit_code not in (None, 0), server.log()[-3000:]


async def _last_finish_reason(client: httpx.AsyncClient, url: str, max_tokens: int,
                              started: asyncio.Event) -> str | None:
    """Stream a request; set ``started`` at its first token; its last finish_reason."""
    reasons = []
    async with client.stream("POST", url + "/v1/completions",
                             json={**LONG, "max_tokens": max_tokens, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                started.set()
                reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
    return reasons[-1] if reasons else None


def test_sigterm_drains_then_aborts(start_server: StartServer) -> None:
    """6 tokens (0.6 s) finish within the 4 s drain; 110 tokens (11 s) are aborted."""
    server = start_server(["--shutdown-timeout", "4"],
                          {"KVSERVE_FAULT_INJECT": "step_delay_s=0.1"})

    async def main() -> tuple[Any, ...]:
        async with httpx.AsyncClient(timeout=30) as client:
            events = [asyncio.Event(), asyncio.Event()]
            short = asyncio.create_task(_last_finish_reason(client, server.url, 6, events[0]))
            long = asyncio.create_task(_last_finish_reason(client, server.url, 110, events[1]))
            await asyncio.gather(*(event.wait() for event in events))
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            refused = await client.post(server.url + "/v1/completions", json=LONG)
            ready = await client.get(server.url + "/ready")
            return refused, ready, await short, await long

    refused, ready, short, long = asyncio.run(asyncio.wait_for(main(), 30))
    assert refused.status_code == 503 and "retry-after" in refused.headers
    assert ready.status_code == 503
    assert short == "length", server.log()[-3000:]
    assert long == "abort"
    assert server.wait_exit(15) == 0, server.log()[-3000:]
