"""How one request wants its tokens chosen and when it wants to stop.

``SamplingParams`` uses vLLM's names and defaults so users can move between
the two. It validates itself on construction with messages that name the
field, the value and what is allowed. The engine may fill in two things the
user leaves open: ``max_tokens=None`` (until the context ends) and the
model's EOS token ids (``with_eos_token_ids``). Pure Python: no torch here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from kvserve.core.structured_output import StructuredOutputParams

# the default of the engine's limit on top logprobs (vLLM's --max-logprobs
# default); the engine checks each request against its own max_logprobs
MAX_LOGPROBS = 20
# below this temperature a request is greedy
GREEDY_TEMPERATURE = 1e-5

# llama.cpp's DRY sequence breakers, the default of dry_sequence_breakers
DEFAULT_DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _invalid(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (vLLM names and defaults).

    ``top_k`` 0 or -1 turns top-k off; ``logprobs`` is the number of top
    logprobs wanted besides the sampled token (0 = only the sampled one,
    None = none); ``prompt_logprobs`` the same for every prompt token after
    the first (its logprob given the tokens before it); ``max_tokens=None``
    means "until the context ends" and is replaced by the engine before the
    request is scheduled. ``logit_bias`` adds its values (in [-100, 100]) to
    the logits of its token ids before sampling, greedy included.
    ``structured_output`` constrains the output to a JSON schema, regex,
    choice or grammar; the engine binds the compiled grammar
    (``with_grammar``) before the request is scheduled. ``dry_*`` are
    llama.cpp's DRY penalty on tokens that extend a repeat of earlier text
    (``kvserve/sampling/dry.py``), off while ``dry_multiplier`` is 0.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutputParams | None = None
    # disaggregated prefill / decode (vLLM's names): {"do_remote_decode": true} asks a
    # prefill engine to keep the prompt's KV for a decode engine; a decode engine
    # gets what the prefill engine answered ({"do_remote_prefill": true, "remote_*"})
    kv_transfer_params: dict[str, Any] | None = None
    # DRY (llama.cpp's names; kvserve/sampling/dry.py): multiplier 0 is off;
    # breakers None are llama.cpp's ("\n", ":", '"', "*"), [] none
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    # the compiled grammar of structured_output, bound by the engine (shared, never copied)
    _grammar: Any = field(default=None, init=False, repr=False, compare=False)
    # the model's EOS ids, bound by the engine through with_eos_token_ids()
    _eos_token_ids: tuple[int, ...] = field(default=(), init=False, repr=False)
    # the token ids of dry_sequence_breakers, bound by the engine (with_dry_breaker_ids)
    _dry_breaker_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.dry_sequence_breakers is not None:
            if isinstance(self.dry_sequence_breakers, str):
                raise _invalid("dry_sequence_breakers", self.dry_sequence_breakers,
                               "must be a list of strings")
            self.dry_sequence_breakers = list(self.dry_sequence_breakers)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        self._validate()

    def _validate(self) -> None:
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_stops()
        self._validate_logit_bias()

    def _validate_sampling(self) -> None:
        if self.n < 1:
            raise _invalid("n", self.n, "must be >= 1")
        if self.kv_transfer_params is not None and self.n != 1:
            raise _invalid("n", self.n, "must be 1 with kv_transfer_params (disaggregated "
                           "prefill / decode)")
        if not self.temperature >= 0:
            raise _invalid("temperature", self.temperature, "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise _invalid("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            raise _invalid("top_k", self.top_k, "must be -1 or 0 (off), or >= 1")
        if not 0 <= self.min_p <= 1:
            raise _invalid("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise _invalid("seed", self.seed, "must fit in a signed 64-bit integer")
        if self.logprobs is not None and self.logprobs < 0:
            raise _invalid("logprobs", self.logprobs, "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise _invalid("prompt_logprobs", self.prompt_logprobs, "must be >= 0")

    def _validate_penalties(self) -> None:
        if not -2 <= self.presence_penalty <= 2:
            raise _invalid("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise _invalid("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise _invalid("repetition_penalty", self.repetition_penalty, "must be > 0")
        if not 0 <= self.dry_multiplier <= 100:
            raise _invalid("dry_multiplier", self.dry_multiplier, "must be in [0, 100] (0: off)")
        if not 1 < self.dry_base <= 10:
            raise _invalid("dry_base", self.dry_base, "must be in (1, 10]")
        if not _is_int(self.dry_allowed_length) or self.dry_allowed_length < 1:
            raise _invalid("dry_allowed_length", self.dry_allowed_length,
                           "must be an integer >= 1")
        if not _is_int(self.dry_penalty_last_n) or self.dry_penalty_last_n < -1:
            raise _invalid("dry_penalty_last_n", self.dry_penalty_last_n,
                           "must be an integer >= -1 (-1: the whole sequence, 0: off)")
        for i, breaker in enumerate(self.dry_sequence_breakers or []):
            if not isinstance(breaker, str) or not breaker:
                raise _invalid(f"dry_sequence_breakers[{i}]", breaker,
                               "must be a non-empty string")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _invalid("max_tokens", self.max_tokens, "must be >= 1")
        if self.min_tokens < 0:
            raise _invalid("min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid(
                "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})"
            )

    def _validate_logit_bias(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise _invalid("logit_bias", token_id, "keys must be token ids (integers >= 0)")
            if not -100 <= bias <= 100:
                raise _invalid(f"logit_bias[{token_id}]", bias, "must be in [-100, 100]")

    def _validate_stops(self) -> None:
        assert isinstance(self.stop, list) and self.stop_token_ids is not None
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str) or not stop:
                raise _invalid(f"stop[{i}]", stop, "must be a non-empty string")
        for i, token_id in enumerate(self.stop_token_ids):
            if not isinstance(token_id, int) or token_id < 0:
                raise _invalid(f"stop_token_ids[{i}]", token_id, "must be an integer >= 0")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token every step."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def changes_logits(self) -> bool:
        """True when logits are biased or masked before sampling (so even a
        greedy request is not a plain argmax)."""
        return self.logit_bias is not None or self.structured_output is not None

    @property
    def grammar(self) -> Any:
        """The compiled grammar bound by the engine (None until bound)."""
        return self._grammar

    def with_grammar(self, grammar: Any) -> SamplingParams:
        """A copy with ``structured_output``'s compiled grammar bound."""
        params = self.clone()
        params._grammar = grammar
        return params

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (it is normalised to one on construction)."""
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Token ids that end the request: ``stop_token_ids`` plus the bound
        EOS ids (unless ``ignore_eos``)."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(self._eos_token_ids)
        return frozenset(ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids bound by the engine (empty until bound)."""
        return self._eos_token_ids

    def clone(self) -> SamplingParams:
        """A deep copy (lists included), safe to change; the compiled grammar
        is shared, not copied."""
        return copy.deepcopy(self, {id(self._grammar): self._grammar})

    @property
    def uses_dry(self) -> bool:
        """True when the DRY penalty can change this request's logits."""
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def dry_breaker_ids(self) -> frozenset[int]:
        """The token ids of ``dry_sequence_breakers``, bound by the engine."""
        return self._dry_breaker_ids

    def with_dry_breaker_ids(self, ids: frozenset[int]) -> SamplingParams:
        """A copy with the token ids of ``dry_sequence_breakers`` bound."""
        params = self.clone()
        params._dry_breaker_ids = frozenset(ids)
        return params

    def with_eos_token_ids(self, eos_token_ids: list[int] | tuple[int, ...]) -> SamplingParams:
        """A copy with the model's EOS ids bound (used by ``all_stop_token_ids``)."""
        params = self.clone()
        params._eos_token_ids = tuple(eos_token_ids)
        return params

    def child(self, index: int) -> SamplingParams:
        """The params of completion ``index`` of an ``n > 1`` request: ``n=1``
        and, when a seed is set, seed ``seed + index`` (wrapped to int64)."""
        if not 0 <= index < self.n:
            raise _invalid("index", index, f"must be in [0, {self.n - 1}] for n={self.n}")
        params = self.clone()
        params.n = 1
        if self.seed is not None:
            params.seed = (self.seed + index - _INT64_MIN) % 2**64 + _INT64_MIN
        return params

    def children(self) -> list[SamplingParams]:
        """The params of each of the ``n`` completions, in order."""
        return [self.child(i) for i in range(self.n)]
