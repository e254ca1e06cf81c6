"""The model runner: turns a ``SchedulerOutput`` into one forward pass and a
``ModelRunnerOutput``.

It keeps a persistent state per request (a row of the ``PersistentBatch``:
token ids, counts, block ids and sampling settings as numpy columns; and the
request's random generator) updated from the scheduler's diffs, flattens the
step's tokens of all requests into one batch in persistent buffers, builds
the attention metadata once, runs the model (a decode step replays a CUDA
graph when one is captured), computes logits only at the last position of
each request that has caught up with its tokens, and samples (prompt
logprobs, when asked for, come from the prompt positions' hidden states:
``worker/prompt_logprobs.py``). At start-up
it profiles a largest step to size the KV cache. It owns the model, the KV
cache tensors and the graphs; it knows nothing about queues, budgets or text.

``execute_model`` only queues the step and returns a ``PendingStep``: the
sampled tokens are copied to pinned host memory behind an event, and
``PendingStep.get`` waits for that event alone, not for later steps. So the
engine can queue step N+1 before reading step N (async scheduling); a token
of step N that step N+1 needs as input is then copied on the device from
step N's sampled tensor ("carried"). Requests with penalties or below
``min_tokens`` need their whole output on the host, so a step that would
carry one of their tokens reads the previous step first. A speculative step
(``SchedulerOutput.is_spec_step``) runs through ``worker/spec_decode.py``;
one whose every request is its last token and its proposals is laid out one
token per attention row (``worker/verify_layout.py``) and replays a verify
graph; a proposer with its own network sees the tokens of every step
(``SpecDecodeRunner.observe``). When the engine plans ahead
(``config.plans_ahead``) a step may follow a speculative step N not yet
read: a request's tokens are then N's token after its accepted proposals
and the proposals N made, placed as if N accepted every proposal; the host
writes those positions, and the device moves them back by N's rejected
proposals and fills in the tokens (``_carry``).

With tensor or pipeline parallelism (``distributed/``) one runner runs in
each worker process on its rank's shard of the model, from the same
``SchedulerOutput``; every TP rank samples the same tokens from the same
gathered logits. A pipeline stage after the first receives the previous
stage's hidden states before its forward (into a persistent buffer its
CUDA graphs read), one before the last sends its own after it and samples
nothing: it learns the sampled tokens from ``append_known_tokens``.
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
from kvserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.outputs import Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvserve.core.sampling_params import SamplingParams
from kvserve.distributed.parallel_state import ParallelState, building
from kvserve.host_copy import to_device
from kvserve.layers.attention import bind_kv_cache
from kvserve.layers.custom_ops import set_triton_ops
from kvserve.lora.manager import LoRAManager
from kvserve.lora.request import LoRARequest
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM
from kvserve.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    forbidden_token_ids,
    logit_bias_triples,
    make_generator,
)
from kvserve.worker import prompt_logprobs
from kvserve.worker.cuda_graph import CudaGraphs
from kvserve.worker.input_batch import PersistentBatch, StepBuffers, carry_rows
from kvserve.worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    allocate_kv_scales,
    allocate_scratch_kv_caches,
    check_num_blocks,
    check_weights_fit,
    determine_num_blocks,
    kv_cache_dtype,
    log_kv_scales,
)
from kvserve.worker.kv_offload import KVOffloader, create_kv_offloader, staging_buffer_bytes
from kvserve.worker.spec_decode import SpecDecodeRunner
from kvserve.worker.structured_output import GrammarMatchers
from kvserve.worker.verify_layout import VerifyBuffers, is_verify_step, verify_graph_sizes

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    """What the runner remembers about a request, kept across preemption; its
    batch row, which preemption gives back, is in ``ModelRunner.rows``."""

    request_id: str
    sampling_params: SamplingParams
    generator: torch.Generator | None
    lora_int_id: int = 0  # the request's LoRA adapter; 0: none


@dataclass
class SampledTokens:
    """The last step that sampled, for the tokens a step queued before it is
    read must carry: each sampling request's last token (its sampled one; a
    speculative step's token after the accepted proposals) on the device,
    and the batch rows. A speculative step adds, per sampling request, the
    proposals it verified (host), how many of them it rejected (device) and
    the proposals it made (device ``[B, P]``; request ``i``'s are row
    ``proposal_row[i]``, -1 for none)."""

    tokens: torch.Tensor  # [N]
    rows: np.ndarray  # [N]
    num_spec: np.ndarray | None = None  # [N]
    rejected: torch.Tensor | None = None  # [N]
    proposals: torch.Tensor | None = None  # [B, P]
    proposal_row: np.ndarray | None = None  # [N]


@dataclass
class StepInputs:
    """The flattened batch of one step (device tensors are views of ``StepBuffers``)."""

    request_ids: list[str]
    rows: np.ndarray  # [num_reqs] int64: the requests' batch rows
    num_scheduled: np.ndarray  # [num_reqs] int64
    lora_int_ids: list[int] | None  # per request, with LoRA enabled
    # eager steps only (a graph reads the buffers): [num_tokens] each, and metadata
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    metadata: AttentionMetadata | None
    # requests that sample this step (indices into request_ids, and ids), and
    # the row of their last token
    sample_indices: np.ndarray
    sample_request_ids: list[str]
    logits_indices: torch.Tensor  # [num_sample_requests]
    # the decode graph (batch size) or token graph (token count) this step
    # replays; both None: eager
    decode_graph_size: int | None
    token_graph_size: int | None
    num_padding_tokens: int  # the graph's tokens beyond the step's
    # a verify step laid out one token per row (worker/verify_layout.py): its
    # verify graph's size, if it replays one
    verify_layout: bool = False
    verify_graph_size: int | None = None


class PendingStep:
    """A step queued on the device; ``get`` waits for it and reads its output.

    Steps are read in the order they ran: getting one first reads any older
    step not read yet, since each appends its tokens to the requests' state.
    """

    def __init__(
        self,
        request_ids: list[str],
        rows: np.ndarray,
        generations: np.ndarray,
        num_logprobs: np.ndarray,
        host_tensors: list[torch.Tensor],
        start: Any,
        end: Any,
        read_oldest: Callable[[], None],
        graphed: bool,
        num_padding_tokens: int,
        read_tokens: Callable[[PendingStep, ModelRunnerOutput], None] | None = None,
    ) -> None:
        # the requests that sampled, their batch rows and those rows'
        # generations then (a row freed since is not written), logprobs wanted
        self.request_ids, self.rows, self.generations = request_ids, rows, generations
        self.num_logprobs = num_logprobs
        # sampled ids (then logprob ids, logprobs, ranks), valid once ``end`` is reached
        self.host_tensors = host_tensors
        self.start, self.end = start, end  # see ModelRunner._mark
        self.output: ModelRunnerOutput | None = None
        self._read_oldest = read_oldest  # reads the runner's oldest unread step
        self.graphed, self.num_padding_tokens = graphed, num_padding_tokens
        self.prompt_logprobs: prompt_logprobs.PromptLogprobsStep | None = None
        # a speculative step's own reader of its tokens (several per request)
        self.read_tokens = read_tokens

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
        parallel: ParallelState | None = None,
        speculative_config: SpeculativeConfig | None = None,
        draft_path: str | None = None,
        load_format: str = "auto",
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
        # request id -> its row of the PersistentBatch, while it holds one (not
        # while preempted); a plain dict, read for every request every step
        self.rows: dict[str, int] = {}
        # row -> generator of the seeded random requests
        self._generators: dict[int, torch.Generator] = {}
        # held requests that want prompt logprobs and whose prompt is not done
        # -> their prompt_logprobs (their steps replay no decode graph)
        self._prompt_logprobs: dict[str, int] = {}
        # held requests with a logit_bias (kept across preemption)
        self._biased: set[str] = set()
        # structured-output requests' grammar state (worker/structured_output.py)
        self.matchers = GrammarMatchers(model_config.vocab_size)
        self.kv_caches: list[torch.Tensor] = []
        # an fp8 or int8 cache's per-layer scales (kernels/kv_quant.py), else None
        self.kv_scales: list[torch.Tensor] | None = None
        self.kv_cache_dtype = kv_cache_dtype(cache_config, dtype)
        self.num_kv_blocks = 0
        self.kv_offloader: KVOffloader | None = None  # the host KV tier, when on
        self.num_host_kv_blocks = 0
        self.reserved_bytes = 0  # kept out of the KV pool for the largest step (profiled)
        self.kv_spec = KVCacheSpec.of(model)
        self.parallel = parallel or ParallelState.single()
        # a pipeline stage before the last hands its hidden states on and samples nothing
        self.samples = self.parallel.layout.is_last_stage
        use_graphs = (device.type == "cuda" and bool(cuda_graph_sizes)
                      and self.backend.supports_cuda_graphs)
        self.cuda_graph_sizes = cuda_graph_sizes if use_graphs else ()
        self.cuda_graph_token_sizes = cuda_graph_token_sizes if use_graphs else ()
        max_num_reqs = scheduler_config.max_num_seqs
        max_blocks_per_req = -(-scheduler_config.max_model_len // self.block_size)
        self.batch = PersistentBatch(max_num_reqs, scheduler_config.max_model_len,
                                     max_blocks_per_req, model_config.vocab_size)
        max_num_tokens = max(scheduler_config.max_num_batched_tokens,
                             max(self.cuda_graph_sizes, default=0),
                             max(self.cuda_graph_token_sizes, default=0))
        self.buffers = StepBuffers(max_num_tokens, max_num_reqs, max_blocks_per_req, device)
        # wraps the LoRA-capable linears before any graph is captured; the batched
        # kernels go with the Triton ops, the torch path stays the reference
        self.lora_manager = (LoRAManager(model, lora_config, device, max_num_tokens,
                                         use_kernels=use_triton)
                             if lora_config is not None else None)
        # [max_num_tokens, 2, hidden_size]: a later pipeline stage's input, received
        # from the previous stage (a fixed buffer, so CUDA graphs can read it)
        self.intermediate: torch.Tensor | None = None
        if not self.parallel.layout.is_first_stage:
            self.intermediate = torch.zeros(max_num_tokens, 2, model_config.hidden_size,
                                            dtype=dtype, device=device)
        self.graphs: CudaGraphs | None = None
        # queued steps whose tokens are not appended to the states yet, oldest first
        self._unread: deque[PendingStep] = deque()
        self._events: list[torch.cuda.Event] = []  # timing events of steps already read
        # the last step that sampled: its sampled tokens (on the device) and
        # the batch rows that sampled; per batch row, its index in those
        # tokens (-1: none), for tokens the next step must carry
        self._last_sampled: SampledTokens | None = None
        self._last_sample_index = np.full(max_num_reqs, -1, dtype=np.int64)
        # loads a draft model or EAGLE head, if the method has one
        self.spec = (SpecDecodeRunner.create(self, speculative_config, draft_path, load_format)
                     if speculative_config is not None else None)
        # a verify step's one-token-per-row buffers, and the sizes of its graphs
        self.verify: VerifyBuffers | None = None
        self.verify_graph_sizes: tuple[int, ...] = ()
        if speculative_config is not None:
            rows = 1 + speculative_config.num_speculative_tokens
            self.verify_graph_sizes = verify_graph_sizes(self.cuda_graph_sizes, rows,
                                                         max_num_tokens)
            self.verify = VerifyBuffers(
                min(max_num_tokens, max(max_num_reqs * rows, *self.verify_graph_sizes, 1)),
                max_blocks_per_req, device)

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState | None = None,
    ) -> ModelRunner:
        """Load the model (``parallel``: this rank's shard of it), profile a largest
        step, allocate the KV cache, capture graphs."""
        check_weights_fit(config.model_config, dtype, device,
                          config.cache_config.gpu_memory_utilization, config.parallel_config,
                          config.scheduler_config.max_model_len)
        start = time.perf_counter()
        with building(parallel or ParallelState.single()):
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
        spec = config.speculative_config
        runner = cls(config.model_config, config.cache_config, config.scheduler_config, model,
                     device, dtype, config.attention_backend, config.cuda_graph_sizes,
                     config.lora_config, config.cuda_graph_token_sizes, parallel, spec,
                     spec.model if spec is not None else None, config.load_format)
        runner.initialize_kv_cache()
        runner.capture_cuda_graphs()
        logger.info("startup after loading weights (profile, KV cache, graphs): %.1f s",
                    time.perf_counter() - start)
        return runner

    def initialize_kv_cache(self) -> None:
        """Size the pool from what is left after a profiled step (parallel ranks
        agree on the smallest pool; a speculative proposer's KV shares the
        blocks), allocate it (quantised with its scales when kv_cache_dtype
        asks) and bind it to the layers."""
        if self.device.type == "cuda":
            self.reserved_bytes = self.profile_peak_step_bytes()
        spec, cache, sched = self.kv_spec, self.cache_config, self.scheduler_config
        kv_dtype = self.kv_cache_dtype
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        extra_block_bytes = self.spec.kv_bytes_per_block() if self.spec else 0
        max_step_blocks = sched.max_num_batched_tokens // cache.block_size + 1
        staging_bytes = (staging_buffer_bytes(max_step_blocks, extra_block_bytes
                                              + spec.bytes_per_block(cache.block_size, kv_dtype))
                         if cache.kv_offload_gb and self.device.type == "cuda" else 0)
        num_blocks = determine_num_blocks(spec, cache, sched, self.device, kv_dtype,
                                          self.reserved_bytes + staging_bytes, weights,
                                          extra_block_bytes)
        num_blocks = self.parallel.min_over_ranks(num_blocks)
        if cache.num_kv_blocks is None:  # a given count is the user's (the scheduler checks it)
            check_num_blocks(num_blocks, spec, cache, sched, kv_dtype)
        self.kv_caches = allocate_kv_caches(spec, num_blocks, cache, sched, self.device,
                                            kv_dtype, model_dtype=self.dtype)
        self.num_kv_blocks = num_blocks
        self.kv_scales = allocate_kv_scales(spec, self.model, kv_dtype, num_blocks + 1,
                                            self.block_size, self.device)
        log_kv_scales(self.model, kv_dtype)
        bind_kv_cache(self.model, self.kv_caches, self.backend, self.kv_scales)
        if self.spec is not None:
            self.spec.bind_kv_cache(self.num_kv_blocks + 1)
        if cache.kv_offload_gb:  # the host tier, over every tensor at the pool's block ids
            self.kv_offloader = create_kv_offloader(self.kv_pool_tensors(), cache.kv_offload_gb,
                                                    self.parallel, self.device, max_step_blocks)
            self.num_host_kv_blocks = len(self.kv_offloader.host)

    def kv_pool_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor at the pool's block ids, with its block dim: what a
        block's KV is, for copies to the host tier or to another engine."""
        proposer = self.spec.device_proposer if self.spec is not None else None
        tensors = self.kv_caches + (proposer.kv_caches if proposer is not None else [])
        if self.kv_cache_dtype == torch.int8:  # its scales are per token: they go with the block
            tensors += self.kv_scales or []
        return [(t, 1) for t in tensors]

    def kv_transfer_stats(self) -> dict[str, float]:
        """The host tier's bytes copied each way and copy times (none when off)."""
        return self.kv_offloader.stats() if self.kv_offloader is not None else {}

    def shutdown(self, kill: bool = False) -> None:
        """Nothing to stop: the runner lives in the engine's process."""

    def append_known_tokens(self, token_ids: dict[str, list[int]]) -> None:
        """Append tokens the last pipeline stage sampled to the requests' rows (a
        stage before the last learns them from the executor); a request this
        runner no longer holds is passed over."""
        for request_id, tokens in token_ids.items():
            row = self.rows.get(request_id)
            for token_id in tokens if row is not None else ():
                self.batch.append_tokens(np.array([row]), np.array([token_id]))

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a PEFT adapter (ValueError naming what does not fit)."""
        if self.lora_manager is None:
            raise ValueError(
                f"lora_request '{lora_request.lora_name}': LoRA is not enabled; "
                "start the engine with enable_lora=True (--enable-lora)"
            )
        self.lora_manager.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False: unknown); no unfinished request may use it."""
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)

    def prefetch_loras(self, lora_int_ids: list[int]) -> set[int]:
        """The adapters a step could not use yet (being read again from disk,
        off the step loop); see ``LoRAManager.prefetch``."""
        return self.lora_manager.prefetch(lora_int_ids) if self.lora_manager is not None else set()

    def capture_cuda_graphs(self) -> None:
        if not self.cuda_graph_sizes and not self.cuda_graph_token_sizes:
            return
        self.graphs = CudaGraphs(self.model, self.buffers, self.cuda_graph_sizes,
                                 self.cuda_graph_token_sizes, self.scheduler_config.max_model_len,
                                 self.sampler.argmax if self.samples else None,
                                 self.intermediate, collectives=self.parallel.tp.size > 1,
                                 lora_batch=(self.lora_manager.batch
                                             if self.lora_manager is not None else None),
                                 verify=self.verify, verify_sizes=self.verify_graph_sizes)
        self.graphs.capture()
        if self.spec is not None:
            self.spec.capture_graphs()

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
        scratch = allocate_scratch_kv_caches(self.kv_spec, self.cache_config, self.device,
                                             self.kv_cache_dtype)
        bind_kv_cache(self.model, scratch, self.backend, allocate_kv_scales(
            self.kv_spec, self.model, self.kv_cache_dtype, 2, self.block_size, self.device))
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
        hidden = self.model(input_ids, positions, metadata, self._receive(num_tokens))
        if not self.samples:
            self._send(hidden)
            return
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
            self.states.pop(request_id, None)
            self._biased.discard(request_id)
            self.matchers.remove(request_id)
            if self.spec is not None and request_id in self.rows:
                self.spec.on_finished(request_id, self.rows[request_id])
            self._free_row(request_id)
        for request_id in scheduler_output.preempted_request_ids:
            self._free_row(request_id)
        for request_id, num_blocks in scheduler_output.num_kept_blocks.items():
            row = self.rows.get(request_id)
            if row is not None:  # the scheduler freed its rejected proposals' blocks
                self.batch.num_blocks[row] = num_blocks
        for new in scheduler_output.new_requests:
            old = self.states.get(new.request_id)
            self._free_row(new.request_id)
            generator = old.generator if old is not None else self._make_generator(new)
            row = self.batch.add(new.all_token_ids, len(new.prompt_token_ids),
                                 new.num_computed_tokens, new.block_ids, new.sampling_params)
            if generator is not None and not new.sampling_params.is_greedy:
                self._generators[row] = generator
            if new.sampling_params.logit_bias:
                self._biased.add(new.request_id)
            if new.sampling_params.grammar is not None:
                self.matchers.add(new.request_id, new.sampling_params.grammar)
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs[new.request_id] = new.sampling_params.prompt_logprobs
            self.rows[new.request_id] = row
            self.states[new.request_id] = RunnerRequestState(
                request_id=new.request_id,
                sampling_params=new.sampling_params,
                generator=generator,
                lora_int_id=new.lora_int_id,
            )
        for request_id, block_ids in scheduler_output.new_block_ids.items():
            held = self.rows.get(request_id)
            if held is None:
                raise RuntimeError(f"request {request_id} resumed without its blocks")
            self.batch.append_blocks(held, block_ids)

    def _free_row(self, request_id: str) -> None:
        """Give back the request's batch row, if it holds one."""
        row = self.rows.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        if row is None:
            return
        self.batch.free(row)
        self._generators.pop(row, None)
        self._last_sample_index[row] = -1

    def _make_generator(self, new: NewRequestData) -> torch.Generator | None:
        seed = new.sampling_params.seed
        if seed is None:
            return None
        return make_generator(seed, self.device)

    # ------------------------------------------------------------ inputs

    def _prepare_inputs(self, scheduler_output: SchedulerOutput,
                        num_spec: np.ndarray | None = None) -> StepInputs:
        """The step's flat inputs; ``num_spec``: proposals per request
        (``SpecDecodeRunner.write_proposals`` writes those the host has past
        the request's known tokens)."""
        scheduled = scheduler_output.num_scheduled_tokens
        request_ids = list(scheduled)
        num_reqs = len(request_ids)
        states = self.states
        rows = np.fromiter(map(self.rows.__getitem__, request_ids), np.int64, num_reqs)
        num_scheduled = np.fromiter(scheduled.values(), np.int64, num_reqs)
        batch = self.batch
        ends, unknown, carried, carried_src = self._unknown_tokens(request_ids, rows,
                                                                   num_scheduled, num_spec)
        if num_spec is not None:
            assert self.spec is not None
            self.spec.write_proposals(scheduler_output, request_ids, rows, unknown)
        lora_int_ids = None
        if self.lora_manager is not None:
            lora_int_ids = [states[r].lora_int_id for r in request_ids]
        decode_size = token_size = verify_size = None
        padded_num_reqs, padded_num_tokens = num_reqs, int(num_scheduled.sum())
        # a pure verify step (every request its last token and its proposals,
        # some proposals): one token per attention row, worker/verify_layout.py
        verify = (num_spec is not None and self.verify is not None
                  and is_verify_step(num_spec, num_scheduled, ends - unknown,
                                     batch.num_tokens[rows]))
        # with the torch LoRA path, graphs hold the base model only: a step with
        # an adapter runs eagerly; the kernels read their indices from fixed buffers
        lora_eager = (self.lora_manager is not None and not self.lora_manager.batch.use_kernels
                      and any(lora_int_ids or ()))
        if self.graphs is not None and not lora_eager:
            # a verify step too large for the verify graphs replays a token graph
            verify_size = self.graphs.verify_size(padded_num_tokens) if verify else None
            verify = verify_size is not None
            if verify_size is not None:
                padded_num_tokens = verify_size
            elif int(num_scheduled.max()) == 1 and not self._prompt_logprobs:
                decode_size = self.graphs.decode_size(num_reqs)
            if decode_size is not None:
                padded_num_reqs = padded_num_tokens = decode_size
            elif verify_size is None:
                token_size = self.graphs.token_size(padded_num_tokens)
                if token_size is not None:
                    padded_num_reqs, padded_num_tokens = self.buffers.max_num_reqs, token_size
        host = self.buffers.fill(batch, rows, num_scheduled, self.block_size, padded_num_reqs,
                                 padded_num_tokens, carried, carried_src)
        b = self.buffers
        verify_host = None
        if verify:
            assert self.verify is not None
            verify_host = self.verify.fill(b.positions_cpu[:host.num_tokens].numpy(),
                                           num_scheduled, padded_num_tokens)
        moved = bool(host.num_carried) and self._carry(carried, carried_src, num_scheduled,
                                                       host.num_carried, verify)
        # a backend that reads the host's copies gets those of the moved rows, at a sync
        stale_host = moved and not self.backend.supports_cuda_graphs
        if stale_host and verify_host is not None:
            assert self.verify is not None
            verify_host = (verify_host[0], self.verify.seq_lens[:host.num_tokens].tolist())
        metadata = input_ids = positions = None
        if decode_size is None and token_size is None and verify_size is None:  # eager
            input_ids, positions = b.input_ids[: host.num_tokens], b.positions[: host.num_tokens]
        if input_ids is not None and verify:
            assert self.verify is not None
            self.verify.gather(b.block_table, host.num_tokens)
            metadata = self.verify.metadata(host.num_tokens, b.slot_mapping, host.max_seq_len,
                                            verify_host)
        elif input_ids is not None:
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
                seq_lens_cpu=(b.seq_lens[:num_reqs].tolist() if stale_host
                              else host.seq_lens.tolist()),
            )
        return StepInputs(
            request_ids=request_ids,
            rows=rows,
            num_scheduled=num_scheduled,
            lora_int_ids=lora_int_ids,
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            sample_indices=host.sample_indices,
            sample_request_ids=list(map(request_ids.__getitem__, host.sample_indices.tolist())),
            logits_indices=b.logits_indices[: len(host.sample_indices)],
            decode_graph_size=decode_size,
            token_graph_size=token_size,
            num_padding_tokens=padded_num_tokens - host.num_tokens,
            verify_layout=verify,
            verify_graph_size=verify_size,
        )

    def _unknown_tokens(self, request_ids: list[str], rows: np.ndarray,
                        num_scheduled: np.ndarray, num_spec: np.ndarray | None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per request, its computed tokens after the step less its proposals,
        and the tokens of its step before its proposals that the host has not
        read (those the last step sampled or kept, if it is unread); the
        requests that have some, with their index in that step's tokens.
        Reads every step first when a request needs its known outputs
        (penalties, ``min_tokens``, a grammar) or its tokens come from an
        older step."""
        batch = self.batch
        last_index = self._last_sample_index
        proposals = 0 if num_spec is None else num_spec

        def count() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            ends = batch.num_computed_tokens[rows] + num_scheduled - proposals
            unknown = np.maximum(ends - batch.num_tokens[rows], 0)
            carried = np.flatnonzero(unknown)
            return ends, unknown, carried, last_index[rows[carried]]

        ends, unknown, carried, carried_src = count()
        if len(carried) and ((carried_src < 0).any()
                             or batch.needs_known_outputs(rows[carried]).any()
                             or (self.matchers and any(request_ids[i] in self.matchers
                                                       for i in carried.tolist()))):
            self._read_all_steps()  # (a speculative step read rolls its computed tokens back)
            ends, unknown, carried, carried_src = count()
        if len(carried):
            last = self._last_sampled
            assert last is not None, "tokens are carried from the last step that sampled"
            expected = 1 + (last.num_spec[carried_src] if last.num_spec is not None else 0)
            if (unknown[carried] != expected).any():
                raise RuntimeError("a step needs tokens the host has not seen beyond those the "
                                   "last step sampled")
        return ends, unknown, carried, carried_src

    def _carry(self, carried: np.ndarray, carried_src: np.ndarray, num_scheduled: np.ndarray,
               num_carried: int, verify: bool) -> bool:
        """Copy the carried requests' tokens from the last step's device
        tensors (``StepBuffers.carry``: each one's first row and its index
        there). After a speculative step, also move each such request's
        rows back by its rejected proposals: positions, slots and sequence
        lengths (the host wrote them as if every proposal was accepted); its
        tokens are the one after the accepted proposals and the proposals
        made. Returns whether rows moved."""
        b, last = self.buffers, self._last_sampled
        assert last is not None
        if last.rejected is None:
            dst, src = b.carry[0, :num_carried], b.carry[1, :num_carried]
            b.input_ids[dst] = last.tokens[src]
            return False
        assert last.proposal_row is not None
        # one entry per carried token: its row, request, source index, proposal row, offset
        counts = num_scheduled[carried]
        starts = np.cumsum(counts) - counts
        offset = np.arange(int(counts.sum())) - np.repeat(starts, counts)
        first_row = np.cumsum(num_scheduled)[carried] - counts
        token_src = np.repeat(carried_src, counts)
        proposal_row = last.proposal_row[token_src]
        if (proposal_row[offset > 0] < 0).any():
            raise RuntimeError("a step verifies proposals its source step did not make")
        index = to_device(np.stack([np.repeat(first_row, counts) + offset,
                                    np.repeat(carried, counts), token_src,
                                    np.maximum(proposal_row, 0), offset]),
                          torch.int64, self.device)
        if self.sampler.use_triton:
            from kvserve.kernels.carry import carry_rows as fix_up
        else:
            fix_up = carry_rows
        fix_up(index, last.tokens, last.rejected, last.proposals, b.input_ids, b.positions,
               b.slot_mapping, b.block_table, self.verify.seq_lens
               if verify and self.verify is not None else b.seq_lens, self.block_size, verify)
        return True

    def _sampling_batch(self, inputs: StepInputs, sample_rows: np.ndarray) -> SamplingBatch:
        """The sampling settings of the requests that sample, from their batch rows."""
        batch = self.batch
        prompts = outputs = None
        row_list = sample_rows.tolist()
        # only penalties read the token ids: the rest skip the copy
        if batch.sampling.has_penalties(sample_rows).any():
            prompts = [batch.prompt_token_ids(r) for r in row_list]
            outputs = [batch.output_token_ids(r) for r in row_list]
        forbidden: list[tuple[int, int]] = []
        num_outputs = batch.num_tokens[sample_rows] - batch.num_prompt_tokens[sample_rows]
        for i in np.flatnonzero(num_outputs < batch.min_tokens[sample_rows]).tolist():
            params = self.states[inputs.sample_request_ids[i]].sampling_params
            forbidden += [(i, token_id) for token_id in forbidden_token_ids(
                params, int(num_outputs[i]), (), self.model_config.vocab_size)]
        generators = {}
        if self._generators:
            index = {row: i for i, row in enumerate(row_list)}
            generators = {index[row]: generator for row, generator in self._generators.items()
                          if row in index}
        biases = logit_bias_triples(
            (i, self.states[request_id].sampling_params)
            for i, request_id in enumerate(inputs.sample_request_ids)
            if request_id in self._biased) if self._biased else []
        bitmask = self.matchers.bitmask(inputs.sample_request_ids) if self.matchers else None
        return SamplingBatch.from_rows(batch.sampling.take(sample_rows), prompts, outputs,
                                       forbidden, generators, self.device, biases, bitmask)

    # ------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingStep | ModelRunnerOutput:
        """Queue one step, sampling for every request that caught up; returns
        at once with a ``PendingStep`` (a finished output for an empty step)."""
        self._update_states(scheduler_output)
        if self.kv_offloader is not None:
            self.kv_offloader.transfer(scheduler_output.kv_offloads,
                                       scheduler_output.kv_onloads,
                                       scheduler_output.wait_for_onloads)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        if self.spec is not None and scheduler_output.is_spec_step:
            num_spec = self.spec.num_spec(scheduler_output)
            return self.spec.execute(self._prepare_inputs(scheduler_output, num_spec),
                                     scheduler_output, num_spec)
        inputs = self._prepare_inputs(scheduler_output)
        # a pipeline stage before the last samples nothing
        sample_indices = inputs.sample_indices if self.samples else inputs.sample_indices[:0]
        sample_request_ids = inputs.sample_request_ids if self.samples else []
        sample_rows = inputs.rows[sample_indices]
        num_sample = len(sample_rows)
        argmax_only = num_sample > 0 and bool(self.batch.sampling.argmax_only[sample_rows].all())
        # built before the forward is queued: its small host-to-device copies
        # would otherwise wait for the whole forward to finish
        batch = (self._sampling_batch(inputs, sample_rows) if num_sample and not argmax_only
                 else None)
        prompt_plan = (prompt_logprobs.plan(self._prompt_logprobs, inputs.request_ids,
                                            inputs.rows, inputs.num_scheduled, self.batch)
                       if self._prompt_logprobs else None)
        start = self._mark()
        logits = sampled_ids = None
        hidden, decode_out = self._forward(inputs)
        if decode_out is not None:
            all_logits, greedy_ids = decode_out
            if num_sample == len(inputs.rows):  # every request samples: rows 0..n-1
                logits = all_logits[:num_sample]
                sampled_ids = greedy_ids[:num_sample] if argmax_only else None
            else:
                logits = all_logits[inputs.logits_indices]
        if not self.samples:
            assert hidden is not None, "a stage before the last has its hidden states"
            self._send(hidden)
        # prompt logprobs come from the last stage's hidden states
        prompt_step = (prompt_logprobs.compute(self.model, hidden, prompt_plan, self.device)
                       if prompt_plan is not None and hidden is not None and self.samples
                       else None)
        self.batch.num_computed_tokens[inputs.rows] += inputs.num_scheduled
        sampled = None
        self._forget_sampled()
        if num_sample:
            if logits is None:
                assert hidden is not None, "a step without a decode graph has its hidden states"
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
            if sampled_ids is not None:
                sampled = SamplerOutput(sampled_ids)
            elif batch is None:
                sampled = SamplerOutput(self.sampler.argmax(logits))
            else:
                sampled = self.sampler(logits, batch)
            self._set_sampled(SampledTokens(sampled.sampled_token_ids, sample_rows))
        if self.spec is not None:
            self.spec.observe(inputs, hidden, sampled)
        host_tensors = self._copy_to_host(sampled)
        graphed = inputs.decode_graph_size is not None or inputs.token_graph_size is not None
        step = PendingStep(sample_request_ids, sample_rows,
                           self.batch.generation[sample_rows],
                           self.batch.sampling.num_logprobs[sample_rows], host_tensors, start,
                           self._mark(), self._read_oldest_step, graphed,
                           inputs.num_padding_tokens)
        step.prompt_logprobs = prompt_step
        self._unread.append(step)
        return step

    def _forget_sampled(self) -> None:
        """A new step samples: the last one's tokens are no longer carried."""
        if self._last_sampled is not None:
            self._last_sample_index[self._last_sampled.rows] = -1
        self._last_sampled = None

    def _set_sampled(self, sampled: SampledTokens) -> None:
        self._last_sampled = sampled
        self._last_sample_index[sampled.rows] = np.arange(len(sampled.rows))

    def _forward(self, inputs: StepInputs) -> tuple[
            torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Run the step's forward (LoRA's batch set first, the previous
        pipeline stage's output received): its rows' hidden states, and for a
        decode graph on the last stage its logits and greedy ids."""
        num_rows = (inputs.decode_graph_size or inputs.token_graph_size
                    or inputs.verify_graph_size
                    or (0 if inputs.input_ids is None else len(inputs.input_ids)))
        if self.lora_manager is not None and inputs.lora_int_ids is not None:
            self.lora_manager.set_batch(inputs.lora_int_ids, inputs.num_scheduled.tolist(),
                                        num_rows)
        intermediate = self._receive(num_rows)
        if inputs.decode_graph_size is not None and self.graphs is not None:
            logits, greedy_ids = self.graphs.replay_decode(inputs.decode_graph_size)
            if greedy_ids is None:  # a stage before the last: its output
                return logits, None
            return self.graphs.decode_hidden.get(inputs.decode_graph_size), (logits, greedy_ids)
        if inputs.token_graph_size is not None and self.graphs is not None:
            return self.graphs.replay_tokens(inputs.token_graph_size), None
        if inputs.verify_graph_size is not None and self.graphs is not None:
            return self.graphs.replay_verify(inputs.verify_graph_size), None
        assert inputs.input_ids is not None and inputs.positions is not None
        assert inputs.metadata is not None, "an eager step has its metadata"
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata, intermediate), None

    def _receive(self, num_tokens: int) -> torch.Tensor | None:
        """The previous pipeline stage's ``[num_tokens, 2, hidden_size]`` output for
        this step, in the buffer the graphs read (None on the first stage)."""
        if self.intermediate is None:
            return None
        assert self.parallel.pp is not None
        return self.parallel.pp.recv(self.intermediate[:num_tokens])

    def _send(self, hidden: torch.Tensor) -> None:
        """Hand this stage's output on to the next pipeline stage."""
        assert self.parallel.pp is not None
        self.parallel.pp.send(hidden)

    def _mark(self) -> Any:
        """A point in the device's timeline: a recorded CUDA event (reused
        once its step is read), or on the CPU (where the forward runs
        synchronously) the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
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
            self._events += (step.start, step.end)
        else:
            device_s = step.end - step.start
        output = ModelRunnerOutput(device_s=device_s, graphed=step.graphed,
                                   num_padding_tokens=step.num_padding_tokens)
        step.output = output
        if step.prompt_logprobs is not None:
            output.prompt_logprobs = step.prompt_logprobs.read()
        if not step.host_tensors:
            return
        if step.read_tokens is not None:
            step.read_tokens(step, output)
            return
        token_ids = step.host_tensors[0].numpy()
        written = self.batch.generation[step.rows] == step.generations
        self.batch.append_tokens(step.rows[written], token_ids[written])
        output.sampled_token_ids = {
            request_id: [token_id]
            for request_id, token_id in zip(step.request_ids, token_ids.tolist(), strict=True)
        }
        if self.matchers:
            self.matchers.accept(output.sampled_token_ids)
        if len(step.host_tensors) == 1:
            return
        ids, values = step.host_tensors[1].tolist(), step.host_tensors[2].tolist()
        ranks = (step.host_tensors[3].tolist() if len(step.host_tensors) > 3
                 else [0] * len(step.request_ids))
        for i in np.flatnonzero(step.num_logprobs >= 0).tolist():
            num = int(step.num_logprobs[i]) + 1
            output.logprobs[step.request_ids[i]] = [
                Logprobs(token_ids=ids[i][:num], logprobs=values[i][:num],
                         sampled_rank=int(ranks[i]))
            ]
