"""Predicted beside measured: the records of ``kvserve plan --measure`` and
``--sweep``, the sweep's grid, and the comparison of each measured point
with the step model's prediction (error, MBU, MFU).

Plain data and arithmetic: ``bench/plan_measure.py`` fills the
measurement records by running the engine; this module never runs
anything. MBU and MFU come from ``utilization`` (the one formula of each).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.config import ModelConfig
from kvserve.param_count import count_params
from kvserve.plan.counts import Hardware, PlanInputs, decode_cost, prefill_cost
from kvserve.plan.step_model import StepConstants, decode_step, prefill_time
from kvserve.plan.utilization import mbu, mfu

# the grid of issue 29: decode batch x context, and prefill prompt lengths
SWEEP_BATCHES = (1, 8, 32, 128, 256)
SWEEP_CONTEXTS = (512, 2048, 8192)
SWEEP_PROMPTS = (128, 512, 2048, 8192)
# the counts of counts.py are for 16-bit weights and KV
COUNTED_ELEMENT_BYTES = 2


@dataclass(frozen=True)
class Spread:
    """Repeated timings of one thing, in ms."""

    median: float
    mean: float
    stdev: float
    min: float
    max: float
    p10: float
    p90: float
    count: int

    @classmethod
    def of_seconds(cls, values_s: list[float]) -> Spread:
        if not values_s:
            raise ValueError("a spread needs at least one timing")
        ms = sorted(v * 1e3 for v in values_s)

        def quantile(q: float) -> float:  # linear interpolation, as numpy's default
            position = q * (len(ms) - 1)
            low = math.floor(position)
            high = min(low + 1, len(ms) - 1)
            return ms[low] + (ms[high] - ms[low]) * (position - low)

        return cls(median=statistics.median(ms), mean=statistics.fmean(ms),
                   stdev=statistics.pstdev(ms), min=ms[0], max=ms[-1],
                   p10=quantile(0.1), p90=quantile(0.9), count=len(ms))


@dataclass(frozen=True)
class DecodeMeasurement:
    """Decode steps timed at a batch and context, with what was actually timed."""

    batch: int  # asked for
    context: int  # asked for: the mean context of the timed steps
    step: Spread  # wall time per engine step
    batch_timed_min: int  # requests that got a token, fewest in a timed step
    batch_timed_max: int
    mean_context_timed: float
    device_ms_per_step: float | None  # the device's share (CUDA events), when measured
    host_busy_ms_per_step: float | None  # the engine thread's work, when measured


@dataclass(frozen=True)
class PrefillMeasurement:
    """The time to first token of one prompt on the idle engine."""

    prompt: int
    ttft: Spread


@dataclass(frozen=True)
class RunInfo:
    """Where a measurement ran: card, dtype, and the rates measured first."""

    card: str
    device: str
    dtype: str
    element_bytes: int
    copy_gb_s: float
    matmul_tflop_s: float
    steps: int  # decode steps timed per point
    repeats: int  # timed prefills per prompt length
    kv_capacity_tokens: int


@dataclass(frozen=True)
class Comparison:
    """One point, predicted and measured (``measured_ms`` is the median)."""

    kind: str  # "decode" or "prefill"
    batch: int
    context: int  # decode: the context; prefill: the prompt length
    predicted_ms: float
    roofline_ms: float
    measured_ms: float | None = None
    measured: dict[str, Any] | None = None  # the whole measurement record
    error: float | None = None  # predicted / measured - 1
    mbu: float | None = None  # of the copy rate measured in the run
    mfu: float | None = None  # of the matmul rate measured in the run
    skipped: str | None = None  # why the point was not measured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def clamp_contexts(contexts: tuple[int, ...] | list[int], max_model_len: int,
                   steps: int) -> list[int]:
    """Each context, lowered where the model's length leaves no room for the
    ``steps`` timed around it (llama-3-8b's 8,192 positions hold a mean
    context of 8,172 for 32 steps); duplicates dropped."""
    top = max_model_len - steps // 2 - 4
    return sorted({min(c, top) for c in contexts if min(c, top) >= 1})


def clamp_prompts(prompts: tuple[int, ...] | list[int], max_model_len: int) -> list[int]:
    """Each prompt length, lowered to leave room for its one new token."""
    return sorted({min(p, max_model_len - 1) for p in prompts if min(p, max_model_len - 1) >= 1})


def _scaled(counted_bytes: float, run: RunInfo) -> float:
    """Bytes counted for 16-bit elements, at the run's element size."""
    return counted_bytes * run.element_bytes / COUNTED_ELEMENT_BYTES


def compare_decode(model: ModelConfig, hardware: Hardware, inputs: PlanInputs,
                   constants: StepConstants, run: RunInfo | None,
                   measured: DecodeMeasurement | None, skipped: str | None = None
                   ) -> Comparison:
    """The decode point of ``inputs`` (batch, context): predicted, and
    beside it what was measured, if it was."""
    predicted = decode_step(model, inputs, hardware, constants).total_s * 1e3
    roofline = decode_cost(model, inputs).seconds_on(hardware) * 1e3
    base = Comparison("decode", inputs.batch, inputs.context, predicted, roofline,
                      skipped=skipped)
    if measured is None or run is None:
        return base
    step_s = measured.step.median / 1e3
    timed = dataclasses.replace(inputs, context=max(1, round(measured.mean_context_timed)))
    step_bytes = _scaled(decode_cost(model, timed).bytes, run)
    return dataclasses.replace(
        base, measured_ms=measured.step.median, measured=asdict(measured),
        error=predicted / measured.step.median - 1,
        mbu=mbu(step_bytes, step_s, run.copy_gb_s * 1e9),
        mfu=mfu(count_params(model).total, inputs.batch / step_s, run.matmul_tflop_s * 1e12))


def compare_prefill(model: ModelConfig, hardware: Hardware, inputs: PlanInputs,
                    constants: StepConstants, run: RunInfo | None,
                    measured: PrefillMeasurement | None, skipped: str | None = None
                    ) -> Comparison:
    """The prefill of ``inputs.prompt`` tokens: predicted TTFT, and measured."""
    predicted = prefill_time(model, inputs, hardware, constants).total_s * 1e3
    roofline = prefill_cost(model, inputs).seconds_on(hardware) * 1e3
    base = Comparison("prefill", 1, inputs.prompt, predicted, roofline, skipped=skipped)
    if measured is None or run is None:
        return base
    ttft_s = measured.ttft.median / 1e3
    return dataclasses.replace(
        base, measured_ms=measured.ttft.median, measured=asdict(measured),
        error=predicted / measured.ttft.median - 1,
        mbu=mbu(_scaled(prefill_cost(model, inputs).bytes, run), ttft_s, run.copy_gb_s * 1e9),
        mfu=mfu(count_params(model).total, inputs.prompt / ttft_s, run.matmul_tflop_s * 1e12))


def worst_errors(points: list[Comparison]) -> dict[str, float | None]:
    """The largest |error| of the measured decode and prefill points."""
    worst: dict[str, float | None] = {}
    for kind in ("decode", "prefill"):
        errors = [abs(p.error) for p in points if p.kind == kind and p.error is not None]
        worst[kind] = max(errors) if errors else None
    return worst
