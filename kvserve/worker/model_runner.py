"""The model runner: turns a ``SchedulerOutput`` into one forward pass and a
``ModelRunnerOutput``.

It keeps a persistent state per request (token ids, block ids, sampling
params and the request's random generator) updated from the scheduler's
diffs, flattens the step's tokens of all requests into one batch, builds the
attention metadata once, runs the model, computes logits only at the last
position of each request that has caught up with its tokens, and samples.
It owns the model and the KV cache tensors; it knows nothing about queues,
budgets or text.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.attention.backend import get_attention_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.outputs import Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvserve.core.sampling_params import SamplingParams
from kvserve.layers.attention import bind_kv_cache
from kvserve.lora.manager import LoRAManager
from kvserve.lora.request import LoRARequest
from kvserve.models.loader import load_model
from kvserve.models.registry import CausalLM
from kvserve.sampling.sampler import Sampler, SamplerOutput, SamplingBatch
from kvserve.worker.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    """What the runner remembers about a request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output, extended with each sampled token
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int = 0  # the request's LoRA adapter; 0: none

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]


@dataclass
class StepInputs:
    """The flattened batch of one step."""

    request_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    # requests that sample this step, and the row of their last token
    sample_request_ids: list[str]
    logits_indices: torch.Tensor  # [num_sample_requests]


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
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.backend = get_attention_backend(attention_backend)
        self.sampler = Sampler()
        self.states: dict[str, RunnerRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        self.lora_manager = (LoRAManager(model, lora_config, device)
                             if lora_config is not None else None)

    @classmethod
    def create(
        cls,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        model_path: str | None,
        load_format: str,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        attention_backend: str = "torch",
        lora_config: LoRAConfig | None = None,
    ) -> ModelRunner:
        """Load the model and allocate the KV cache."""
        model = load_model(
            model_config,
            Path(model_path) if model_path else None,
            load_format,
            dtype,
            device,
            seed=seed,
        )
        model.eval()
        runner = cls(model_config, cache_config, scheduler_config, model, device, dtype,
                     attention_backend, lora_config)
        runner.initialize_kv_cache()
        return runner

    def initialize_kv_cache(self) -> None:
        self.kv_caches, self.num_kv_blocks = allocate_kv_caches(
            self.model_config, self.cache_config, self.scheduler_config, self.device, self.dtype
        )
        bind_kv_cache(self.model, self.kv_caches, self.backend)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a PEFT adapter (ValueError naming what does not fit)."""
        assert self.lora_manager is not None, "LoRA is not enabled (lora_config is None)"
        self.lora_manager.add_lora(lora_request)

    # ------------------------------------------------------------ state

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
        for request_id in scheduler_output.preempted_request_ids:
            if request_id in self.states:
                self.states[request_id].block_ids = []
        for new in scheduler_output.new_requests:
            old = self.states.get(new.request_id)
            generator = old.generator if old is not None else self._make_generator(new)
            self.states[new.request_id] = RunnerRequestState(
                request_id=new.request_id,
                prompt_token_ids=list(new.prompt_token_ids),
                token_ids=list(new.all_token_ids),
                sampling_params=new.sampling_params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora_int_id=new.lora_int_id,
            )
        for cached in scheduler_output.cached_requests:
            state = self.states[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _make_generator(self, new: NewRequestData) -> torch.Generator | None:
        seed = new.sampling_params.seed
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    # ------------------------------------------------------------ inputs

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        request_ids = list(scheduler_output.num_scheduled_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_request_ids: list[str] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for request_id in request_ids:
            state = self.states[request_id]
            start = state.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[request_id]
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = state.block_ids
            slots.extend(blocks[pos // bs] * bs + pos % bs for pos in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if end == len(state.token_ids):
                sample_request_ids.append(request_id)
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(self.states[r].block_ids) for r in request_ids)
        block_table = [
            (ids := self.states[r].block_ids) + [NULL_BLOCK_ID] * (max_blocks - len(ids))
            for r in request_ids
        ]
        metadata = AttentionMetadata(
            num_reqs=len(request_ids),
            num_tokens=len(input_ids),
            max_query_len=max(b - a for a, b in itertools.pairwise(query_start_loc)),
            max_seq_len=max(seq_lens),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_table=self._to_device(block_table, torch.int32),
            slot_mapping=self._to_device(slots, torch.int64),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            request_ids=request_ids,
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            metadata=metadata,
            sample_request_ids=sample_request_ids,
            logits_indices=self._to_device(logits_indices, torch.int64),
        )

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    # ------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample for every request that caught up."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        if self.lora_manager is not None:
            self.lora_manager.set_batch(
                [self.states[r].lora_int_id for r in inputs.request_ids],
                [scheduler_output.num_scheduled_tokens[r] for r in inputs.request_ids],
            )
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        for request_id in inputs.request_ids:
            state = self.states[request_id]
            state.num_computed_tokens += scheduler_output.num_scheduled_tokens[request_id]
        if not inputs.sample_request_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        states = [self.states[r] for r in inputs.sample_request_ids]
        batch = SamplingBatch.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.model_config.vocab_size,
            self.device,
        )
        sampled = self.sampler(logits, batch)
        return self._make_output(states, sampled)

    def _make_output(
        self, states: list[RunnerRequestState], sampled: SamplerOutput
    ) -> ModelRunnerOutput:
        token_ids = sampled.sampled_token_ids.tolist()
        output = ModelRunnerOutput()
        logprob_rows = None
        if sampled.logprobs is not None and sampled.logprob_token_ids is not None:
            logprob_rows = (
                sampled.logprob_token_ids.tolist(),
                sampled.logprobs.tolist(),
                sampled.sampled_token_ranks.tolist()
                if sampled.sampled_token_ranks is not None
                else [0] * len(states),
            )
        for i, state in enumerate(states):
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
        return output
