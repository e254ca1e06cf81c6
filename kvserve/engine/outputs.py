"""What the engine returns to users: ``RequestOutput`` with one
``CompletionOutput`` per sample, shaped like vLLM's so code can switch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.core.request import RequestTimes


@dataclass
class Logprob:
    """The log-probability of one token and its rank in the distribution."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # one dict per generated token: token id -> Logprob (sampled + top ones)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # what this step added, for streaming
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics(RequestTimes):
    """Per-request timings (``time.monotonic`` seconds) and prefix-cache reuse."""

    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative text and tokens)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs, from the first output on: None for
    # the first prompt token, then token id -> Logprob (the prompt token + top ones)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a prefill engine's answer on a finished request whose KV it keeps for a
    # decode engine (SamplingParams.kv_transfer_params)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (longest sample)."""
        num_tokens = max((len(c.token_ids) for c in self.outputs), default=0)
        first, last = self.metrics.first_token_s, self.metrics.last_token_s
        if num_tokens < 2 or first is None or last is None:
            return None
        return (last - first) / (num_tokens - 1)
