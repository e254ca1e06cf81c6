"""Real ``kvserve serve`` subprocesses on 127.0.0.1 for the end-to-end tests.

``serve_tiny`` is one session-wide server on a tiny random Llama with a
tokenizer (served as ``tiny``); ``start_server`` starts more with their own
flags and environment (fault injection, small queues) and stops them at the
end of the test. Each server runs in its own process group and session, logs
to a file (printed when a start fails), and is stopped with SIGTERM, then
SIGKILL on its whole group: no process outlives the tests. Every wait is
bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A running ``kvserve serve``."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None if still running after ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of ``/metrics`` (0 when absent); ``labels`` must appear in the line."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            if self.wait_exit(STOP_TIMEOUT_S) is None:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=STOP_TIMEOUT_S)
        _signal_group(self.process, signal.SIGKILL)  # anything left in the group


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def launch(model: Path, log_path: Path, args: list[str] | None = None,
           env: dict[str, str] | None = None, wait_ready: bool = True) -> ServerProcess:
    """Start a server and wait (bounded) until ``/ready`` answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model),
               "--port", str(port), "--served-model-name", MODEL_NAME,
               "--uvicorn-log-level", "warning", *(args or [])]
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("KVSERVE_API_KEY", "KVSERVE_FAULT_INJECT")}
    environment.update(PYTHONPATH=str(REPO_ROOT), **(env or {}))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=environment, cwd=REPO_ROOT, start_new_session=True)
    server = ServerProcess(process, port, log_path)
    if wait_ready:
        _wait_ready(server)
    return server


def _wait_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"kvserve serve did not become ready; log:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"),
                                with_tokenizer=True)


@pytest.fixture(scope="session")
def serve_tiny(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
    """The shared server: 8 running, 64 queued, a 64 KiB body limit."""
    server = launch(tiny_model, tmp_path_factory.mktemp("serve") / "server.log", [
        "--max-num-seqs", "8", "--max-queued-requests", "64", "--num-kv-blocks", "256",
        "--max-request-body-bytes", "65536",
    ])
    yield server
    server.stop()


@pytest.fixture
def start_server(tiny_model: Path, tmp_path: Path
                 ) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: ``start_server(args, env, wait_ready=True)``; stopped after the test."""
    servers: list[ServerProcess] = []

    def start(args: list[str] | None = None, env: dict[str, str] | None = None,
              wait_ready: bool = True) -> ServerProcess:
        server = launch(tiny_model, tmp_path / f"server{len(servers)}.log", args, env,
                        wait_ready)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
