"""The synchronous engine front end: requests in, text out, one ``step()`` at a time.

Requests come in through the ``InputProcessor`` (``add_request`` for a raw
prompt, ``add_engine_request`` for one already processed); a request with
``n > 1`` fans out into ``n`` core requests. ``step`` takes the core's
token ids (from a core in this process, or in its own: see
``core_client``) and turns them into text with one incremental detokenizer
per sample, ending a sample early when a stop string appears, then reports
each changed request as its ``RequestOutputKind`` asks. ``LLM`` (offline)
and the ``EngineClient`` (server) are both built on it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.outputs import EngineCoreOutput, Logprobs
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.core_client import CoreClient, EngineCoreRequest, InprocCoreClient
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.engine_core import EngineCore, Executor, create_executor
from kvserve.engine.input_processor import EngineRequest, InputProcessor, RequestOutputKind
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvserve.inputs import Prompt
from kvserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "Prompt", "load_engine_tokenizer"]


def load_engine_tokenizer(config: EngineConfig) -> Tokenizer:
    """The configuration's tokenizer (the byte tokenizer without one), chat template set."""
    tokenizer: Tokenizer = (
        load_tokenizer(config.tokenizer_path) if config.tokenizer_path else ByteTokenizer()
    )
    if config.chat_template is not None:
        tokenizer.set_chat_template(config.chat_template)
    return tokenizer


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
    # final-only with no stop strings to watch: the text is decoded once,
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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # with prompt_logprobs: None for the first prompt token, then one dict each
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a prefill engine's answer: where a decode engine pulls the request's KV
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def final_only(self) -> bool:
        return self.output_kind is RequestOutputKind.FINAL_ONLY


class LLMEngine:
    """Process inputs, drive the core, detokenize: stepped by its owner."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 core: EngineCore | CoreClient) -> None:
        self.config = config
        self.processor = InputProcessor(config, tokenizer)
        self.core: CoreClient = InprocCoreClient(core) if isinstance(core, EngineCore) else core
        self._tracked: dict[str, _Tracked] = {}
        self._core_to_sample: dict[str, tuple[_Tracked, _Sample]] = {}
        self._next_id = 0
        # adapters removed: their ids stay theirs (KV blocks cached under an id
        # may outlive the adapter, so another adapter must not take the id)
        self._removed_loras: dict[int, LoRARequest] = {}
        self._loras: dict[int, LoRARequest] = {}  # adapters added and not removed
        self.step_s = 0.0  # wall time spent in step()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, executor: Executor | None = None) -> LLMEngine:
        """An engine whose core runs in this process."""
        config = args.create_engine_config()
        core = EngineCore(config, executor or create_executor(config))
        return cls(config, load_engine_tokenizer(config), core)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.processor.eos_token_ids

    # ------------------------------------------------------------ input

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter so requests can use it (a no-op once loaded).

        Raises ValueError naming the problem: LoRA not enabled, missing files,
        an unsupported config field, tensors that do not fit the model, or a
        ``lora_int_id`` already used by another adapter.
        """
        self.processor.check_lora(lora_request)
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
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> str:
        """Process and queue a request (``InputProcessor.process``), run with
        ``lora_request``'s adapter if given; raises ValueError (naming the
        field) if it is invalid. ``output_kind`` says what ``step`` reports."""
        request_id = request_id if request_id is not None else self.new_request_id()
        request = self.processor.process(prompt, params, request_id, priority, lora_request,
                                         output_kind)
        return self.add_engine_request(request)

    def new_request_id(self) -> str:
        """An id no request of this engine has had."""
        self._next_id += 1
        return str(self._next_id - 1)

    def add_engine_request(self, request: EngineRequest) -> str:
        """Queue a processed request; its id. With an in-process core a
        rejection raises ValueError here; a core process reports it later
        (``take_rejections``)."""
        request_id = request.request_id
        if request_id in self._tracked:
            raise ValueError(f"request_id='{request_id}' is already in use")
        params = request.params
        final_only = request.output_kind is RequestOutputKind.FINAL_ONLY
        samples = []
        core_requests = []
        for index, child in enumerate(params.children()):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, child)
            decode_at_end = final_only and not detokenizer.stops
            # such a sample needs no per-step outputs unless it collects logprobs
            core_requests.append(EngineCoreRequest(
                core_id, request.prompt_token_ids, child, request.priority,
                request.lora_request, not decode_at_end or child.logprobs is not None,
                request.arrival_s))
            samples.append(_Sample(index, core_id, detokenizer, decode_at_end=decode_at_end))
        added: list[str] = []
        try:
            for core_request in core_requests:
                self.core.add_request(core_request)
                added.append(core_request.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        tracked = _Tracked(request_id, request.prompt, request.prompt_token_ids, params,
                           samples, RequestMetrics(arrival_s=request.arrival_s),
                           request.output_kind)
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
        for core_output in self.core.abort_requests(core_ids):
            # tokens a final-only sample had not been sent yet
            sample = self._core_to_sample[core_output.request_id][1]
            sample.token_ids.extend(core_output.new_token_ids)
        for sample in tracked.samples:
            sample.finish_reason = sample.finish_reason or "abort"
        return self._finish_output(tracked)

    def take_rejections(self) -> list[tuple[str, Exception]]:
        """(user request id, error) of each request the core refused since the
        last call (a core process reports them from ``step``); they are forgotten."""
        rejected = []
        for rejection in self.core.take_rejections():
            entry = self._core_to_sample.get(rejection.request_id)
            if entry is None or entry[0].request_id not in self._tracked:
                continue
            tracked = entry[0]
            self.core.abort_requests([s.core_request_id for s in tracked.samples])
            self._forget(tracked)
            rejected.append((tracked.request_id, rejection.error()))
        return rejected

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
            entry = core_to_sample.get(core_output.request_id)
            if entry is None:
                continue  # aborted while a core process was still reporting it
            tracked, sample = entry
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
            if core_output.kv_transfer_params is not None:
                tracked.kv_transfer_params = core_output.kv_transfer_params
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
                # a core process's outputs of several steps can arrive together:
                # a sample's deltas of one call add up
                deltas = changed.setdefault(tracked.request_id, {})
                text, ids = deltas.get(sample.index, ("", []))
                deltas[sample.index] = (text + delta_text, [*ids, *new_ids])
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
        metrics.first_scheduled_s = core_output.first_scheduled_s

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
        delta = tracked.output_kind is RequestOutputKind.DELTA
        for sample in tracked.samples:
            delta_text, delta_ids = deltas.get(sample.index, ("", []))
            logprobs = sample.logprobs
            if delta and logprobs is not None:
                logprobs = logprobs[len(logprobs) - len(delta_ids):]
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=delta_text if delta else sample.detokenizer.output_text,
                    token_ids=list(delta_ids) if delta else list(sample.token_ids),
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    logprobs=logprobs,
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
            kv_transfer_params=tracked.kv_transfer_params,
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
        (``wait_s``) — with async scheduling it overlaps the device's work.
        A core process times its own steps (``step_s`` in its stats)."""
        core = self.core.stats()
        step_s = core.get("step_s", self.step_s)
        host_s = max(0.0, step_s - core["device_s"])
        busy_s = max(0.0, step_s - core["wait_s"])

        def share(seconds: float) -> float:
            return seconds / step_s if step_s > 0 else 0.0

        return {**core, "step_s": step_s, "host_s": host_s, "host_share": share(host_s),
                "host_busy_s": busy_s, "host_busy_share": share(busy_s)}
