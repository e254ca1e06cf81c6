"""The engine core: the scheduler plus an executor, stepped in a loop.

It works in token ids only (no text); it runs in the front end's process
(``core_client.InprocCoreClient``) or in its own (``core_proc``). The
executor is anything with ``execute_model``, which queues a step and
returns something whose ``get()`` waits for its output: the in-process
``ModelRunner`` on one device, or with tensor / pipeline parallelism the
``MultiprocExecutor``, which broadcasts each step to its
worker processes (``create_executor`` picks; it is the engine's one door
to the worker layer).

With async scheduling (the default on CUDA) one step stays in flight: each
``step()`` schedules and queues step N+1, then waits for step N and reports
its outputs, so the host's scheduling, input preparation and output
processing overlap the device's work instead of leaving it idle. Greedy
output is the same either way; a request that stops (EOS, stop string) costs
one step of wasted device work for it. A speculative step (one that verifies
proposals or makes them) is otherwise read before the next step is planned (from
its accepted tokens and new proposals): without async scheduling it is
reported in the call that queued it; with it, it stays in flight and the
next call reads it, plans and queues the next step, and only then returns
its outputs, so the front end's output processing (detokenising, stop
strings) overlaps the next step's device work as for plain steps. Its stop
strings and aborts then land one step late, as they do for plain steps.
When the scheduler plans ahead (``Scheduler.plans_ahead``: proposals made
on the device) a speculative step is kept in flight like a plain one: the
next step is planned and queued before it is read.

With pipeline parallelism (``pipeline_parallel_size`` stages) as many steps
are kept in flight as there are stages, so each stage works on its own
step; the scheduler gives each step requests of its own, since a request's
next step needs the token its previous one samples at the last stage.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections import deque
from typing import Any, Protocol

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.engine.kv_connector import KVConnector, check_kv_transfer_params
from kvserve.lora.request import LoRARequest

# how long an idle step waits while adapters are read back from disk
LORA_READ_POLL_S = 0.002


class PendingOutput(Protocol):
    """A queued step; ``get`` waits for it (a ``ModelRunnerOutput`` is one, done)."""

    def get(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    """Runs the model for one scheduler step."""

    num_kv_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput: ...

    def add_lora(self, lora_request: LoRARequest) -> None: ...

    def remove_lora(self, lora_int_id: int) -> bool: ...

    def shutdown(self, kill: bool = False) -> None:
        """Stop whatever the executor started (worker processes; ``kill``: at
        once, without waiting for them); idempotent."""


def create_executor(config: EngineConfig) -> Executor:
    """Load the model on the configured device, or start a worker process per
    device of a parallel split (the only place the engine reaches into the
    worker layer; imported lazily)."""
    if config.parallel_config.world_size > 1:
        from kvserve.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from kvserve.worker.executor import create_model_runner

    return create_model_runner(config)


def run_worker_node(config: EngineConfig) -> int:
    """Run the workers of a node other than node 0 of a multi-node engine
    until the engine stops; the exit status (imported lazily, as above)."""
    from kvserve.worker.node_agent import run_node_agent

    return run_node_agent(config)


class EngineCore:
    """Schedules, executes and reports, one step at a time."""

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.scheduler = Scheduler(
            config.scheduler_config, config.cache_config, executor.num_kv_blocks + 1,
            config.lora_config, config.cuda_graph_token_sizes, config.speculative_config,
            getattr(executor, "num_host_kv_blocks", 0),
        )
        self.async_scheduling = config.scheduler_config.async_scheduling
        # steps left queued when step() returns: none, or with async scheduling
        # one, or one fewer than the pipeline's stages
        num_stages = config.scheduler_config.pipeline_parallel_size
        self.max_in_flight = max(1, num_stages - 1) if self.async_scheduling else 0
        # steps queued but not yet reported, oldest first
        self._in_flight: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        self.num_steps = 0
        self.last_step_s = time.monotonic()
        self.device_s = 0.0
        self.wait_s = 0.0  # time the host spent blocked on a step's output
        self.num_graph_steps = 0  # steps that replayed a CUDA graph
        self.num_padding_tokens = 0  # their tokens beyond the steps' own
        # disaggregated prefill / decode (--kv-role prefill | decode)
        self.kv_connector = (KVConnector(config.kv_transfer_config, self.scheduler, executor)
                             if config.kv_transfer_config.disaggregated else None)

    def add_request(self, request: Request) -> None:
        if self.kv_connector is not None:
            self.kv_connector.add_request(request)
            return
        check_kv_transfer_params(request.sampling_params.kv_transfer_params, "both")
        self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter in the executor (once per ``lora_int_id``)."""
        self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter in the executor (False: unknown); ValueError while an
        unfinished request uses it."""
        num_using = sum(r.lora_int_id == lora_int_id
                        for r in (*self.scheduler.running, *self.scheduler.waiting))
        if num_using:
            raise ValueError(f"lora_int_id={lora_int_id}: {num_using} unfinished requests use "
                             "this adapter; unload it once they finish")
        return self.executor.remove_lora(lora_int_id)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """End requests now; returns their final outputs (finish_reason "abort")."""
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        # a request that reports only its first and last outputs has unreported tokens
        return [EngineCoreOutput(r.request_id, [] if r.report_every_step else
                                 r.all_token_ids[r.num_prompt_tokens + r.num_reported_outputs:],
                                 finish_reason="abort") for r in finished]

    def finish_stopped(self, request_ids: list[str]) -> None:
        """End requests stopped by a stop string found in their text."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        for request_id in request_ids:  # no output says where their KV is: not kept
            self.scheduler.release_kv(request_id)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and queue a step; report the oldest step beyond those kept
        in flight: this one, or with async scheduling one queued by an earlier
        call. An empty step is never left in flight; it reports the oldest
        step in flight, so its requests can run again. A speculative step in
        flight is reported before the next step is planned."""
        outputs = []
        if (self._in_flight and self._in_flight[-1][0].is_spec_step
                and not self.scheduler.plans_ahead):
            outputs = self._report(list(self._in_flight))
            self._in_flight.clear()
        self._prefetch_loras()
        scheduler_output = self.scheduler.schedule()
        pending = self.executor.execute_model(scheduler_output)
        to_report: list[tuple[SchedulerOutput, PendingOutput]] = []
        if scheduler_output.is_spec_step and not self.max_in_flight:
            # read at once: the next step is planned from it
            to_report.extend(self._in_flight)
            self._in_flight.clear()
            to_report.append((scheduler_output, pending))
        elif scheduler_output.is_empty:
            if self._in_flight:
                to_report.append(self._in_flight.popleft())
            to_report.append((scheduler_output, pending))
        else:
            self._in_flight.append((scheduler_output, pending))
            while len(self._in_flight) > self.max_in_flight:
                to_report.append(self._in_flight.popleft())
        outputs += self._report(to_report)
        if self.kv_connector is not None:
            self.kv_connector.after_step(outputs)
            if scheduler_output.is_empty and not self._in_flight and not outputs:
                self.kv_connector.wait()  # only transfers under way: do not spin
        self.last_step_s = time.monotonic()
        return outputs

    def _report(self, steps: list[tuple[SchedulerOutput, PendingOutput]]
                ) -> list[EngineCoreOutput]:
        """Wait for ``steps`` (oldest first) and update the scheduler from them."""
        outputs = []
        for reported_output, reported_pending in steps:
            start = time.perf_counter()
            runner_output = reported_pending.get()
            self.wait_s += time.perf_counter() - start
            self.device_s += runner_output.device_s
            self.num_graph_steps += runner_output.graphed
            self.num_padding_tokens += runner_output.num_padding_tokens
            outputs += self.scheduler.update_from_output(reported_output, runner_output)
            self.num_steps += not reported_output.is_empty
        return outputs

    def _prefetch_loras(self) -> None:
        """Start reading the adapters the next waiting requests need and the
        host cache dropped; the scheduler holds those requests back until
        they are in (an executor without ``prefetch_loras`` reads in its step)."""
        prefetch = getattr(self.executor, "prefetch_loras", None)
        if prefetch is None or not self.scheduler.max_loras:
            return
        loading = self.scheduler.loras_loading = prefetch(self.scheduler.waiting_lora_ids())
        if loading and not self.scheduler.running and not self._in_flight:
            time.sleep(LORA_READ_POLL_S)  # nothing else to run: no busy loop

    def housekeep(self) -> None:
        """Work that does not wait for requests: free the blocks of a prefill
        engine's offers that ended while it had nothing to run."""
        if self.kv_connector is not None:
            self.kv_connector.after_step([])

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests or bool(self._in_flight)
                or (self.kv_connector is not None and self.kv_connector.busy()))

    def shutdown(self, kill: bool = False) -> None:
        """Stop the executor's processes, if it has any (``kill``: at once)."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.shutdown(kill)

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    def stats(self) -> dict[str, Any]:
        # the host KV tier's bytes and copy times, where the executor counts them
        transfers: dict[str, Any] = getattr(self.executor, "kv_transfer_stats", dict)()
        if self.kv_connector is not None:
            transfers.update(self.kv_connector.stats())
        return {**self.scheduler.stats(), **transfers, "num_steps": self.num_steps,
                "num_graph_steps": self.num_graph_steps,
                "num_padding_tokens": self.num_padding_tokens,
                "device_s": self.device_s, "wait_s": self.wait_s}


def freeze_startup_heap() -> None:
    """Collect, then freeze the garbage collector's heap (``gc.freeze``) so
    later collections skip everything alive now: the model, tokenizer and
    start-up objects, some 200K tracked objects with a preset, whose full
    collection paused a W2 step for 122 ms on an H100 host (vLLM's engine
    core does the same). Only for a process that owns its engine for life
    (the server, the benchmarks): a frozen object that later becomes cyclic
    garbage is never freed, so an in-process ``LLM`` does not call it.

    The heap is unfrozen at exit, so the interpreter's last collections free
    it: Triton's bindings (nanobind) print some 30 lines about "leaked"
    objects when their objects are still alive at shutdown."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however often this is called
    atexit.register(gc.unfreeze)
