"""Run a function on every rank of a small gloo group, for the parallel layers' tests.

``run_ranks(fn, tp, pp, *args)`` starts ``tp * pp`` processes (from a
forkserver that has imported torch once, so a call costs well under a
second after the first), joins them into one CPU process group with
kvserve's ``init_distributed``, calls ``fn(state, *args)`` on each with its
``ParallelState`` and returns the results in rank order. A rank that raises
fails the call with its traceback; every wait is bounded, and the
processes are killed if they outlive it. ``fn`` must be a module-level
function (it is pickled by name).
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

TIMEOUT_S = 120.0
_PRELOAD = ["torch", "kvserve.distributed.parallel_state", "kvserve.models.llama"]


def _rank_main(rank: int, tp: int, pp: int, port: int, conn: Connection,
               fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.config import ParallelConfig
    from kvserve.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
        config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                distributed_timeout_s=TIMEOUT_S)
        state = init_distributed(config, rank, torch.device("cpu"), store)
        # plain pickle: tensors by value, not by a shared-memory handle that
        # dies with this process
        conn.send_bytes(pickle.dumps(("ok", fn(state, *args))))
        destroy_distributed()
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))


def run_ranks(fn: Callable[..., Any], tp: int, pp: int, *args: Any) -> list[Any]:
    """``fn(state, *args)`` on each of ``tp * pp`` ranks; their results by rank."""
    import torch.distributed as dist

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S))
    world = tp * pp
    pipes = [context.Pipe(duplex=False) for _ in range(world)]
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, tp, pp, store.port, pipes[rank][1], fn, args))
                 for rank in range(world)]
    for process in processes:
        process.start()
    try:
        results = []
        for rank, (reader, _) in enumerate(pipes):
            if not reader.poll(TIMEOUT_S):
                raise TimeoutError(f"rank {rank} gave no result in {TIMEOUT_S:.0f} s")
            status, value = pickle.loads(reader.recv_bytes())
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
