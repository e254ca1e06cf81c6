"""The synchronous engine: text in, text out, one ``step()`` at a time.

It turns prompts into token ids, validates them, fans a request with
``n > 1`` out into ``n`` core requests, steps the ``EngineCore``, and turns
token ids back into text with one incremental detokenizer per sample,
ending a sample early when a stop string appears. A request may name a LoRA
adapter (``LoRARequest``), loaded by the executor the first time it is seen.
``LLM`` (offline) and the ``EngineClient`` (server) are both built on it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, Logprobs
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.engine_core import EngineCore, Executor, create_executor
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.engine.structured_output import StructuredOutputCompiler
from kvserve.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _Sample:
    """One of the ``n`` completions of a request, as the engine tracks it."""

    index: int
    core_request_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # final_only with no stop strings to watch: the text is decoded once,
    # when the sample finishes
    decode_at_end: bool = False


@dataclass
class _Tracked:
    """A user request and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    # report only the finished request (offline generate): its text is then
    # decoded once at the end unless stop strings must be watched each step
    final_only: bool = False
    # with prompt_logprobs: None for the first prompt token, then one dict each
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    """Tokenize, schedule, run, detokenize: the engine loop, stepped by its owner."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, core: EngineCore) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.core = core
        self.max_model_len = config.scheduler_config.max_model_len
        self.eos_token_ids = self._eos_token_ids()
        self._tracked: dict[str, _Tracked] = {}
        self._core_to_sample: dict[str, tuple[_Tracked, _Sample]] = {}
        self._counter = itertools.count()
        # adapters removed: their ids stay theirs (KV blocks cached under an id
        # may outlive the adapter, so another adapter must not take the id)
        self._removed_loras: dict[int, LoRARequest] = {}
        self._loras: dict[int, LoRARequest] = {}  # adapters added and not removed
        self.step_s = 0.0  # wall time spent in step()
        self._grammar_compiler: StructuredOutputCompiler | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, executor: Executor | None = None) -> LLMEngine:
        config = args.create_engine_config()
        tokenizer: Tokenizer = (
            load_tokenizer(config.tokenizer_path) if config.tokenizer_path else ByteTokenizer()
        )
        if config.chat_template is not None:
            tokenizer.set_chat_template(config.chat_template)
        core = EngineCore(config, executor or create_executor(config))
        return cls(config, tokenizer, core)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ------------------------------------------------------------ input

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Token ids of a prompt (text or ids), validated against the model."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt: must contain at least 1 token")
        vocab_size = self.config.model_config.vocab_size
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

    def resolve_params(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """Fill in ``max_tokens`` when unset and check the request fits the context."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens leave no room in max_model_len="
                f"{self.max_model_len}; the prompt must be at most {self.max_model_len - 1} "
                "tokens"
            )
        self._check_logprobs(params)
        vocab_size = self.config.model_config.vocab_size
        for token_id in params.logit_bias or {}:
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is out of range: must be in "
                                 f"[0, {vocab_size - 1}]")
        params = params.with_eos_token_ids(self.eos_token_ids)
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} is invalid: the prompt has {num_prompt_tokens} "
                f"tokens and max_model_len={self.max_model_len}, so at most {room} tokens can "
                "be generated"
            )
        return params

    def _check_logprobs(self, params: SamplingParams) -> None:
        """At most ``max_logprobs`` top logprobs (-1: the vocabulary)."""
        vocab_size = self.config.model_config.vocab_size
        limit = self.config.max_logprobs
        limit = vocab_size if limit == -1 else min(limit, vocab_size)
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
                self.tokenizer, self.config.model_config.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def compile_grammar(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its structured output's grammar compiled and bound
        (unchanged without one); ValueError when it cannot be compiled."""
        if params.structured_output is None or params.grammar is not None:
            return params
        return params.with_grammar(self.grammar_compiler.compile(params.structured_output))

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter so requests can use it (a no-op once loaded).

        Raises ValueError naming the problem: LoRA not enabled, missing files,
        an unsupported config field, tensors that do not fit the model, or a
        ``lora_int_id`` already used by another adapter.
        """
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r} is invalid: must be a LoRARequest")
        if self.config.lora_config is None:
            raise ValueError(
                f"lora_request: adapter '{lora_request.lora_name}' was given but LoRA is not "
                "enabled; create the engine with enable_lora=True (--enable-lora)"
            )
        removed = self._removed_loras.get(lora_request.lora_int_id)
        if removed is not None and removed != lora_request:
            raise ValueError(
                f"lora_request: lora_int_id={lora_request.lora_int_id} belonged to the removed "
                f"adapter '{removed.lora_name}' ({removed.lora_path}), whose KV may still be "
                "cached; give this adapter a new id"
            )
        self.core.add_lora(lora_request)
        self._loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter, its host copy and its device slot; False if it was
        never added. ValueError while unfinished requests use it."""
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled; create the engine with enable_lora=True "
                             "(--enable-lora)")
        if not self.core.remove_lora(lora_int_id):
            return False
        self._removed_loras[lora_int_id] = self._loras.pop(lora_int_id)
        return True

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request, run with ``lora_request``'s adapter if given; raises
        ValueError (naming the field) if it is invalid. With ``final_only``,
        ``step`` reports the request once, when it finishes (no per-step
        outputs or deltas), as vLLM's offline ``generate`` does."""
        request_id = request_id if request_id is not None else str(next(self._counter))
        if request_id in self._tracked:
            raise ValueError(f"request_id='{request_id}' is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        params = self.compile_grammar(self.resolve_params(len(token_ids),
                                                          params or SamplingParams()))
        lora_int_id = 0
        if lora_request is not None:
            self.add_lora(lora_request)
            lora_int_id = lora_request.lora_int_id
        samples = []
        core_requests = []
        for index, child in enumerate(params.children()):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, child)
            decode_at_end = final_only and not detokenizer.stops
            # such a sample needs no per-step outputs unless it collects logprobs
            core_requests.append(Request(
                core_id, token_ids, child, self.eos_token_ids, priority, lora_int_id=lora_int_id,
                report_every_step=not decode_at_end or child.logprobs is not None))
            samples.append(_Sample(index, core_id, detokenizer, decode_at_end=decode_at_end))
        added: list[str] = []
        try:
            for core_request in core_requests:
                self.core.add_request(core_request)
                added.append(core_request.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        tracked = _Tracked(
            request_id, text, token_ids, params, samples,
            RequestMetrics(arrival_s=core_requests[0].arrival_s), final_only,
        )
        self._tracked[request_id] = tracked
        for sample in samples:
            self._core_to_sample[sample.core_request_id] = (tracked, sample)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its samples finish with reason "abort"."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        core_ids = [s.core_request_id for s in tracked.samples if s.finish_reason is None]
        for sample in tracked.samples:
            request = self.core.get_request(sample.core_request_id)
            if (sample.finish_reason is None and request is not None
                    and not request.report_every_step):  # its later tokens were not reported
                sample.token_ids = request.all_token_ids[request.num_prompt_tokens:]
        self.core.abort_requests(core_ids)
        for sample in tracked.samples:
            sample.finish_reason = sample.finish_reason or "abort"
        return self._finish_output(tracked)

    # ------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; one output per user request that changed."""
        start = time.perf_counter()
        core_outputs = self.core.step()
        # user request id -> this step's (delta text, delta ids) by sample index
        changed: dict[str, dict[int, tuple[str, list[int]]]] = {}
        stopped: list[str] = []
        now = time.monotonic()
        core_to_sample = self._core_to_sample
        for core_output in core_outputs:
            tracked, sample = core_to_sample[core_output.request_id]
            metrics = tracked.metrics
            if metrics.first_token_s is None:
                self._record_first_token(metrics, core_output, now)
            metrics.last_token_s = now
            new_ids = core_output.new_token_ids
            sample.token_ids.extend(new_ids)
            if core_output.new_logprobs is not None:
                self._append_logprobs(sample, core_output)
            if core_output.prompt_logprobs is not None and tracked.prompt_logprobs is None:
                # every sample computes them, so a stream has them with any
                # choice's first token; the first in is kept
                tracked.prompt_logprobs = [None, *map(self._ranked, core_output.prompt_logprobs)]
            if sample.decode_at_end and core_output.finish_reason is None:
                continue  # nothing to decode or report before it finishes
            delta_text = self._detokenize(sample, core_output, stopped)
            num_past_stop = len(sample.token_ids) - len(sample.detokenizer.output_token_ids)
            if sample.stop_reason is not None and num_past_stop > 0 and not sample.decode_at_end:
                # the step's tokens ran past the stop string: drop those after it
                del sample.token_ids[-num_past_stop:]
                if sample.logprobs is not None:
                    del sample.logprobs[-num_past_stop:]
                new_ids = new_ids[:len(new_ids) - num_past_stop]
            # a final_only request is reported only when it finishes, so its
            # samples still running have nothing to report
            if sample.finish_reason is not None or not tracked.final_only:
                changed.setdefault(tracked.request_id, {})[sample.index] = (delta_text, new_ids)
        if stopped:
            self.core.finish_stopped(stopped)
        results = []
        for user_id, deltas in changed.items():
            tracked = self._tracked[user_id]
            finished = tracked.finished
            if finished or not tracked.final_only:
                results.append(self._make_output(tracked, deltas, finished))
            if finished:
                self._forget(tracked)
        self.step_s += time.perf_counter() - start
        return results

    def _detokenize(
        self, sample: _Sample, core_output: EngineCoreOutput, stopped: list[str]
    ) -> str:
        """Decode a sample's new tokens, ending it at a stop string; the new text."""
        detokenizer = sample.detokenizer
        # with decode_at_end the sample has finished: decode the whole completion
        to_decode = sample.token_ids if sample.decode_at_end else core_output.new_token_ids
        # a stop token's own text is left out of the output, as vLLM does
        stop_string = detokenizer.update(
            to_decode, stop_terminated=core_output.finish_reason == "stop"
        )
        if stop_string is not None:
            sample.finish_reason = "stop"
            sample.stop_reason = stop_string
            if core_output.finish_reason is None:
                stopped.append(sample.core_request_id)
        elif core_output.finish_reason is not None:
            sample.finish_reason = core_output.finish_reason
            sample.stop_reason = core_output.stop_reason
        return detokenizer.flush() if sample.finish_reason is not None else detokenizer.get_delta()

    def _record_first_token(
        self, metrics: RequestMetrics, core_output: EngineCoreOutput, now: float
    ) -> None:
        metrics.first_token_s = now
        metrics.num_cached_tokens = core_output.num_cached_tokens
        request = self.core.get_request(core_output.request_id)
        if request is not None:
            metrics.first_scheduled_s = request.times.first_scheduled_s

    def _append_logprobs(self, sample: _Sample, core_output: EngineCoreOutput) -> None:
        if sample.logprobs is None:
            sample.logprobs = []
            sample.cumulative_logprob = 0.0
        assert core_output.new_logprobs is not None
        for entry in core_output.new_logprobs:
            sample.logprobs.append(self._ranked(entry))
            sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + entry.logprobs[0]

    def _ranked(self, entry: Logprobs) -> dict[int, Logprob]:
        """One token's logprobs as ``{token_id: Logprob}``: the chosen token
        first (with its rank), then the top ones (rank = position)."""
        ranked: dict[int, Logprob] = {}
        for position, (token_id, value) in enumerate(zip(entry.token_ids, entry.logprobs)):
            rank = entry.sampled_rank if position == 0 else position
            ranked.setdefault(token_id, Logprob(value, rank, self.tokenizer.decode([token_id])))
        return ranked

    def _make_output(
        self, tracked: _Tracked, deltas: dict[int, tuple[str, list[int]]], finished: bool
    ) -> RequestOutput:
        completions = []
        for sample in tracked.samples:
            delta_text, delta_ids = deltas.get(sample.index, ("", []))
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=sample.detokenizer.output_text,
                    token_ids=list(sample.token_ids),
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    logprobs=sample.logprobs,
                    cumulative_logprob=sample.cumulative_logprob,
                    delta_text=delta_text,
                    delta_token_ids=list(delta_ids),
                )
            )
        if finished:
            tracked.metrics.finished_s = time.monotonic()
        return RequestOutput(
            request_id=tracked.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            prompt_logprobs=tracked.prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=tracked.metrics,
        )

    def _finish_output(self, tracked: _Tracked) -> RequestOutput:
        output = self._make_output(tracked, {}, finished=True)
        self._forget(tracked)
        return output

    def _forget(self, tracked: _Tracked) -> None:
        self._tracked.pop(tracked.request_id, None)
        for sample in tracked.samples:
            self._core_to_sample.pop(sample.core_request_id, None)

    # ------------------------------------------------------------ state

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def get_num_unfinished_requests(self) -> int:
        return len(self._tracked)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(output tokens so far, the most it may produce) of an unfinished
        request, over its samples; None once it has finished."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        num_tokens = 0
        for sample in tracked.samples:
            request = self.core.get_request(sample.core_request_id)
            num_tokens += (request.num_output_tokens if request is not None
                           else len(sample.token_ids))
        return num_tokens, (tracked.params.max_tokens or 0) * len(tracked.samples)

    def stats(self) -> dict[str, Any]:
        """Scheduler counters, and where the steps' time went: ``device_s`` is
        the device's time from each step's first to its last kernel,
        ``host_share`` the rest of the steps' wall time, when the device sat
        waiting for the host (scheduling, input preparation, output
        processing); ``host_busy_share`` is the share of the steps' wall time
        the host spent on that work rather than waiting for a step's output
        (``wait_s``) — with async scheduling it overlaps the device's work."""
        core = self.core.stats()
        host_s = max(0.0, self.step_s - core["device_s"])
        busy_s = max(0.0, self.step_s - core["wait_s"])

        def share(seconds: float) -> float:
            return seconds / self.step_s if self.step_s > 0 else 0.0

        return {**core, "step_s": self.step_s, "host_s": host_s, "host_share": share(host_s),
                "host_busy_s": busy_s, "host_busy_share": share(busy_s)}
