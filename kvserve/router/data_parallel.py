"""``kvserve serve --data-parallel-size N``: N engine servers behind one router.

Each replica is a ``kvserve serve`` child with the same flags, on 127.0.0.1
and a free port, seeing only its own GPUs through ``CUDA_VISIBLE_DEVICES``
(tensor x pipeline parallel size of them each; on the CPU, N plain
processes). The router runs in this process on ``--host`` / ``--port`` with
the ``--router-*`` flags, the engines' block size and tokenizer. SIGTERM or
Ctrl-C stops the router (in-flight requests finish), then each child gets
SIGTERM (it drains as ``kvserve serve`` does) and, past its shutdown time,
SIGKILL on its process group. Children die with this process even when it is
SIGKILLed (``PR_SET_PDEATHSIG``), so no engine outlives it. A child that exits
during start-up fails the command (exit 1) naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.router.launcher import RouterOptions, options_from_args, run_router

logger = logging.getLogger("kvserve.router")

# flags of `serve` that the children must not inherit: (name, takes a value)
PARENT_ONLY_FLAGS = {"--data-parallel-size": True, "--host": True, "--port": True,
                     "--router-policy": True, "--router-balance-threshold": True,
                     "--router-prefix-min-match": True,
                     "--router-max-prefix-entries": True, "--router-health-interval-s": True,
                     "--router-startup-timeout-s": True}
CHILD_STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


def child_argv(argv: Sequence[str], port: int) -> list[str]:
    """``argv`` (the command line after ``kvserve``) for one replica: the
    parent-only flags dropped, the replica's own host and port added."""
    out: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name, has_value, _ = arg.partition("=")
        if name in PARENT_ONLY_FLAGS:
            skip_value = PARENT_ONLY_FLAGS[name] and not has_value
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def device_groups(num_replicas: int, gpus_per_replica: int, device: str) -> list[str | None]:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` (None on the CPU); ValueError
    when there are not enough GPUs."""
    if device == "cpu":
        return [None] * num_replicas
    import torch

    if not torch.cuda.is_available():
        if device == "cuda":
            raise ValueError("--device cuda: no CUDA device is visible")
        return [None] * num_replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([i.strip() for i in visible.split(",") if i.strip()] if visible
           else [str(i) for i in range(torch.cuda.device_count())])
    needed = num_replicas * gpus_per_replica
    if needed > len(ids):
        raise ValueError(f"--data-parallel-size={num_replicas} x {gpus_per_replica} GPU(s) per "
                         f"replica needs {needed} GPUs; {len(ids)} visible")
    return [",".join(ids[r * gpus_per_replica:(r + 1) * gpus_per_replica])
            for r in range(num_replicas)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Replicas:
    """The child ``kvserve serve`` processes."""

    def __init__(self, argv: Sequence[str], devices: list[str | None]) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.stopping = False
        for index, visible in enumerate(devices):
            port = _free_port()
            env = dict(os.environ)
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            command = [sys.executable, "-m", "kvserve.cli", *child_argv(argv, port)]
            logger.info("replica %d: port %d%s", index, port,
                        f", CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "")
            self.processes.append(subprocess.Popen(
                command, env=env, start_new_session=True, preexec_fn=_die_with_parent))
            self.urls.append(f"http://127.0.0.1:{port}")

    def exited(self) -> list[str]:
        """The replicas that have exited, with their status."""
        return [f"replica {i} ({self.urls[i]}) exited with status {p.returncode}"
                for i, p in enumerate(self.processes) if p.poll() is not None]

    def watch(self, on_all_exited: Callable[[], None]) -> None:
        """Log each replica that exits while serving; call ``on_all_exited``
        when none is left (a daemon thread)."""

        def run() -> None:
            for index, process in enumerate(self.processes):
                status = process.wait()
                if not self.stopping:
                    logger.error("replica %d (%s) exited with status %d", index,
                                 self.urls[index], status)
            if not self.stopping:
                on_all_exited()

        threading.Thread(target=run, name="kvserve-replicas", daemon=True).start()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM each replica, SIGKILL its process group past ``timeout_s``."""
        self.stopping = True
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("replica pid %d did not stop in %.0f s: killed", process.pid,
                               timeout_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_data_parallel(args: Any, argv: Sequence[str], engine_config: Any) -> int:
    """Start the replicas and the router; the exit status."""
    size = args.data_parallel_size
    parallel = engine_config.parallel_config
    devices = device_groups(size, parallel.world_size, engine_config.device)
    options = RouterOptions(
        backends=[], host=args.host, port=args.port, tokenizer=engine_config.tokenizer_path,
        block_size=engine_config.cache_config.block_size,
        startup_timeout_s=args.router_startup_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout, uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log, **options_from_args(args, "router-"))
    replicas = Replicas(argv, devices)
    all_exited = threading.Event()

    def on_all_exited() -> None:
        all_exited.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def startup_abort() -> str | None:
        exited = replicas.exited()
        return "; ".join(exited) if exited else None

    try:
        options = RouterOptions(**{**options.__dict__, "backends": replicas.urls})
        replicas.watch(on_all_exited)
        status = run_router(options, startup_abort)
        if all_exited.is_set():
            raise OSError("every replica exited: " + "; ".join(replicas.exited()))
        return status
    finally:
        replicas.stop(args.shutdown_timeout + CHILD_STOP_GRACE_S)
