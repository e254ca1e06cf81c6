"""The executor of a tensor / pipeline-parallel engine: one worker process per
device, driven from the engine's process, behind the same interface as the
in-process ``ModelRunner`` (``execute_model`` returns something whose
``get`` waits for the step's output; ``add_lora``; ``num_kv_blocks``).

Start-up: serve the rendezvous store (``master_addr:master_port``, as
torchrun's rendezvous does) and a control listener whose address and key it
publishes there; start this node's workers (``worker.start_workers``; other
nodes start theirs with ``kvserve serve --node-rank N``, see
``node_agent.py``); accept one authenticated connection per rank, checking
every node runs the same configuration; wait until every rank is ready (a
rank's ``ValueError``, e.g. a model that does not fit, is raised here) and
log each rank's figures.

Each step: pickle the plain-data ``SchedulerOutput`` once and send it to
every rank; only the output rank (TP rank 0 of the last pipeline stage)
answers, so ``get`` reads its connection (and, for a step that copies KV
blocks to or from the host tier, every rank's copy counters, which
``kv_transfer_stats`` adds up). The engine process runs no
collective itself, so a dead or hung worker can never block it: while it
waits it watches every connection and every local process, and a rank that
dies, reports an error or stays silent past ``distributed_timeout_s`` fails
the executor: the remaining workers are killed and every later call raises
``WorkerFailedError``. Workers exit on their own when this process dies.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

import torch.distributed as dist

from kvserve.config import EngineConfig
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.sharding import RankLayout
from kvserve.lora.request import LoRARequest
from kvserve.worker.worker import (
    AUTHKEY_KEY,
    CONTROL_KEY,
    WorkerProcess,
    config_fingerprint,
    start_workers,
    stop_processes,
)

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
PEER_DEATH_WAIT_S = 1.0  # how long a rank's error waits to learn whether a peer died


class WorkerFailedError(RuntimeError):
    """A worker process died, failed or hung; the executor cannot go on."""


def control_listener(host: str, authkey: bytes, ranks: int) -> Listener:
    """The engine's control listener on a free port of ``host``, its queue long
    enough for every rank's connection: the ranks connect at once while it
    accepts them one by one (each with an authentication handshake), and with
    ``Listener``'s default queue of 1 Linux answers the surplus with SYN
    cookies and then drops their final ACKs, so a rank's ``Client`` believes
    it is connected and waits for a challenge that never comes."""
    return Listener((host, 0), authkey=authkey, backlog=max(1, ranks))


class RemoteStep:
    """A step sent to the workers; ``get`` waits for the output rank's answer."""

    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self.executor = executor
        self.step_id = step_id

    def get(self) -> ModelRunnerOutput:
        return self.executor.output_of(self.step_id)


def startup_error(rank: int, message: tuple[Any, ...]) -> BaseException:
    """The exception a rank's ``startup_error`` message stands for: its ValueError
    (the model does not fit, a bad flag) as one, anything else as a failure."""
    _, _, kind, text = message
    if kind == "ValueError":
        return ValueError(text)
    return WorkerFailedError(f"rank {rank} failed to start: {kind}: {text}")


class MultiprocExecutor:
    """Worker processes of a parallel split, driven from this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel_config
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank={parallel.node_rank}: only node 0 runs the engine; start the other "
                "nodes with `kvserve serve ... --node-rank N`, which runs their workers")
        self.layout = RankLayout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.timeout_s = parallel.distributed_timeout_s
        self.failure: str | None = None
        self._step_ids = itertools.count()
        self._call_ids = itertools.count()
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._replies: dict[int, dict[int, str | None]] = {}
        # host KV tier: each rank's last copy counters, and the steps with
        # copies whose counters some ranks have not sent yet (step -> ranks left)
        self._kv_stats: dict[int, dict[str, float]] = {}
        self._kv_stats_owed: dict[int, int] = {}
        # tokens the last stage sampled that the earlier stages have not been sent
        self._known_tokens: dict[str, list[int]] = {}
        self.conns: list[Connection] = []
        self.workers: list[WorkerProcess] = []
        self._finalizer = weakref.finalize(self, stop_processes, self.workers, 0.0)
        self._store = dist.TCPStore(parallel.master_addr, parallel.master_port, is_master=True,
                                    wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout_s))
        authkey = os.urandom(32)
        self._listener = control_listener(parallel.master_addr, authkey, self.layout.world_size)
        port = self._listener.address[1]
        self._store.set(CONTROL_KEY, f"{parallel.master_addr}:{port}")
        self._store.set(AUTHKEY_KEY, authkey.hex())
        try:
            local = range(parallel.ranks_per_node)  # node 0's ranks
            self.workers += start_workers(config, local, parallel.master_addr, self._store.port)
            self.conns = self._accept()
            self.figures = self._wait_ready()
        except BaseException:
            self.shutdown(kill=True)
            raise
        self.num_kv_blocks = int(self.figures[0]["num_kv_blocks"])
        self.num_host_kv_blocks = int(self.figures[0]["num_host_kv_blocks"])
        self._kv_stats = {f["rank"]: f["kv_transfer_stats"] for f in self.figures
                          if f["kv_transfer_stats"]}
        for f in self.figures:
            logger.info("rank %d (TP rank %d, stage %d, pid %d) on %s: weights %.2f GB, profiled "
                        "step %.2f GB, KV %.2f GB for %d layers x %d KV heads, %d blocks, ready "
                        "in %.1f s", f["rank"], f["tp_rank"], f["pp_rank"], f["pid"], f["device"],
                        f["weights_gb"], f["peak_step_gb"], f["kv_gb"], f["num_layers"],
                        f["num_kv_heads"], f["num_kv_blocks"], f["startup_s"])

    # ------------------------------------------------------------ start-up

    def _accept(self) -> list[Connection]:
        """One connection per rank, in rank order."""
        world = self.layout.world_size
        accepted: dict[int, Connection] = {}
        errors: list[BaseException] = []

        def accept_all() -> None:
            try:
                while len(accepted) < world:
                    conn = self._listener.accept()
                    kind, rank, fingerprint = conn.recv()
                    if kind != "hello" or not 0 <= rank < world or rank in accepted:
                        raise WorkerFailedError(f"an unexpected control message {kind!r} from "
                                                f"rank {rank}")
                    ours = config_fingerprint(self.config)
                    differ = [name for name in ours if fingerprint.get(name) != ours[name]]
                    if differ:
                        raise ValueError(
                            f"rank {rank} runs another engine configuration than node 0 "
                            f"({', '.join(differ)} differ): start every node with the same "
                            "model and engine flags")
                    accepted[rank] = conn
            except BaseException as exc:  # closing the listener ends a waiting accept
                errors.append(exc)

        thread = threading.Thread(target=accept_all, daemon=True, name="kvserve-accept")
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.2)
            self._check_started(accepted)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(accepted))
                raise WorkerFailedError(
                    f"ranks {missing} did not connect within distributed_timeout_s="
                    f"{self.timeout_s:g}: start every node (kvserve serve --node-rank N) with "
                    "the same --master-addr / --master-port")
        if errors:
            raise errors[0]
        return [accepted[rank] for rank in range(world)]

    def _wait_ready(self) -> list[dict[str, Any]]:
        """Every rank's start-up figures, once each is ready; a rank's ValueError
        (the model does not fit, a bad flag) is raised as one."""
        figures: dict[int, dict[str, Any]] = {}
        while len(figures) < self.layout.world_size:
            for rank, message in self._receive(deadline=time.monotonic() + self.timeout_s):
                if message[0] == "ready":
                    figures[rank] = message[2]
                elif message[0] == "startup_error":
                    raise startup_error(rank, message)
        return [figures[rank] for rank in range(self.layout.world_size)]

    def _check_started(self, accepted: dict[int, Connection]) -> None:
        """While ranks still connect: a worker that has exited after reporting its
        start-up error (it connected, then failed to build) raises that error;
        any other exit raises its death notice."""
        for worker in self.workers:
            if worker.process.is_alive():
                continue
            conn = accepted.get(worker.rank)
            if conn is not None and conn.poll():
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = ("",)
                if message[0] == "startup_error":
                    raise startup_error(worker.rank, message)
            self._fail(self._death_notice(worker.rank))

    # ------------------------------------------------------------ steps

    def execute_model(self, scheduler_output: SchedulerOutput) -> RemoteStep | ModelRunnerOutput:
        """Send the step to every rank; an empty step (it may end requests) is
        answered by no one and returns a finished output at once."""
        known, self._known_tokens = self._known_tokens, {}
        step_id = next(self._step_ids)
        if scheduler_output.kv_offloads or scheduler_output.kv_onloads:
            self._kv_stats_owed[step_id] = self.layout.world_size
        self._broadcast(("step", step_id, scheduler_output, known or None))
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        return RemoteStep(self, step_id)

    def output_of(self, step_id: int) -> ModelRunnerOutput:
        """The output of step ``step_id``, waiting for it."""
        while step_id not in self._outputs or (self._kv_stats_owed
                                               and min(self._kv_stats_owed) <= step_id):
            self._dispatch(self._receive(deadline=time.monotonic() + self.timeout_s))
        output = self._outputs.pop(step_id)
        if self.layout.pp_size > 1:  # the earlier stages learn them with the next step
            for request_id, token_ids in output.sampled_token_ids.items():
                self._known_tokens.setdefault(request_id, []).extend(token_ids)
        return output

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter on every rank; the first rank's ValueError is raised."""
        errors = [e for _, e in sorted(self._call("add_lora", lora_request).items())
                  if e is not None]
        if errors:
            raise ValueError(errors[0])

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter on every rank; False if the first rank did not know it."""
        replies = self._call("remove_lora", lora_int_id)
        return replies[min(replies)] is None

    def _call(self, kind: str, argument: Any) -> dict[int, str | None]:
        """Send a call to every rank and wait for each rank's reply (by rank)."""
        call_id = next(self._call_ids)
        self._replies[call_id] = {}
        self._broadcast((kind, call_id, argument))
        while len(self._replies[call_id]) < self.layout.world_size:
            self._dispatch(self._receive(deadline=time.monotonic() + self.timeout_s))
        return self._replies.pop(call_id)

    def kv_transfer_stats(self) -> dict[str, float]:
        """The host tier's copies over all ranks, as of the last step read:
        bytes added up (each rank moves its own shard of a block), copy times
        the slowest rank's (the ranks copy at the same time). Safe to call
        from another thread than the one that steps."""
        per_rank = list(self._kv_stats.values())
        if not per_rank:
            return {}
        return {key: (max if key.endswith("_s") else sum)(stats[key] for stats in per_rank)
                for key in per_rank[0]}

    def _broadcast(self, message: tuple[Any, ...]) -> None:
        self._raise_if_failed()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                self._fail(f"{self._death_notice(rank)} ({exc!r})")

    def _dispatch(self, messages: list[tuple[int, tuple[Any, ...]]]) -> None:
        for rank, message in messages:
            if message[0] == "output":
                self._outputs[message[1]] = message[2]
            elif message[0] == "reply":
                self._replies[message[1]][rank] = message[3]
            elif message[0] == "kv_stats":
                _, step_id, _, stats = message
                self._kv_stats[rank] = stats
                self._kv_stats_owed[step_id] -= 1
                if not self._kv_stats_owed[step_id]:
                    del self._kv_stats_owed[step_id]
            else:
                self._fail(f"rank {rank} sent an unexpected {message[0]!r} message")

    def _receive(self, deadline: float) -> list[tuple[int, tuple[Any, ...]]]:
        """The next messages from any rank, watching for dead or silent workers."""
        self._raise_if_failed()
        sentinels = {w.process.sentinel: w for w in self.workers}
        ready = wait([*self.conns, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            self._fail(f"no answer from the workers for distributed_timeout_s="
                       f"{self.timeout_s:g}: a worker hangs")
        messages = []
        for rank, conn in enumerate(self.conns):
            if conn not in ready:
                continue
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._fail(self._death_notice(rank))
            if message[0] == "error":
                self._fail(self._error_notice(rank, message[2]))
            messages.append((rank, message))
        if not messages:  # a local process ended without a word
            self._check_processes()
        return messages

    # ------------------------------------------------------------ failure, shutdown

    def _check_processes(self) -> None:
        for worker in self.workers:
            if not worker.process.is_alive():
                self._fail(self._death_notice(worker.rank))

    def _death_notice(self, rank: int) -> str:
        for worker in self.workers:
            if worker.rank == rank:
                worker.process.join(1.0)  # its connection may close just before it exits
                if worker.process.exitcode is not None:
                    return (f"worker rank {rank} (pid {worker.process.pid}) exited with code "
                            f"{worker.process.exitcode}")
        return f"worker rank {rank} closed its connection (it died)"

    def _error_notice(self, rank: int, text: str) -> str:
        """A rank's error, led by the death of another local worker if one has
        exited within a second: a collective fails on every rank when a peer dies,
        and the death is the cause to report."""
        deadline = time.monotonic() + PEER_DEATH_WAIT_S
        for worker in self.workers:
            if worker.rank != rank:
                worker.process.join(max(0.0, deadline - time.monotonic()))
                if worker.process.exitcode is not None:
                    return f"{self._death_notice(worker.rank)}; rank {rank} then failed:\n{text}"
        return f"rank {rank} failed:\n{text}"

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise WorkerFailedError(self.failure)

    def _fail(self, reason: str) -> None:
        """Kill every worker and raise; every later call raises too."""
        if self.failure is None:
            logger.error("parallel executor failed: %s", reason)
            self.failure = reason
            self.shutdown(kill=True)
        raise WorkerFailedError(reason)

    def shutdown(self, kill: bool = False) -> None:
        """Stop the workers (at once with ``kill``), close the connections and
        the store. Idempotent."""
        if not kill and self.failure is None:
            payload = pickle.dumps(("stop",))
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(payload)
        stop_processes(self.workers, 0.0 if kill else STOP_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self._listener.close()
        if self.failure is None:
            self.failure = "the executor was shut down"
