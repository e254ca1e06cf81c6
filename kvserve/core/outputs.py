"""The seam between the CPU world and the GPU world: what the scheduler tells
the model runner each step, and what comes back. Plain ints and lists only,
never tensors, so the two sides can live in different processes later.

A request is sent whole the first time it is scheduled (and again when it
resumes after preemption); after that only the diff: new block ids and how
many tokens to run. The runner keeps the rest in its persistent state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.core.sampling_params import SamplingParams

# a proposal the step in flight is making: the scheduler plans with its
# count, the runner takes its id on the device (config.plans_ahead)
CARRIED_TOKEN_ID = -1


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resuming after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    # prompt + output so far (a resumed request recomputes all of it)
    all_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False
    lora_int_id: int = 0  # the request's LoRA adapter; 0: none


@dataclass
class SchedulerOutput:
    """One step's plan."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    # requests the runner holds that got blocks this step -> the new block
    # ids; the runner counts their computed tokens itself
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> tokens to run this step
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # requests that ended since the last step: the runner drops their state
    finished_request_ids: set[str] = field(default_factory=set)
    # requests preempted this step: the runner keeps their state (generator
    # included) but forgets their blocks until they resume
    preempted_request_ids: set[str] = field(default_factory=set)
    # speculative decoding: request_id -> the proposed tokens this step
    # verifies (scheduled after the request's last token, counted in
    # num_scheduled_tokens); CARRIED_TOKEN_ID for those not read yet
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> how many tokens to propose for its next step, for
    # requests that sample this step (their slots are allocated when the
    # proposer writes KV for them: SpeculativeConfig.uses_lookahead_slots)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> the blocks it keeps, for requests whose rejected
    # proposals' blocks were freed since the last step (before new_block_ids)
    num_kept_blocks: dict[str, int] = field(default_factory=dict)
    # host KV tier: copies out as (device block, host block) and copies in as
    # (host block, device block), queued before the step (worker/kv_offload.py
    # says in which order); a step reads the blocks copied in from the next
    # one on, unless wait_for_onloads (it reads some of this step's own)
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_onloads: list[tuple[int, int]] = field(default_factory=list)
    wait_for_onloads: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def is_spec_step(self) -> bool:
        """Whether the step verifies proposals or makes them: its output is
        read before the next step is planned, unless the engine plans ahead
        (``config.plans_ahead``)."""
        return bool(self.scheduled_spec_token_ids or self.num_draft_tokens)


@dataclass
class Logprobs:
    """Logprobs of one generated token: the sampled one first, then the top ones."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens ``first_index ..`` (``first_index >= 1``):
    entry i is token ``first_index + i`` given the tokens before it, the
    prompt token first (its ``sampled_rank`` its rank), then the top ones."""

    first_index: int
    entries: list[Logprobs]


@dataclass
class ModelRunnerOutput:
    """What one step produced, per scheduled request."""

    # request_id -> tokens sampled this step (empty for a partial prefill
    # chunk; with speculation the accepted proposals, then one more token)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> proposals for its next step (SchedulerOutput.num_draft_tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # request_id -> logprobs of the prompt tokens this step's chunk predicts
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # device time of the step, from its first to its last kernel; the rest of
    # the steps' wall time is time the device waited for the host
    device_s: float = 0.0
    # whether the step replayed a CUDA graph, and its padding tokens (tokens
    # of the graph's size beyond the step's, each costing a token's matmuls)
    graphed: bool = False
    num_padding_tokens: int = 0
    # device time of the step's proposer (within device_s)
    proposer_s: float = 0.0

    def get(self) -> ModelRunnerOutput:
        """A finished output is its own pending one (see ``engine_core.PendingOutput``)."""
        return self


@dataclass
class EngineCoreOutput:
    """What the engine core reports about one request after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    # every prompt token's logprobs after the first, on the request's first output
    prompt_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # when the request was first scheduled (time.monotonic, one clock for
    # every process of the host): set on its first output
    first_scheduled_s: float | None = None
    # a prefill engine's answer on a finished request whose KV it keeps for a
    # decode engine: where to pull it from (SamplingParams.kv_transfer_params)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
