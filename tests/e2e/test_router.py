"""``kvserve router`` over real ``kvserve serve`` processes on 127.0.0.1 (tiny
random Llama): greedy outputs through the router equal one engine's
(completions, chat, streaming), prefix-aware routing keeps a prefix on one
backend where round-robin alternates, a client that disconnects aborts the
backend request, a backend SIGKILLed mid-stream ends that stream with an
error frame while another stream finishes, then 503 with Retry-After once
all are down; a backend that never answers at start-up is named; and
``kvserve serve --data-parallel-size 2`` serves and stops without orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import (
    MODEL_NAME,
    REPO_ROOT,
    ServerProcess,
    _signal_group,
    _wait_ready,
    free_port,
    launch,
)

IGNORE_EOS = {"ignore_eos": True}
PROMPTS = ["def fibonacci(n):", "the quick brown fox jumps over", "import numpy as np\n"]


def launch_router(log_path: Path, backends: list[str], args: list[str] | None = None,
                  wait_ready: bool = True) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "kvserve.cli", "router", "--port", str(port),
               "--uvicorn-log-level", "warning", "--health-interval-s", "0.5",
               "--backend", *backends, *(args or [])]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                   cwd=REPO_ROOT, start_new_session=True)
    router = ServerProcess(process, port, log_path)
    if wait_ready:
        _wait_ready(router)
    return router


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                         max_retries=0)


def requests_per_backend(router: ServerProcess, backends: list[ServerProcess]) -> list[float]:
    return [router.metric("kvserve:router_requests_total", f'backend="{b.url}"')
            for b in backends]


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[list[ServerProcess], ServerProcess]]:
    """Two backends and a prefix-aware router with their tokenizer."""
    logs = tmp_path_factory.mktemp("router")
    backends = [launch(tiny_model, logs / f"backend{i}.log", ["--num-kv-blocks", "64"],
                       wait_ready=False) for i in range(2)]
    try:
        for backend in backends:  # started together, waited for in turn
            _wait_ready(backend)
        router = launch_router(logs / "router.log", [b.url for b in backends],
                               ["--tokenizer", str(tiny_model), "--policy", "prefix"])
        yield backends, router
        router.stop()
    finally:
        for backend in backends:
            backend.stop()


def test_greedy_outputs_through_the_router_equal_one_engines(
        pair: tuple[list[ServerProcess], ServerProcess]) -> None:
    backends, router = pair
    direct, routed = openai_client(backends[0]), openai_client(router)
    for prompt in PROMPTS:
        kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0,
                      extra_body=IGNORE_EOS)
        expected = direct.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
        assert routed.completions.create(**kwargs).choices[0].text == expected  # type: ignore[call-overload]
        chunks = routed.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        messages = [{"role": "user", "content": prompt}]
        chat = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0.0,
                    extra_body=IGNORE_EOS)
        expected = direct.chat.completions.create(**chat).choices[0].message.content  # type: ignore[call-overload]
        assert routed.chat.completions.create(**chat).choices[0].message.content == expected  # type: ignore[call-overload]
    assert [m.id for m in routed.models.list().data] == [MODEL_NAME]
    health = httpx.get(router.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["healthy_backends"] == 2


def test_prefix_routing_keeps_a_prefix_on_one_backend(
        pair: tuple[list[ServerProcess], ServerProcess], tmp_path: Path) -> None:
    backends, router = pair
    client = openai_client(router)
    shared = "You are a helpful assistant who writes short Python functions. "
    before = requests_per_backend(router, backends)
    for turn in range(6):
        client.completions.create(model=MODEL_NAME, prompt=shared + f"task {turn}:",
                                  max_tokens=2, temperature=0.0)
    after = requests_per_backend(router, backends)
    assert sorted(a - b for a, b in zip(after, before)) == [0, 6]
    home = backends[[a - b for a, b in zip(after, before)].index(6)]
    assert router.metric("kvserve:router_routing_decisions_total",
                         f'backend="{home.url}",reason="prefix_hit"') >= 5
    assert home.metric("kvserve:prefix_cache_hits_total") > 0

    round_robin = launch_router(tmp_path / "rr.log", [b.url for b in backends],
                                ["--policy", "round_robin"])
    try:
        for turn in range(6):
            openai_client(round_robin).completions.create(
                model=MODEL_NAME, prompt=shared + f"task {turn}:", max_tokens=2)
        assert requests_per_backend(round_robin, backends) == [3.0, 3.0]
    finally:
        round_robin.stop()


def test_a_backend_that_never_answers_is_named(pair: tuple[list[ServerProcess], ServerProcess],
                                               tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = launch_router(tmp_path / "dead.log", [dead, "http://127.0.0.1:1"],
                           ["--startup-timeout-s", "0.5"], wait_ready=False)
    assert router.wait_exit(60) == 1
    log = router.log()
    assert dead in log and "http://127.0.0.1:1" in log and "no backend answered" in log
    # one dead of two: a warning naming it, and the router serves with the other
    backends, _ = pair
    router = launch_router(tmp_path / "half.log", [dead, backends[0].url],
                           ["--startup-timeout-s", "0.5"])
    try:
        assert dead in router.log()
        result = openai_client(router).completions.create(model=MODEL_NAME, prompt="x",
                                                          max_tokens=2)
        assert result.choices[0].finish_reason == "length"
    finally:
        router.stop()


@pytest.fixture
def slow_pair(start_server: Callable[..., ServerProcess], tmp_path: Path
              ) -> Iterator[tuple[list[ServerProcess], ServerProcess]]:
    """Two backends whose every step sleeps 50 ms, behind a round-robin router."""
    slow = {"KVSERVE_FAULT_INJECT": "step_delay_s=0.05"}
    backends = [start_server(["--num-kv-blocks", "64"], env=slow, wait_ready=False)
                for _ in range(2)]
    for backend in backends:
        _wait_ready(backend)
    router = launch_router(tmp_path / "router.log", [b.url for b in backends],
                           ["--policy", "round_robin"])
    yield backends, router
    router.stop()


def stream_lines(router: ServerProcess, lines: list[str], started: threading.Event) -> None:
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 100, "stream": True,
            **IGNORE_EOS}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
                started.set()


@pytest.mark.slow
def test_disconnect_abort_and_a_backend_killed_mid_stream(
        slow_pair: tuple[list[ServerProcess], ServerProcess]) -> None:
    backends, router = slow_pair
    # a client that leaves aborts the backend's request
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 100, "stream": True,
            **IGNORE_EOS}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())
    aborted = 'finished_reason="abort"'
    deadline = time.monotonic() + 30
    while sum(b.metric("kvserve:request_success_total", aborted) for b in backends) < 1:
        assert time.monotonic() < deadline, "the backend request was not aborted"
        time.sleep(0.2)

    # two streams, one per backend (round-robin); the first backend is killed
    outputs: list[list[str]] = [[], []]
    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=stream_lines, args=(router, outputs[i], events[i]))
               for i in range(2)]
    for thread, event in zip(threads, events):
        thread.start()
        assert event.wait(30)
    running = [b.metric("kvserve:num_requests_running") for b in backends]
    assert running == [1.0, 1.0]
    victim, survivor = backends
    _signal_group(victim.process, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    killed = next(lines for lines in outputs if any('"error"' in line for line in lines))
    finished = next(lines for lines in outputs if lines is not killed)
    error = json.loads(killed[-2].removeprefix("data: "))["error"]
    assert killed[-1] == "data: [DONE]" and error["code"] == "backend_failed"
    assert finished[-1] == "data: [DONE]" and '"finish_reason":"length"' in finished[-2]

    client = openai_client(router)
    for _ in range(2):  # the survivor takes everything now
        result = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
        assert result.choices[0].finish_reason == "length"
    _signal_group(survivor.process, signal.SIGKILL)
    survivor.wait_exit(10)
    refused = httpx.post(router.url + "/v1/completions", timeout=30,
                         json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in status


@pytest.mark.slow
def test_serve_data_parallel_serves_and_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    server = launch(tiny_model, tmp_path / "dp.log",
                    ["--data-parallel-size", "2", "--router-policy", "round_robin"])
    try:
        children = _children(server.process.pid)
        assert len(children) == 2
        client = openai_client(server)
        texts = {client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6,
                                           temperature=0.0).choices[0].text for _ in range(2)}
        assert len(texts) == 1  # both replicas, one greedy answer
        per_backend = [float(line.rsplit(" ", 1)[1]) for line in
                       httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
                       if line.startswith("kvserve:router_requests_total{")]
        assert per_backend == [1.0, 1.0]
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0
        assert not [pid for pid in children if _alive(pid)]
    finally:
        server.stop()
