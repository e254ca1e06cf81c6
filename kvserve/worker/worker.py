"""One worker process of a tensor / pipeline-parallel engine: its rank's shard
of the model, KV cache and CUDA graphs, run step by step for the
``MultiprocExecutor``.

``start_workers`` starts the processes of one node (from a forkserver that
has imported torch and kvserve once). A worker restores the engine's
environment, connects to the rendezvous store the engine serves, reads the
engine's control address there and connects to it (``connect_control``),
joins the process group (``init_distributed``), builds its
``ModelRunner`` on ``cuda:<local rank>`` (or the CPU) and reports ``ready``
with its start-up figures. Then it serves messages, plain pickled tuples:

- engine -> worker: ``("step", step_id, SchedulerOutput, known_tokens)``
  (``known_tokens``: tokens the last pipeline stage sampled, for the stages
  before it), ``("add_lora", call_id, LoRARequest)``, ``("remove_lora", call_id,
  lora_int_id)``, ``("stop",)``;
- worker -> engine: ``("hello", rank, fingerprint)``, ``("ready", rank,
  figures)``, ``("startup_error", rank, error type, message)``,
  ``("output", step_id, ModelRunnerOutput)`` (the output rank only),
  ``("kv_stats", step_id, rank, stats)`` (every rank, after queuing a step
  that copies KV blocks to or from the host tier: its cumulative bytes and
  copy times),
  ``("reply", call_id, rank, error or None)``, ``("error", rank, traceback)``.

Steps run asynchronously: a worker queues step N+1 as soon as it arrives and
reads step N when the device has finished it (on CUDA a thread waits on the
step's event and wakes the loop), so the engine's scheduling overlaps the
device's work as in one process. A worker never outlives the process that
started it: a thread waits on a pipe whose other end only that process
holds, and exits the worker when it closes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Client, Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from kvserve import envs
from kvserve.config import EngineConfig
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.parallel_state import (
    ParallelState,
    destroy_distributed,
    init_distributed,
)
from kvserve.models.loader import resolve_dtype
from kvserve.worker.model_runner import ModelRunner, PendingStep

logger = logging.getLogger(__name__)

CONTROL_KEY = "kvserve/control"  # "host:port" of the engine's listener
AUTHKEY_KEY = "kvserve/authkey"  # its key (hex)
PG_PREFIX = "kvserve/pg/"


def config_fingerprint(config: EngineConfig) -> dict[str, str]:
    """What every node's engine configuration must agree on, by field (paths
    and the node's own rank may differ)."""
    fields = {name: getattr(config, name) for name in (
        "model_config", "cache_config", "scheduler_config", "lora_config", "dtype",
        "load_format", "seed", "attention_backend", "cuda_graph_sizes", "cuda_graph_token_sizes")}
    fields["parallel_config"] = replace(config.parallel_config, node_rank=0)
    return {name: repr(value) for name, value in fields.items()}


@dataclass
class WorkerArgs:
    """What a worker process is started with."""

    config: EngineConfig
    rank: int
    local_rank: int
    store_host: str
    store_port: int
    environ: dict[str, str]
    log_level: int


@dataclass
class WorkerProcess:
    """A started worker, seen from the process that started it."""

    rank: int
    process: BaseProcess
    # the write end of the worker's lifeline: closing it (or this process dying) ends it
    lifeline: Connection


def start_workers(config: EngineConfig, ranks: range, store_host: str,
                  store_port: int) -> list[WorkerProcess]:
    """Start one worker process per rank in ``ranks`` (this node's), local rank
    ``i`` for the ``i``-th: its CUDA device."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["kvserve.worker.worker"])
    level = logging.getLogger("kvserve").getEffectiveLevel()
    environ = envs.environ_snapshot()
    workers = []
    for local_rank, rank in enumerate(ranks):
        reader, writer = context.Pipe(duplex=False)
        args = WorkerArgs(config, rank, local_rank, store_host, store_port, environ, level)
        process = context.Process(target=worker_main, args=(args, reader),
                                  name=f"kvserve-worker-{rank}", daemon=True)
        process.start()
        reader.close()
        workers.append(WorkerProcess(rank, process, writer))
    return workers


def stop_processes(workers: list[WorkerProcess], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the workers to exit, then kill the rest."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5.0)
        worker.lifeline.close()


def connect_control(store: Any, rank: int, fingerprint: dict[str, str]) -> Connection:
    """Connect to the engine's control listener (its address and key from the
    store) and say who this is."""
    host, _, port = store.get(CONTROL_KEY).decode().rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(store.get(AUTHKEY_KEY).decode()))
    conn.send(("hello", rank, fingerprint))
    return conn


def _exit_when_closed(lifeline: Connection) -> None:
    """Wait for the starting process to close the lifeline (or die), then exit."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(1)


def worker_main(args: WorkerArgs, lifeline: Connection) -> None:
    """The entry point of a worker process."""
    envs.restore_environ(args.environ)
    envs.disable_nvlink_multicast()
    threading.Thread(target=_exit_when_closed, args=(lifeline,), daemon=True,
                     name="kvserve-lifeline").start()
    logging.basicConfig(level=args.log_level,
                        format=f"%(levelname)s rank {args.rank} %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(args.log_level)
    parallel = args.config.parallel_config
    conn: Connection | None = None
    try:
        store = dist.TCPStore(args.store_host, args.store_port, is_master=False,
                              timeout=timedelta(seconds=parallel.distributed_timeout_s))
        conn = connect_control(store, args.rank, config_fingerprint(args.config))
        worker = Worker.start(args, dist.PrefixStore(PG_PREFIX, store))
        conn.send(("ready", args.rank, worker.figures))
    except BaseException as exc:
        logger.exception("worker start-up failed")
        if conn is not None:
            conn.send(("startup_error", args.rank, type(exc).__name__, str(exc)))
        os._exit(1)
    try:
        worker.serve(conn)
    except EOFError:  # the engine closed the connection without a stop: it is gone
        logger.warning("the engine's connection closed; exiting")
        os._exit(1)
    except BaseException:
        logger.exception("worker failed")
        conn.send(("error", args.rank, traceback.format_exc()))
        os._exit(1)
    destroy_distributed()


def _worker_device(device: str, local_rank: int) -> torch.device:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid: no CUDA device is available; use 'cpu'")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} needs a CUDA device, but this node has "
                         f"{torch.cuda.device_count()}: start fewer ranks per node")
    return torch.device("cuda", local_rank)


class Worker:
    """The runner of one rank and the loop that feeds it."""

    def __init__(self, rank: int, runner: ModelRunner, parallel: ParallelState,
                 figures: dict[str, Any]) -> None:
        self.rank = rank
        self.runner = runner
        self.parallel = parallel
        self.figures = figures
        self.is_output_rank = rank == parallel.layout.output_rank

    @classmethod
    def start(cls, args: WorkerArgs, store: Any) -> Worker:
        """Join the process group and build this rank's runner."""
        config, parallel_config = args.config, args.config.parallel_config
        start = time.perf_counter()
        device = _worker_device(config.device, args.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the node's cores shared among its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel_config.ranks_per_node))
        dtype = resolve_dtype(config.dtype, config.model_config, device)
        parallel = init_distributed(parallel_config, args.rank, device, store)
        if parallel_config.all_reduce == "one-shot" and device.type == "cuda":
            parallel.tp.enable_one_shot(device, dtype)
        torch.manual_seed(config.seed)  # every rank samples the same tokens
        runner = ModelRunner.create(config, device, dtype, parallel)
        layout = parallel.layout
        weights_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_bytes = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
        figures = {
            "rank": args.rank, "tp_rank": layout.tp_rank, "pp_rank": layout.pp_rank,
            "pid": os.getpid(), "device": str(device), "weights_gb": weights_bytes / 1e9,
            "kv_gb": kv_bytes / 1e9,
            "num_kv_blocks": runner.num_kv_blocks, "num_host_kv_blocks": runner.num_host_kv_blocks,
            "peak_step_gb": runner.reserved_bytes / 1e9,
            "num_layers": runner.kv_spec.num_layers, "num_kv_heads": runner.kv_spec.num_kv_heads,
            "startup_s": time.perf_counter() - start,
            "kv_transfer_stats": runner.kv_transfer_stats(),
        }
        return cls(args.rank, runner, parallel, figures)

    def serve(self, conn: Connection) -> None:
        """Run steps until told to stop; reads each step once it has finished,
        the output rank sending its output back."""
        steps: deque[tuple[int, PendingStep]] = deque()
        watcher = _StepWatcher() if self.runner.device.type == "cuda" else None
        while True:
            while steps and _finished(steps[0][1]):
                step_id, step = steps.popleft()
                output = step.get()
                if self.is_output_rank:
                    conn.send(("output", step_id, output))
            ready = wait([conn] if watcher is None or not steps else [conn, watcher.wake_fd])
            if watcher is not None and watcher.wake_fd in ready:
                watcher.drain()
            if conn not in ready:
                continue
            message = conn.recv()
            kind = message[0]
            if kind == "step":
                _, step_id, scheduler_output, known_tokens = message
                pending = self._step(scheduler_output, known_tokens)
                if scheduler_output.kv_offloads or scheduler_output.kv_onloads:
                    conn.send(("kv_stats", step_id, self.rank,
                               self.runner.kv_transfer_stats()))
                if isinstance(pending, PendingStep):
                    steps.append((step_id, pending))
                    if watcher is not None:
                        watcher.watch(pending)
            elif kind == "add_lora":
                conn.send(("reply", message[1], self.rank, self._add_lora(message[2])))
            elif kind == "remove_lora":
                known = self.runner.remove_lora(message[2])
                conn.send(("reply", message[1], self.rank, None if known else "unknown"))
            elif kind == "stop":
                if self.parallel.pp is not None:
                    self.parallel.pp.wait_sends()
                return
            else:
                raise RuntimeError(f"unknown message '{kind}'")

    def _step(self, scheduler_output: SchedulerOutput,
              known_tokens: dict[str, list[int]] | None) -> PendingStep | ModelRunnerOutput:
        if known_tokens and not self.runner.samples:
            self.runner.append_known_tokens(known_tokens)
        return self.runner.execute_model(scheduler_output)

    def _add_lora(self, lora_request: Any) -> str | None:
        try:
            self.runner.add_lora(lora_request)
        except ValueError as exc:
            return str(exc)
        return None


def _finished(step: PendingStep) -> bool:
    """Whether the device is done with ``step`` (on the CPU it ran synchronously)."""
    return step.output is not None or not isinstance(step.end, torch.cuda.Event) or (
        step.end.query())


class _StepWatcher:
    """A thread that waits for each queued step's end event and then wakes the
    worker's loop through a pipe (it only waits: the loop reads the step)."""

    def __init__(self) -> None:
        self.wake_fd, self._wake_w = os.pipe()
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="kvserve-step-watcher").start()

    def watch(self, step: PendingStep) -> None:
        self._events.put(step.end)

    def drain(self) -> None:
        os.read(self.wake_fd, 4096)

    def _run(self) -> None:
        while True:
            self._events.get().synchronize()
            os.write(self._wake_w, b"x")
