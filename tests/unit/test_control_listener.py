"""The parallel executor's start-up: its control listener takes every rank's
connection when the ranks connect at once, before it accepts the first (8
ranks on a 2-core machine start together while the engine is busy): none may
be lost; and a rank that reports its start-up error and exits while others
still connect is reported by that error, not by its exit.

With a listen queue of one, Linux answers the surplus connections with SYN
cookies and drops their final ACKs once the queue is full; such a rank's
``Client`` believes it is connected and waits for the handshake for ever.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from kvserve.worker.multiproc_executor import (
    MultiprocExecutor,
    WorkerFailedError,
    control_listener,
)
from kvserve.worker.worker import AUTHKEY_KEY, CONTROL_KEY, connect_control


@pytest.mark.parametrize("ranks", [2, 8, 16])
def test_every_rank_connecting_at_once_is_accepted(ranks: int) -> None:
    authkey = os.urandom(32)
    listener = control_listener("127.0.0.1", authkey, ranks)
    store = dist.HashStore()
    store.set(CONTROL_KEY, f"127.0.0.1:{listener.address[1]}")
    store.set(AUTHKEY_KEY, authkey.hex())
    clients: list[Connection] = []
    for rank in range(ranks):  # a rank's connect_control blocks until it is accepted
        threading.Thread(target=lambda r=rank: clients.append(connect_control(store, r, {})),
                         daemon=True).start()
    time.sleep(0.5)  # every rank has connected (or been dropped) before the first accept
    hellos: list[tuple[str, int, dict[str, str]]] = []

    def accept_all() -> None:
        while len(hellos) < ranks:
            hellos.append(listener.accept().recv())

    accepting = threading.Thread(target=accept_all, daemon=True)
    accepting.start()
    accepting.join(10.0)  # a lost connection would wait for ever
    listener.close()
    assert sorted(rank for _, rank, _ in hellos) == list(range(ranks)), (
        f"{ranks - len(hellos)} of {ranks} ranks' connections were lost")
    assert {kind for kind, _, _ in hellos} == {"hello"}
    for conn in clients:
        conn.close()


def exited_worker(rank: int) -> SimpleNamespace:
    process = SimpleNamespace(is_alive=lambda: False, join=lambda timeout=None: None,
                              exitcode=1, pid=4242)
    return SimpleNamespace(rank=rank, process=process)


def executor_with(workers: list[SimpleNamespace]) -> MultiprocExecutor:
    executor = object.__new__(MultiprocExecutor)
    executor.workers = workers  # type: ignore[assignment]
    executor.failure = None
    executor.conns = []
    executor.shutdown = lambda kill=False: None  # type: ignore[method-assign]
    return executor


@pytest.mark.parametrize(("kind", "raised"), [("ValueError", ValueError),
                                              ("RuntimeError", WorkerFailedError)])
def test_a_rank_that_reported_its_start_up_error_is_reported_by_it(
        kind: str, raised: type[BaseException]) -> None:
    engine_end, worker_end = Pipe()
    worker_end.send(("startup_error", 1, kind, "attention_backend: unknown backend 'nope'"))
    executor = executor_with([exited_worker(1)])
    with pytest.raises(raised, match="unknown backend 'nope'"):
        executor._check_started({1: engine_end})


def test_a_rank_that_exited_without_a_word_is_reported_by_its_exit() -> None:
    engine_end, _ = Pipe()
    executor = executor_with([exited_worker(1)])
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 .* exited with code 1"):
        executor._check_started({1: engine_end})
    with pytest.raises(WorkerFailedError, match="exited with code 1"):
        executor_with([exited_worker(0)])._check_started({})
