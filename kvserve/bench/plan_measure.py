"""``kvserve plan --measure`` and ``--sweep``: the engine run on the plan's shapes.

The measuring half of ``kvserve plan`` (``plan/`` itself stays arithmetic).
One engine with random weights (``load_format="dummy"``: only shapes
matter) runs every point as the plan describes it, and every timed point is
checked against that description:

- ``decode(batch, context)``: ``batch`` fresh requests are admitted and
  prefilled, then decoded until their mean context is ``context`` − (steps
  − 1)/2; the next ``steps`` engine steps are timed one by one (the wall time
  of each ``step()`` call: with async scheduling, one device step in the
  steady state). Every timed step must give every one of the ``batch``
  requests exactly one new token, none may be preempted, and the timed
  steps' mean context must be ``context`` (±1%); otherwise
  ``MeasurementError``. Each request may run to ``max_model_len``, so none
  finishes inside the window; all are aborted after it.
- ``prefill(prompt)``: one request of exactly ``prompt`` tokens on the idle
  engine, its time to first token (the engine's own TTFT), ``repeats``
  times after one untimed warm-up (kernel compilation, graph choice).

Prompts are random token ids (no prefix-cache hits: caching is off too).
The copy and matmul rates are measured first, in the same process
(``offline.start``); ``plan/compare.py`` turns the records into errors, MBU
and MFU.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvserve.bench.offline import OfflineBench, start
from kvserve.bench.workloads import MIN_TOKEN_ID
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.plan.compare import DecodeMeasurement, PrefillMeasurement, RunInfo, Spread
from kvserve.plan.counts import PlanError
from kvserve.plan.step_model import PREFILL_CHUNK_TOKENS

DECODE_STEPS = 32
PREFILL_REPEATS = 5
# decode steps after every request has its first token and before the timed ones
MIN_WARMUP_STEPS = 4
# the timed steps' mean context may miss the stated one by this share (or 1 token)
CONTEXT_TOLERANCE = 0.01
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def prefill_chunk(max_batch: int) -> int:
    """The measuring engine's token budget a step: the plan's prefill chunk,
    or one token for each of ``max_batch`` requests if that is more."""
    return max(PREFILL_CHUNK_TOKENS, max_batch)


def admission_steps(batch: int, context: int, chunk: int) -> int:
    """At most how many steps prefilling ``batch`` prompts of up to ``context``
    tokens takes at ``chunk`` tokens a step (each gives the requests already
    started a token)."""
    return -(-batch * context // chunk)


def decode_length(context: int, steps: int, admission: int) -> int:
    """The most tokens a request reaches while ``steps`` decode steps are timed
    at a mean context of ``context``: the first admitted requests run ahead
    of the mean by up to the ``admission`` steps."""
    return context + steps // 2 + 2 + admission


class MeasurementError(RuntimeError):
    """What was timed is not what the plan describes."""


@dataclass
class _Tracked:
    """Token counts of the requests of one decode point, from the engine's outputs."""

    tokens: dict[str, int]  # request id -> prompt + generated tokens so far

    @property
    def mean_context(self) -> float:
        return statistics.fmean(self.tokens.values())

    def record(self, outputs: list[Any]) -> tuple[int, float | None, int]:
        """Count one step's outputs: (requests with exactly one new token,
        their mean context during the step, requests with another count)."""
        contexts, odd = [], 0
        for output in outputs:
            if output.request_id not in self.tokens:
                continue
            new = len(output.outputs[0].delta_token_ids)
            if new == 1:
                contexts.append(self.tokens[output.request_id])
            elif new:
                odd += 1
            self.tokens[output.request_id] += new
        return len(contexts), (statistics.fmean(contexts) if contexts else None), odd


class PlanMeasurer:
    """One engine for all the points of a ``--measure`` or ``--sweep`` run."""

    def __init__(self, bench: OfflineBench, steps: int = DECODE_STEPS,
                 repeats: int = PREFILL_REPEATS, seed: int = 0) -> None:
        self.bench = bench
        self.engine = bench.llm.engine
        self.steps = steps
        self.repeats = repeats
        self._rng = random.Random(seed)

    @classmethod
    def start(cls, model: str, *, device: str, dtype: str, max_batch: int, max_model_len: int,
              steps: int = DECODE_STEPS, repeats: int = PREFILL_REPEATS,
              quantization: str | None = None, kv_cache_dtype: str = "auto") -> PlanMeasurer:
        """Measure the device's rates, then build the engine for ``max_batch``
        requests of up to ``max_model_len`` tokens (prefix caching off,
        prefill chunks of the plan's ``PREFILL_CHUNK_TOKENS``; ``quantization``
        rounds the linears at load, as ``--quantization`` does; ``kv_cache_dtype``
        as ``--kv-cache-dtype``)."""
        if steps < 2 or repeats < 1:
            raise PlanError("--measure-steps", f"need >= 2 steps and >= 1 repeat, got {steps} "
                                               f"and {repeats}")
        args = EngineArgs(model=model, load_format="dummy", dtype=dtype, device=device,
                          max_num_seqs=max_batch, max_model_len=max_model_len,
                          enable_prefix_caching=False, quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype,
                          max_num_batched_tokens=prefill_chunk(max_batch))
        return cls(start(args, args.create_engine_config()), steps, repeats)

    @property
    def max_model_len(self) -> int:
        return self.bench.config.scheduler_config.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        stats = self.bench.llm.stats()
        return int(stats["kv_blocks_total"]) * self.bench.config.cache_config.block_size

    def run_info(self) -> RunInfo:
        rates = self.bench.rates
        return RunInfo(card=rates.card, device=self.bench.device, dtype=self.bench.dtype,
                       element_bytes=ELEMENT_BYTES[self.bench.dtype],
                       copy_gb_s=rates.copy_gb_s, matmul_tflop_s=rates.matmul_tflop_s,
                       steps=self.steps, repeats=self.repeats,
                       kv_capacity_tokens=self.kv_capacity_tokens)

    def decode_fits(self, batch: int, context: int) -> str | None:
        """Why ``batch`` requests at ``context`` cannot be timed here, or None."""
        block = self.bench.config.cache_config.block_size
        max_num_seqs = self.bench.config.scheduler_config.max_num_seqs
        if batch > max_num_seqs:
            return f"batch {batch} is more than the engine's max_num_seqs {max_num_seqs}"
        most = decode_length(context, self.steps, self._admission_steps(batch, context))
        per_request = -(-most // block) * block
        needed, capacity = batch * per_request, self.kv_capacity_tokens
        if needed > capacity:
            return (f"does not fit: {batch} x {per_request:,} = {needed:,} tokens of KV, "
                    f"the pool holds {capacity:,}")
        return None

    def _prompt(self, length: int) -> list[int]:
        vocab = self.bench.vocab_size
        return [self._rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(length)]

    def _stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.bench.llm.stats().items()
                if isinstance(v, (int, float))}

    def decode(self, batch: int, context: int) -> DecodeMeasurement:
        """Time ``self.steps`` decode steps of ``batch`` requests at a mean
        context of ``context``; raises MeasurementError if what ran differs."""
        admission_steps = self._admission_steps(batch, context)
        prompt_len = context - (self.steps - 1) // 2 - MIN_WARMUP_STEPS - admission_steps
        if prompt_len < 1:
            raise PlanError("--context", f"{context} is too short to time {self.steps} decode "
                                         f"steps of batch {batch} at it; use more than "
                                         f"{context - prompt_len}")
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=self.max_model_len - prompt_len)
        ids = [self.engine.add_request(self._prompt(prompt_len), params) for _ in range(batch)]
        tracked = _Tracked(dict.fromkeys(ids, prompt_len))
        try:
            self._admit(tracked, prompt_len, admission_steps)
            self._warm(tracked, batch, context - (self.steps - 1) / 2)
            return self._timed(tracked, batch, context)
        finally:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()  # reports (and drops) a step still in flight

    def _admission_steps(self, batch: int, context: int) -> int:
        """At most how many steps prefilling ``batch`` prompts takes (each gives
        the requests already started a token)."""
        return admission_steps(batch, context,
                               self.bench.config.scheduler_config.max_num_batched_tokens)

    def _admit(self, tracked: _Tracked, prompt_len: int, admission_steps: int) -> None:
        for _ in range(4 * admission_steps + 64):
            if min(tracked.tokens.values()) > prompt_len:
                return
            tracked.record(self.engine.step())
        raise MeasurementError(f"the {len(tracked.tokens)} requests did not all start within "
                               f"{4 * admission_steps + 64} steps")

    def _warm(self, tracked: _Tracked, batch: int, first_context: float) -> None:
        """Decode until ``MIN_WARMUP_STEPS`` steps in a row gave the whole batch a
        token and the next step's mean context is ``first_context``."""
        full = 0
        for _ in range(MIN_WARMUP_STEPS + int(first_context) + 64):
            if full >= MIN_WARMUP_STEPS and tracked.mean_context >= first_context - 0.5:
                return
            got, _, odd = tracked.record(self.engine.step())
            full = full + 1 if got == batch and not odd else 0
        raise MeasurementError(f"the {batch} requests never decoded together for "
                               f"{MIN_WARMUP_STEPS} steps in a row before the timed ones")

    def _timed(self, tracked: _Tracked, batch: int, context: int) -> DecodeMeasurement:
        before = self._stats()
        times, batches, contexts = [], [], []
        for _ in range(self.steps):
            start_s = time.perf_counter()
            outputs = self.engine.step()
            times.append(time.perf_counter() - start_s)
            got, mean_context, odd = tracked.record(outputs)
            if odd:
                raise MeasurementError(f"a timed step gave {odd} requests more than one token")
            batches.append(got)
            if mean_context is not None:
                contexts.append(mean_context)
        after = self._stats()
        timed_context = statistics.fmean(contexts) if contexts else 0.0
        preempted = after.get("num_preemptions", 0) - before.get("num_preemptions", 0)
        if min(batches) != batch or max(batches) != batch or preempted:
            raise MeasurementError(
                f"--measure timed a batch of {min(batches)} to {max(batches)} requests "
                f"({preempted:.0f} preempted), not the {batch} the plan describes")
        if abs(timed_context - context) > max(1.0, CONTEXT_TOLERANCE * context):
            raise MeasurementError(f"--measure timed a mean context of {timed_context:.1f} "
                                   f"tokens, not the {context} the plan describes")
        return DecodeMeasurement(
            batch=batch, context=context, step=Spread.of_seconds(times),
            batch_timed_min=min(batches), batch_timed_max=max(batches),
            mean_context_timed=timed_context,
            device_ms_per_step=_per_step_ms(before, after, "device_s", self.steps),
            host_busy_ms_per_step=_per_step_ms(before, after, "host_busy_s", self.steps))

    def prefill(self, prompt: int) -> PrefillMeasurement:
        """The TTFT of one ``prompt``-token request, ``repeats`` times."""
        if prompt + 1 > self.max_model_len:
            raise PlanError("--prompt", f"{prompt} tokens and one new one exceed the engine's "
                                        f"max_model_len {self.max_model_len}")
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ttfts = []
        for repeat in range(self.repeats + 1):
            request_id = self.engine.add_request(self._prompt(prompt), params)
            output = self._wait_finished(request_id)
            if len(output.prompt_token_ids) != prompt or output.num_cached_tokens:
                raise MeasurementError(f"the prefill ran {len(output.prompt_token_ids)} prompt "
                                       f"tokens ({output.num_cached_tokens} cached), not {prompt}")
            if repeat and output.metrics.ttft_s is not None:
                ttfts.append(output.metrics.ttft_s)
        return PrefillMeasurement(prompt=prompt, ttft=Spread.of_seconds(ttfts))

    def _wait_finished(self, request_id: str) -> Any:
        for _ in range(10_000):
            for output in self.engine.step():
                if output.request_id == request_id and output.finished:
                    self.engine.step()  # reports (and drops) a step still in flight
                    return output
        raise MeasurementError(f"request {request_id} did not finish")


def _per_step_ms(before: dict[str, float], after: dict[str, float], key: str,
                 steps: int) -> float | None:
    if key not in before or key not in after:
        return None
    return (after[key] - before[key]) / steps * 1e3

