"""``kvserve serve --engine-core process`` on CPU: the engine core in its
own process serves (completions, chat with a JSON schema, prompt logprobs,
a 400 naming the field), SIGTERM drains both processes (exit 0), and a core
killed with SIGKILL fails the requests in flight, turns ``/health`` to 503
and ends the server non-zero, leaving no process of its group and no
socket behind.

Forwards are slowed to keep requests in flight (``KVSERVE_FAULT_INJECT``,
applied in the core process); every wait is bounded.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess, launch
from tests.e2e.test_server_parallel import _check_failed_and_gone, _stream, live_group_members

pytestmark = pytest.mark.slow

CORE = ["--engine-core", "process", "--max-num-seqs", "8", "--num-kv-blocks", "256"]
LONG: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 100,
                        "ignore_eos": True}


def core_pid(server: ServerProcess) -> int:
    found = re.search(r"engine core process started \(pid (\d+)\)", server.log())
    assert found, server.log()[-3000:]
    return int(found.group(1))


def _core_sockets(server: ServerProcess) -> list[str]:
    """The abstract unix sockets the server's front end bound for its core."""
    tag = f"@kvserve-core-{server.process.pid}-"
    return [line for line in Path("/proc/net/unix").read_text().splitlines() if tag in line]


def test_serves_and_drains_on_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    server = launch(tiny_model, tmp_path / "server.log", CORE,
                    {"KVSERVE_FAULT_INJECT": "step_delay_s=0.02"})
    url = server.url
    try:
        assert _core_sockets(server)
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            **LONG, "max_tokens": 6, "echo": True, "logprobs": 1})
        assert reply.status_code == 200, reply.text
        logprobs = reply.json()["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) > 6
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL_NAME, "max_tokens": 40,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}},
                "required": ["a"], "additionalProperties": False}}}})
        assert chat.status_code == 200, chat.text
        content = chat.json()["choices"][0]["message"]["content"]
        if chat.json()["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(content)["a"], int)
        bad = httpx.post(url + "/v1/completions", timeout=60, json={**LONG, "max_tokens": 10**6})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        finish: list[str | None] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={**LONG, "max_tokens": 30, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])

        client = threading.Thread(target=stream)
        client.start()
        deadline = time.monotonic() + 30
        while not finish and time.monotonic() < deadline:
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)  # drains: the request runs to its end
        client.join(60)
        assert finish and finish[-1] == "length", finish[-3:]
        assert server.wait_exit(30) == 0, server.log()[-3000:]
        deadline = time.monotonic() + 15  # multiprocessing's resource tracker exits last
        while live_group_members(server.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not live_group_members(server.process.pid), "processes outlived the server"
        assert not _core_sockets(server)
    finally:
        server.stop()


def test_a_killed_core_fails_it(tiny_model: Path, tmp_path: Path) -> None:
    import asyncio
    import os

    server = launch(tiny_model, tmp_path / "server.log", CORE,
                    {"KVSERVE_FAULT_INJECT": "step_delay_s=0.05"})
    try:
        pid = core_pid(server)

        async def main() -> tuple[int, tuple[int, list[str]]]:
            async with httpx.AsyncClient(timeout=60) as client:
                started = [asyncio.Event() for _ in range(2)]
                streams = [asyncio.create_task(_stream(client, server.url, event))
                           for event in started]
                await asyncio.wait_for(
                    asyncio.gather(*(event.wait() for event in started)), 30)
                os.kill(pid, signal.SIGKILL)
                results = await asyncio.gather(*streams)
                health = (await client.get(server.url + "/health")).status_code
                return health, results[0]

        health, (status, frames) = asyncio.run(asyncio.wait_for(main(), 60))
        _check_failed_and_gone(server, health, status, frames, "exited with code -9")
        assert not _core_sockets(server)
    finally:
        server.stop()
