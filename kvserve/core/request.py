"""One request's state inside the engine core: its tokens and their accounting.

The token accounting words used across kvserve are defined here, once:

- ``num_prompt_tokens``: tokens of the prompt.
- ``num_output_tokens``: tokens generated so far.
- ``num_tokens``: prompt + output.
- ``num_computed_tokens``: tokens whose KV is in the cache (or is being
  written by the step just scheduled).
- ``num_cached_tokens``: tokens found in the prefix cache when the request
  was first scheduled.
- ``num_scheduled_tokens``: tokens the scheduler assigns in one step.
- ``num_prompt_logprobs``: prompt tokens whose logprobs have come back
  from the runner (with ``prompt_logprobs`` set; the first prompt token has
  none, so all are in at ``num_prompt_tokens - 1``).
- ``num_output_placeholders``: tokens being sampled by a step that is
  scheduled but whose result has not come back yet (0 or 1). With async
  scheduling the next step is planned while one is in flight, so the
  scheduler counts these as if they were known.
- ``num_spec_tokens``: proposed (speculative) tokens scheduled after the
  request's last token in one step, verified by that step: a decode is an
  assignment of ``1 + num_spec_tokens`` tokens. The request's proposals
  wait in ``spec_token_ids`` until it is scheduled; ``max_spec_tokens`` is
  its own limit (0: it never speculates).

Pure Python: no torch here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.core.outputs import Logprobs, PromptLogprobs
from kvserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI name of a finished status: "stop", "length" or "abort"."""
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestTimes:
    """Wall-clock marks of one request (seconds, ``time.monotonic``)."""

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_s is None:
            return None
        return self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s


@dataclass(eq=False)
class Request:
    """A request as the scheduler and KV manager see it; equal only to itself
    (the queues' ``in`` and ``remove`` compare identities, not every field)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    # extra key mixed into every block hash (a cache salt)
    cache_key: int = 0
    # the LoRA adapter the request runs with (0: none); also part of every block hash
    lora_int_id: int = 0
    # False: the engine wants only the first output and the last (a final-only
    # request with no stop strings or logprobs), so the steps between report nothing
    report_every_step: bool = True
    arrival_s: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # -1 until first scheduled
        self.num_output_placeholders = 0
        # speculative decoding: the request's k (set at admission; 0: never
        # speculates) and the proposals for its next step
        self.max_spec_tokens = 0
        self.spec_token_ids: list[int] = []
        self.num_reported_outputs = 0  # output tokens already in an EngineCoreOutput
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        # logprobs of prompt tokens 1.. as the runner reports them (prompt_logprobs set)
        self.prompt_logprobs: list[Logprobs] | None = (
            None if self.sampling_params.prompt_logprobs is None else [])
        self.times = RequestTimes(arrival_s=self.arrival_s)
        # every token id that ends the request once it has min_tokens outputs:
        # its stop ids and, unless ignored, the EOS ids (see ``check_stop``)
        params = self.sampling_params
        # prompt + max_tokens, within max_model_len: set when the scheduler admits it
        self.max_num_tokens = 0
        self.stop_token_set = frozenset(params.stop_token_ids or ()).union(
            () if params.ignore_eos else self.eos_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None, "max_tokens is set by the engine"
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_prompt_logprobs(self) -> int:
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """True while it wants prompt logprobs not all in yet. Such a request
        reads no prefix cache: the logprobs need the hidden state at every
        prompt position, which a cache hit skips, so the prompt is computed
        again (as vLLM does) rather than its logprobs kept."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keep a chunk's prompt logprobs; positions already kept (a prompt
        computed again after preemption) are dropped."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) + 1 - chunk.first_index
        if skip < 0:
            raise RuntimeError(
                f"request {self.request_id}: prompt logprobs from token {chunk.first_index} "
                f"arrived with only {len(self.prompt_logprobs)} kept")
        self.prompt_logprobs.extend(chunk.entries[skip:])

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
