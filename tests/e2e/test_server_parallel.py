"""``kvserve serve --tensor-parallel-size 2`` on CPU: it serves, and a worker
that dies (SIGKILL) or hangs (SIGSTOP, then silence past
``--distributed-timeout-s``) fails the requests in flight, turns
``/health`` to 503 and ends the server with a non-zero status, leaving no
process of its group behind (a stopped worker is killed too).

Forwards are slowed to keep requests in flight (``KVSERVE_FAULT_INJECT``);
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess, launch

pytestmark = pytest.mark.slow

LONG: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 100,
                        "ignore_eos": True}
TP2 = ["--tensor-parallel-size", "2", "--device", "cpu", "--max-num-seqs", "8",
       "--num-kv-blocks", "256"]


def worker_pids(server: ServerProcess) -> dict[int, int]:
    """Rank -> pid, from the start-up log."""
    found = re.findall(r"rank (\d+) \(TP rank \d+, stage \d+, pid (\d+)\)", server.log())
    return {int(rank): int(pid) for rank, pid in found}


def live_group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``."""
    live = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(entry.name))
    return live


async def _stream(client: httpx.AsyncClient, url: str, started: asyncio.Event
                  ) -> tuple[int, list[str]]:
    frames = []
    async with client.stream("POST", url + "/v1/completions",
                             json={**LONG, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line:
                frames.append(line)
                started.set()
    return response.status_code, frames


def _fail_a_worker(server: ServerProcess, sig: int) -> tuple[int, int, list[str]]:
    """Stream two requests, send ``sig`` to rank 1 once both have tokens; the
    /health status seen afterwards, and one stream's status and frames."""
    pid = worker_pids(server)[1]

    async def main() -> tuple[int, tuple[int, list[str]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(_stream(client, server.url, event))
                       for event in started]
            # both streams are under way (headers sent), so each must end with
            # an error frame rather than a plain 500
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
            os.kill(pid, sig)
            results = await asyncio.gather(*streams)
            health = (await client.get(server.url + "/health")).status_code
            return health, results[0]

    health, (status, frames) = asyncio.run(asyncio.wait_for(main(), 60))
    return health, status, frames


def _check_failed_and_gone(server: ServerProcess, health: int, status: int,
                           frames: list[str], cause: str = "WorkerFailedError") -> None:
    assert health == 503
    assert status == 200, frames[-3:]
    assert json.loads(frames[-2][6:])["error"]["type"] == "InternalServerError", frames[-3:]
    assert frames[-1] == "data: [DONE]"
    exit_code = server.wait_exit(30)
    assert exit_code not in (None, 0), server.log()[-3000:]
    assert cause in server.log()
    deadline = time.monotonic() + 15
    while live_group_members(server.process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_group_members(server.process.pid), "processes outlived the server"


def test_serves_and_a_killed_worker_fails_it(tiny_model: Path, tmp_path: Path) -> None:
    server = launch(tiny_model, tmp_path / "server.log", TP2,
                    {"KVSERVE_FAULT_INJECT": "step_delay_s=0.05"})
    try:
        assert sorted(worker_pids(server)) == [0, 1]
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={**LONG, "max_tokens": 8})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        _check_failed_and_gone(server, *_fail_a_worker(server, signal.SIGKILL))
        assert "exited with code -9" in server.log()
    finally:
        server.stop()


def test_a_hung_worker_fails_it_after_the_timeout(tiny_model: Path, tmp_path: Path) -> None:
    server = launch(tiny_model, tmp_path / "server.log", [*TP2, "--distributed-timeout-s", "3"],
                    {"KVSERVE_FAULT_INJECT": "step_delay_s=0.05"})
    try:
        _check_failed_and_gone(server, *_fail_a_worker(server, signal.SIGSTOP))
        # rank 0's collective or the engine's wait gave up, whichever came first
        assert "Timed out" in server.log() or "a worker hangs" in server.log()
    finally:
        server.stop()
