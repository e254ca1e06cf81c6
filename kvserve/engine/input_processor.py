"""The one door into the engine: prompt + parameters -> ``EngineRequest``.

``InputProcessor.process`` tokenizes a prompt (text or token ids, bare or
in a ``kvserve.inputs`` dict) once,
validates the ids against the vocabulary, resolves the ``SamplingParams``
once (a copy: ``max_tokens`` filled in, checked against the context and
``max_logprobs``, the structured-output grammar compiled and bound), checks
the LoRA adapter can be used and attaches the priority and output kind. What
comes out is plain data the engine (in this process or another) takes as is.

Every check raises a ``ValueError`` whose message starts with the field it
is about (``prompt``, ``max_tokens``, ``logprobs``, ...): the server turns
it into a 400 naming that field. Nothing here runs the model or holds
per-request state.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.sampling_params import DEFAULT_DRY_SEQUENCE_BREAKERS, SamplingParams
from kvserve.engine.structured_output import StructuredOutputCompiler
from kvserve.engine.tokenizer import Tokenizer
from kvserve.inputs import Prompt
from kvserve.lora.request import LoRARequest

PROMPT_KEYS = ("prompt", "prompt_token_ids")
# distinct dry_sequence_breakers lists whose token ids are kept
BREAKER_CACHE_SIZE = 16


class RequestOutputKind(enum.Enum):
    """What a request's ``RequestOutput``\\ s carry (vLLM's ``RequestOutputKind``)."""

    # every step: the text, token ids and logprobs so far, plus the step's delta
    CUMULATIVE = "cumulative"
    # every step: only what the step added (text, token ids, logprobs)
    DELTA = "delta"
    # once, when the request finishes (offline generate); the text is decoded
    # at the end unless stop strings must be watched
    FINAL_ONLY = "final_only"


@dataclass
class EngineRequest:
    """A validated request, ready for the engine: nothing left to resolve."""

    request_id: str
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: SamplingParams  # resolved (max_tokens set, grammar bound)
    priority: int = 0
    lora_request: LoRARequest | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    arrival_s: float = field(default_factory=time.monotonic)


class InputProcessor:
    """Tokenize, validate and resolve requests for one engine configuration."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.scheduler_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        ids = set(config.model_config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(ids))
        self._grammar_compiler: StructuredOutputCompiler | None = None
        self._vocab_texts: list[str] | None = None  # each token's text, read on first use
        self._breaker_ids: dict[tuple[str, ...], frozenset[int]] = {}

    # ------------------------------------------------------------ the door

    def process(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str,
        priority: int = 0, lora_request: LoRARequest | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> EngineRequest:
        """The engine request for ``prompt``; ValueError naming the field if
        anything is invalid. ``params`` is not changed."""
        text, token_ids = self.tokenize(prompt)
        return self.process_tokens(text, token_ids, params, request_id, priority,
                                   lora_request, output_kind)

    def process_tokens(
        self, text: str | None, token_ids: list[int], params: SamplingParams | None,
        request_id: str, priority: int = 0, lora_request: LoRARequest | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> EngineRequest:
        """``process`` for a prompt already tokenized by ``tokenize`` (or a
        chat template): resolve the parameters, check the adapter."""
        resolved = self.compile_grammar(
            self.resolve_params(len(token_ids), params or SamplingParams()))
        if lora_request is not None:
            self.check_lora(lora_request)
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind={output_kind!r} is invalid: must be a "
                             "RequestOutputKind")
        return EngineRequest(request_id, text, token_ids, resolved, priority, lora_request,
                             output_kind)

    # ------------------------------------------------------------ prompts

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt (text or ids), validated."""
        if isinstance(prompt, dict):
            prompt = _unwrap(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt: must contain at least 1 token")
        vocab_size = self.vocab_size
        # the usual prompt is checked in C (types, then bounds); the loop names a bad id
        if (set(map(type, token_ids)) == {int}
                and min(token_ids) >= 0 and max(token_ids) < vocab_size):
            return None, token_ids
        for i, token_id in enumerate(token_ids):
            if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"prompt[{i}]={token_id!r} is invalid: token ids must be integers in "
                    f"[0, {vocab_size - 1}]"
                )
        return None, token_ids

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            kwargs: dict[str, Any] | None = None) -> list[int]:
        """A conversation's prompt token ids, through the tokenizer's template."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, kwargs)

    # ------------------------------------------------------------ parameters

    def resolve_params(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """A copy of ``params`` with ``max_tokens`` filled in when unset and
        the model's EOS ids bound, checked against the context and the engine's ``max_logprobs``."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens leave no room in max_model_len="
                f"{self.max_model_len}; the prompt must be at most {self.max_model_len - 1} "
                "tokens"
            )
        self._check_logprobs(params)
        for token_id in params.logit_bias or {}:
            if token_id >= self.vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is out of range: must be in "
                                 f"[0, {self.vocab_size - 1}]")
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} is invalid: the prompt has {num_prompt_tokens} "
                f"tokens and max_model_len={self.max_model_len}, so at most {room} tokens can "
                "be generated"
            )
        resolved = params.with_eos_token_ids(self.eos_token_ids)  # a copy
        if resolved.max_tokens is None:
            resolved.max_tokens = room
        if resolved.uses_dry:
            resolved = resolved.with_dry_breaker_ids(
                self.dry_breaker_ids(resolved.dry_sequence_breakers))
        return resolved

    def dry_breaker_ids(self, breakers: list[str] | None) -> frozenset[int]:
        """The ids of the tokens whose text holds a DRY sequence breaker
        (None: llama.cpp's defaults); the last ``BREAKER_CACHE_SIZE`` lists are
        cached, so clients sending ever new lists cannot grow it."""
        key = tuple(DEFAULT_DRY_SEQUENCE_BREAKERS if breakers is None else breakers)
        if key not in self._breaker_ids:
            if len(self._breaker_ids) >= BREAKER_CACHE_SIZE:  # forget the oldest list
                del self._breaker_ids[next(iter(self._breaker_ids))]
            if self._vocab_texts is None:
                self._vocab_texts = [self.tokenizer.decode([i], skip_special_tokens=False)
                                     for i in range(self.vocab_size)]
            self._breaker_ids[key] = frozenset(
                i for i, text in enumerate(self._vocab_texts) if any(b in text for b in key))
        return self._breaker_ids[key]

    def _check_logprobs(self, params: SamplingParams) -> None:
        """At most ``max_logprobs`` top logprobs (-1: the vocabulary)."""
        limit = self.config.max_logprobs
        limit = self.vocab_size if limit == -1 else min(limit, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(
                    f"{name}={value} is invalid: this engine returns at most {limit} "
                    "top logprobs per token (max_logprobs, --max-logprobs)"
                )

    @property
    def grammar_compiler(self) -> StructuredOutputCompiler:
        """The structured-output compiler (built, and xgrammar imported, on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = StructuredOutputCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def compile_grammar(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its structured output's grammar compiled and bound
        (unchanged without one, or when already bound); ValueError when it
        cannot be compiled. Cached, so the server can compile in a worker
        thread first and the engine's call finds it."""
        if params.structured_output is None or params.grammar is not None:
            return params
        return params.with_grammar(self.grammar_compiler.compile(params.structured_output))

    def check_lora(self, lora_request: LoRARequest) -> None:
        """A ValueError unless ``lora_request`` is an adapter this engine can
        run (its files are checked when the engine loads it)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r} is invalid: must be a LoRARequest")
        if self.config.lora_config is None:
            raise ValueError(
                f"lora_request: adapter '{lora_request.lora_name}' was given but LoRA is not "
                "enabled; create the engine with enable_lora=True (--enable-lora)"
            )


def _unwrap(prompt: Mapping[str, Any]) -> str | list[int]:
    """The text or ids inside a ``TextPrompt`` / ``TokensPrompt`` dict."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt: key {unknown[0]!r} is not supported; a prompt dict has "
                         f"one of {', '.join(PROMPT_KEYS)}")
    if len(prompt) != 1:
        raise ValueError(f"prompt: a prompt dict has exactly one of {', '.join(PROMPT_KEYS)}, "
                         f"got {sorted(prompt) or 'none'}")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt: 'prompt' must be a string, got "
                             f"{type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt: 'prompt_token_ids' must be a list of token ids, got "
                         f"{type(ids).__name__}")
    return list(ids)
