"""The model runner: turns a ``SchedulerOutput`` into one forward pass and a
``ModelRunnerOutput``.

It keeps a persistent state per request (token ids, a row of the host block
tables, sampling params and the request's random generator) updated from the
scheduler's diffs, flattens the step's tokens of all requests into one batch
in persistent buffers, builds the attention metadata once, runs the model
(a decode step replays a CUDA graph when one is captured), computes logits
only at the last position of each request that has caught up with its
tokens, and samples. At start-up it profiles a largest step to size the KV
cache. It owns the model, the KV cache tensors and the graphs; it knows
nothing about queues, budgets or text.

``execute_model`` only queues the step and returns a ``PendingStep``: the
sampled tokens are copied to pinned host memory behind an event, and
``PendingStep.get`` waits for that event alone, not for later steps. So the
engine can queue step N+1 before reading step N (async scheduling); a token
of step N that step N+1 needs as input is then copied on the device from
step N's sampled tensor ("carried"). Requests with penalties or below
``min_tokens`` need their whole output on the host, so a step that would
carry one of their tokens reads the previous step first.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.attention.backend import get_attention_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.outputs import Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvserve.core.sampling_params import SamplingParams
from kvserve.layers.attention import bind_kv_cache
from kvserve.layers.custom_ops import set_triton_ops
from kvserve.lora.manager import LoRAManager
from kvserve.lora.request import LoRARequest
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM
from kvserve.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from kvserve.worker.cuda_graph import CudaGraphs
from kvserve.worker.input_batch import BlockTables, StepBuffers
from kvserve.worker.kv_cache import (
    allocate_kv_caches,
    allocate_scratch_kv_caches,
    check_weights_fit,
)

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    """What the runner remembers about a request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output, extended with each sampled token
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_computed_tokens: int
    row: int | None  # its row of the block tables; None while preempted
    lora_int_id: int = 0  # the request's LoRA adapter; 0: none

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def has_penalties(self) -> bool:
        params = self.sampling_params
        return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                or params.repetition_penalty != 1.0)

    @property
    def reads_outputs(self) -> bool:
        """Whether sampling reads the output tokens (penalties) or their count
        (``min_tokens``); other requests' outputs are never copied for it."""
        return self.has_penalties or self.sampling_params.min_tokens > 0

    @property
    def needs_known_outputs(self) -> bool:
        """Whether sampling reads the output tokens themselves (penalties) or
        their exact count (still below ``min_tokens``), not just the last one."""
        num_outputs = len(self.token_ids) - len(self.prompt_token_ids)
        return self.has_penalties or num_outputs < self.sampling_params.min_tokens


@dataclass
class StepInputs:
    """The flattened batch of one step (device tensors are views of ``StepBuffers``)."""

    request_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    # requests that sample this step, and the row of their last token
    sample_request_ids: list[str]
    logits_indices: torch.Tensor  # [num_sample_requests]
    # the decode graph (batch size) or token graph (token count) this step
    # replays; both None: eager
    decode_graph_size: int | None
    token_graph_size: int | None
    num_padding_tokens: int  # the graph's tokens beyond the step's


class PendingStep:
    """A step queued on the device; ``get`` waits for it and reads its output.

    Steps are read in the order they ran: getting one first reads any older
    step not read yet, since each appends its tokens to the requests' state.
    """

    def __init__(
        self,
        states: list[RunnerRequestState],
        host_tensors: list[torch.Tensor],
        start: Any,
        end: Any,
        read_oldest: Callable[[], None],
        graphed: bool,
        num_padding_tokens: int,
    ) -> None:
        self.states = states  # the requests that sampled, in row order
        # sampled ids (then logprob ids, logprobs, ranks), valid once ``end`` is reached
        self.host_tensors = host_tensors
        self.start, self.end = start, end  # see ModelRunner._mark
        self.output: ModelRunnerOutput | None = None
        self._read_oldest = read_oldest  # reads the runner's oldest unread step
        self.graphed, self.num_padding_tokens = graphed, num_padding_tokens

    def get(self) -> ModelRunnerOutput:
        while self.output is None:
            self._read_oldest()
        return self.output


def largest_step_query_lens(sched: SchedulerConfig) -> list[int]:
    """Query lengths of the largest step the scheduler can form: as many
    tokens as the budget allows, in as few requests as ``max_model_len``
    permits (the longest attention), never more than ``max_num_seqs``."""
    num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * sched.max_model_len)
    num_reqs = -(-num_tokens // sched.max_model_len)
    return [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]


class ModelRunner:
    """Owns the model, the KV cache and the per-request state on one device."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "torch",
        cuda_graph_sizes: tuple[int, ...] = (),
        lora_config: LoRAConfig | None = None,
        cuda_graph_token_sizes: tuple[int, ...] = (),
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.backend = get_attention_backend(attention_backend)
        # the fused Triton small ops go with the Triton attention backend on
        # CUDA; the torch backend keeps the whole forward as the reference
        use_triton = device.type == "cuda" and attention_backend == "triton"
        if use_triton:
            set_triton_ops(model, True)
        self.sampler = Sampler(use_triton=use_triton)
        self.states: dict[str, RunnerRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        # wraps the LoRA-capable linears before any graph is captured
        self.lora_manager = (LoRAManager(model, lora_config, device)
                             if lora_config is not None else None)
        use_graphs = (device.type == "cuda" and bool(cuda_graph_sizes)
                      and self.backend.supports_cuda_graphs)
        self.cuda_graph_sizes = cuda_graph_sizes if use_graphs else ()
        self.cuda_graph_token_sizes = cuda_graph_token_sizes if use_graphs else ()
        max_num_reqs = scheduler_config.max_num_seqs
        max_blocks_per_req = -(-scheduler_config.max_model_len // self.block_size)
        self.block_tables = BlockTables(max_num_reqs, max_blocks_per_req)
        max_num_tokens = max(scheduler_config.max_num_batched_tokens,
                             max(self.cuda_graph_sizes, default=0),
                             max(self.cuda_graph_token_sizes, default=0))
        self.buffers = StepBuffers(max_num_tokens, max_num_reqs, max_blocks_per_req, device)
        self.graphs: CudaGraphs | None = None
        # queued steps whose tokens are not appended to the states yet, oldest first
        self._unread: deque[PendingStep] = deque()
        # the last step that sampled: its sampled tokens (on the device) and
        # each request's row in them, for tokens the next step must carry
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> ModelRunner:
        """Load the model, profile a largest step, allocate the KV cache, capture graphs."""
        check_weights_fit(config.model_config, dtype, device,
                          config.cache_config.gpu_memory_utilization)
        start = time.perf_counter()
        model = load_model(
            config.model_config,
            Path(config.model_path) if config.model_path else None,
            config.load_format,
            dtype,
            device,
            seed=config.seed,
        )
        model.eval()
        weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("weights: %.2f GB in %s, loaded in %.1f s", weights_bytes / 1e9, dtype,
                    time.perf_counter() - start)
        start = time.perf_counter()
        runner = cls(config.model_config, config.cache_config, config.scheduler_config, model,
                     device, dtype, config.attention_backend, config.cuda_graph_sizes,
                     config.lora_config, config.cuda_graph_token_sizes)
        runner.initialize_kv_cache()
        runner.capture_cuda_graphs()
        logger.info("startup after loading weights (profile, KV cache, graphs): %.1f s",
                    time.perf_counter() - start)
        return runner

    def initialize_kv_cache(self) -> None:
        reserved = self.profile_peak_step_bytes() if self.device.type == "cuda" else 0
        self.kv_caches, self.num_kv_blocks = allocate_kv_caches(
            self.model_config, self.cache_config, self.scheduler_config, self.device,
            self.dtype, reserved,
        )
        bind_kv_cache(self.model, self.kv_caches, self.backend)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a PEFT adapter (ValueError naming what does not fit)."""
        if self.lora_manager is None:
            raise ValueError(
                f"lora_request '{lora_request.lora_name}': LoRA is not enabled; "
                "start the engine with enable_lora=True (--enable-lora)"
            )
        self.lora_manager.add_lora(lora_request)

    def capture_cuda_graphs(self) -> None:
        if not self.cuda_graph_sizes and not self.cuda_graph_token_sizes:
            return
        self.graphs = CudaGraphs(self.model, self.buffers, self.cuda_graph_sizes,
                                 self.cuda_graph_token_sizes, self.scheduler_config.max_model_len)
        self.graphs.capture()

    # ------------------------------------------------------------ profiling

    @torch.inference_mode()
    def profile_peak_step_bytes(self) -> int:
        """Device memory a largest step needs beyond the weights, measured.

        Runs one dummy step of ``max_num_batched_tokens`` tokens (spread over
        requests of at most ``max_model_len``), logits and sampling with
        top-k/top-p for ``max_num_seqs`` rows, then a largest decode batch.
        The CUDA graphs' pool is kept apart from the allocator, so it is
        counted again: the decode peak, or with token graphs (which capture
        a largest step too) the larger of the two peaks. Runs against a
        one-block scratch cache: every query reads the null block and writes
        nothing.
        """
        sched = self.scheduler_config
        query_lens = largest_step_query_lens(sched)
        num_tokens, num_reqs = sum(query_lens), len(query_lens)
        scratch = allocate_scratch_kv_caches(self.model_config, self.cache_config, self.device,
                                             self.dtype)
        bind_kv_cache(self.model, scratch, self.backend)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_step(query_lens, sample_rows=sched.max_num_seqs)
        torch.cuda.synchronize(self.device)
        prefill_peak = torch.cuda.max_memory_allocated(self.device) - base
        decode_size = max(self.cuda_graph_sizes, default=0)
        decode_peak = 0
        if decode_size:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._dummy_step([1] * decode_size, sample_rows=decode_size)
            torch.cuda.synchronize(self.device)
            decode_peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch  # the layers keep it (two blocks each) until the real caches are bound
        torch.cuda.empty_cache()
        graph_reserve = (max(prefill_peak, decode_peak) if self.cuda_graph_token_sizes
                         else decode_peak)
        logger.info(
            "profiled peak step: %.2f GB (%d tokens over %d requests, %d sampled rows)%s",
            prefill_peak / 1e9, num_tokens, num_reqs, sched.max_num_seqs,
            f"; CUDA graph reserve {graph_reserve / 1e9:.2f} GB" if graph_reserve else "",
        )
        return int(prefill_peak + graph_reserve)

    def _dummy_step(self, query_lens: list[int], sample_rows: int) -> None:
        """One forward over prompts of ``query_lens`` tokens, then logits and
        top-k/top-p sampling of ``sample_rows`` rows; reads only the null block."""
        num_tokens, num_reqs = sum(query_lens), len(query_lens)
        query_start_loc = [0, *itertools.accumulate(query_lens)]
        max_blocks = -(-max(query_lens) // self.block_size)
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(query_lens),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=self.device),
            block_table=torch.full((num_reqs, max_blocks), NULL_BLOCK_ID, dtype=torch.int32,
                                   device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=query_lens,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in query_lens])
        hidden = self.model(input_ids, positions, metadata)
        rows = torch.arange(sample_rows, device=self.device) % num_tokens
        logits = self.model.compute_logits(hidden[rows])
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=i)
                  for i in range(sample_rows)]
        batch = SamplingBatch.build(
            params, [[0]] * sample_rows, [[]] * sample_rows, [None] * sample_rows,
            self.model_config.vocab_size, self.device,
        )
        self.sampler(logits, batch)

    # ------------------------------------------------------------ state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            state = self.states.pop(request_id, None)
            if state is not None and state.row is not None:
                self.block_tables.free(state.row)
        for request_id in scheduler_output.preempted_request_ids:
            state = self.states.get(request_id)
            if state is not None and state.row is not None:
                self.block_tables.free(state.row)
                state.row = None
        for new in scheduler_output.new_requests:
            old = self.states.get(new.request_id)
            if old is not None and old.row is not None:
                self.block_tables.free(old.row)
            generator = old.generator if old is not None else self._make_generator(new)
            self.states[new.request_id] = RunnerRequestState(
                request_id=new.request_id,
                prompt_token_ids=list(new.prompt_token_ids),
                token_ids=list(new.all_token_ids),
                sampling_params=new.sampling_params,
                generator=generator,
                num_computed_tokens=new.num_computed_tokens,
                row=self.block_tables.add(list(new.block_ids)),
                lora_int_id=new.lora_int_id,
            )
        for cached in scheduler_output.cached_requests:
            state = self.states[cached.request_id]
            if state.row is None:
                raise RuntimeError(f"request {cached.request_id} resumed without its blocks")
            if cached.new_block_ids:
                self.block_tables.append(state.row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _make_generator(self, new: NewRequestData) -> torch.Generator | None:
        seed = new.sampling_params.seed
        if seed is None:
            return None
        return make_generator(seed, self.device)

    # ------------------------------------------------------------ inputs

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        scheduled = scheduler_output.num_scheduled_tokens
        request_ids = list(scheduled)
        states = [self.states[r] for r in request_ids]
        num_reqs = len(states)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)
        num_scheduled = np.fromiter((scheduled[r] for r in request_ids), np.int64, num_reqs)
        ends = num_computed + num_scheduled
        num_known = np.fromiter((len(s.token_ids) for s in states), np.int64, num_reqs)
        carried = np.flatnonzero(ends > num_known)
        if len(carried) and (self._last_sampled is None or any(
                states[i].needs_known_outputs or request_ids[i] not in self._last_sampled[1]
                for i in carried)):
            self._read_all_steps()
            num_known = np.fromiter((len(s.token_ids) for s in states), np.int64, num_reqs)
            carried = np.flatnonzero(ends > num_known)
        if len(carried) and int((ends - num_known)[carried].max()) > 1:
            raise RuntimeError("a step needs more than one token the host has not seen")
        carried_src = np.empty(len(carried), dtype=np.int64)
        if len(carried):
            assert self._last_sampled is not None
            sampled_rows = self._last_sampled[1]
            carried_src[:] = [sampled_rows[request_ids[i]] for i in carried]
        rows = np.fromiter((s.row for s in states), np.int64, num_reqs)
        # a carried token is a 0 here, overwritten on the device
        token_chunks = [s.token_ids[s.num_computed_tokens:end] for s, end in zip(
            states, ends.tolist(), strict=True)]
        for i in carried:
            token_chunks[i] = [*token_chunks[i], 0]
        decode_size = token_size = None
        padded_num_reqs, padded_num_tokens = num_reqs, int(num_scheduled.sum())
        # graphs hold the base model only: a step with an adapter runs eagerly
        if self.graphs is not None and not any(s.lora_int_id for s in states):
            if int(num_scheduled.max()) == 1:
                decode_size = self.graphs.decode_size(num_reqs)
            if decode_size is not None:
                padded_num_reqs = padded_num_tokens = decode_size
            else:
                token_size = self.graphs.token_size(padded_num_tokens)
                if token_size is not None:
                    padded_num_reqs, padded_num_tokens = self.buffers.max_num_reqs, token_size
        host = self.buffers.fill(
            token_chunks, num_computed, num_scheduled, np.maximum(num_known, ends), rows,
            self.block_tables, self.block_size, padded_num_reqs, padded_num_tokens, carried,
            carried_src,
        )
        b = self.buffers
        if host.num_carried:
            assert self._last_sampled is not None
            dst, src = b.carry[0, :host.num_carried], b.carry[1, :host.num_carried]
            b.input_ids[dst] = self._last_sampled[0][src]
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=host.num_tokens,
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
            query_start_loc=b.query_start_loc[: num_reqs + 1],
            seq_lens=b.seq_lens[:num_reqs],
            block_table=b.block_table[:num_reqs, :host.max_blocks],
            slot_mapping=b.slot_mapping[: host.num_tokens],
            query_start_loc_cpu=host.query_start_loc.tolist(),
            seq_lens_cpu=host.seq_lens.tolist(),
        )
        return StepInputs(
            request_ids=request_ids,
            input_ids=b.input_ids[: host.num_tokens],
            positions=b.positions[: host.num_tokens],
            metadata=metadata,
            sample_request_ids=[request_ids[i] for i in host.sample_rows],
            logits_indices=b.logits_indices[: len(host.sample_rows)],
            decode_graph_size=decode_size,
            token_graph_size=token_size,
            num_padding_tokens=padded_num_tokens - host.num_tokens,
        )

    # ------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingStep | ModelRunnerOutput:
        """Queue one step, sampling for every request that caught up; returns
        at once with a ``PendingStep`` (a finished output for an empty step)."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        states = [self.states[r] for r in inputs.sample_request_ids]
        # built before the forward is queued: its small host-to-device copies
        # would otherwise wait for the whole forward to finish
        batch = SamplingBatch.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            # only penalties and min_tokens read the outputs: the rest skip the copy
            [s.output_token_ids if s.reads_outputs else () for s in states],
            [s.generator for s in states],
            self.model_config.vocab_size,
            self.device,
        ) if states else None
        if self.lora_manager is not None:
            self.lora_manager.set_batch(
                [self.states[r].lora_int_id for r in inputs.request_ids],
                [scheduler_output.num_scheduled_tokens[r] for r in inputs.request_ids],
            )
        start = self._mark()
        if inputs.decode_graph_size is not None and self.graphs is not None:
            logits = self.graphs.replay_decode(inputs.decode_graph_size)[inputs.logits_indices]
        elif inputs.token_graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay_tokens(inputs.token_graph_size)
            logits = None
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            logits = None
        for request_id in inputs.request_ids:
            state = self.states[request_id]
            state.num_computed_tokens += scheduler_output.num_scheduled_tokens[request_id]
        sampled = None
        self._last_sampled = None
        if batch is not None:
            if logits is None:
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sampled = self.sampler(logits, batch)
            self._last_sampled = (sampled.sampled_token_ids,
                                  {s.request_id: i for i, s in enumerate(states)})
        host_tensors = self._copy_to_host(sampled)
        graphed = inputs.decode_graph_size is not None or inputs.token_graph_size is not None
        step = PendingStep(states, host_tensors, start, self._mark(), self._read_oldest_step,
                           graphed, inputs.num_padding_tokens)
        self._unread.append(step)
        return step

    def _mark(self) -> Any:
        """A point in the device's timeline: a recorded CUDA event, or on the
        CPU (where the forward runs synchronously) the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _copy_to_host(self, sampled: SamplerOutput | None) -> list[torch.Tensor]:
        """Queue copies of the sampled tokens (and logprobs) into pinned host
        tensors; they are valid once the step's end event is reached."""
        if sampled is None:
            return []
        tensors = [sampled.sampled_token_ids]
        if sampled.logprobs is not None and sampled.logprob_token_ids is not None:
            tensors += [sampled.logprob_token_ids, sampled.logprobs]
            if sampled.sampled_token_ranks is not None:
                tensors.append(sampled.sampled_token_ranks)
        if self.device.type != "cuda":
            return tensors
        copies = []
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copies.append(host.copy_(tensor, non_blocking=True))
        return copies

    def _read_all_steps(self) -> None:
        while self._unread:
            self._read_oldest_step()

    def _read_oldest_step(self) -> None:
        """Wait for the oldest unread step, append its tokens to the states and
        set its output."""
        step = self._unread.popleft()
        if self.device.type == "cuda":
            step.end.synchronize()
            device_s = step.start.elapsed_time(step.end) / 1e3
        else:
            device_s = step.end - step.start
        output = ModelRunnerOutput(device_s=device_s, graphed=step.graphed,
                                   num_padding_tokens=step.num_padding_tokens)
        step.output = output
        if not step.host_tensors:
            return
        token_ids = step.host_tensors[0].tolist()
        logprob_rows = None
        if len(step.host_tensors) > 1:
            ids, values = step.host_tensors[1].tolist(), step.host_tensors[2].tolist()
            ranks = (step.host_tensors[3].tolist() if len(step.host_tensors) > 3
                     else [0] * len(step.states))
            logprob_rows = (ids, values, ranks)
        for i, state in enumerate(step.states):
            token_id = int(token_ids[i])
            state.token_ids.append(token_id)
            output.sampled_token_ids[state.request_id] = [token_id]
            num_logprobs = state.sampling_params.logprobs
            if logprob_rows is not None and num_logprobs is not None:
                ids, values, ranks = logprob_rows
                output.logprobs[state.request_id] = [
                    Logprobs(
                        token_ids=ids[i][: num_logprobs + 1],
                        logprobs=values[i][: num_logprobs + 1],
                        sampled_rank=int(ranks[i]),
                    )
                ]
