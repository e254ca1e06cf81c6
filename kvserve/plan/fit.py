"""``kvserve plan --fit``: the step model's constants from a measured sweep.

Given the decode and prefill points of a ``--measure --sweep`` run on one
card (and the copy and matmul rates measured in it), find the
``StepConstants`` that make the step model's predictions closest to what
was measured: least squares of log(predicted / measured) over every point,
by Nelder–Mead over the free constants (each kept in its bounds). The
host's constants come first, by linear least squares of the host's busy
time per step against the batch, where the sweep measured it overlapped
(async scheduling, on CUDA). The result is printed as a table entry to
paste into ``step_model.STEP_CONSTANTS`` (docs/plan.md says how).

Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.config import ModelConfig
from kvserve.plan.counts import Hardware, PlanInputs
from kvserve.plan.step_model import StepConstants, decode_step, prefill_time

# (low, high) of every constant the fit may move; the others are held at their
# given values. Not fitted by default: attention_half_streams and
# attention_layer_us (the attention kernel benchmark measures them) and
# layer_us (one model's sweep cannot tell it from step_us).
BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_bandwidth_share": (0.3, 1.0),
    "gemm_batched_bandwidth_share": (0.3, 1.0),
    "gemm_compute_share": (0.3, 1.0),
    "gemm_overlap": (1.0, 8.0),
    "attention_bandwidth_share": (0.3, 1.0),
    "attention_request_us": (0.0, 5.0),
    "prefill_attention_share": (0.05, 1.0),
    "step_us": (0.0, 5000.0),
    "prefill_us": (0.0, 20000.0),
}
MAX_ITERATIONS = 4000


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode point: median wall ms per step, host busy ms per step."""

    batch: int
    context: int
    measured_ms: float
    host_busy_ms: float | None = None


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill: median TTFT in ms."""

    prompt: int
    measured_ms: float


@dataclass(frozen=True)
class FitResult:
    constants: StepConstants
    worst_before: float  # largest |predicted / measured - 1| with the given constants
    worst_after: float
    cost_before: float  # sum of log(predicted / measured)^2, the fit's objective
    cost_after: float
    errors: list[tuple[str, int, int, float]]  # (kind, batch, context or prompt, error)


def _predictions(model: ModelConfig, hardware: Hardware, base: PlanInputs, k: StepConstants,
                 decodes: list[DecodeSample], prefills: list[PrefillSample]
                 ) -> list[tuple[str, int, int, float, float]]:
    """(kind, batch, context or prompt, predicted ms, measured ms) per sample."""
    rows = []
    for d in decodes:
        inputs = dataclasses.replace(base, batch=d.batch, context=d.context)
        rows.append(("decode", d.batch, d.context,
                     decode_step(model, inputs, hardware, k).total_s * 1e3, d.measured_ms))
    for p in prefills:
        inputs = dataclasses.replace(base, batch=1, prompt=p.prompt)
        rows.append(("prefill", 1, p.prompt,
                     prefill_time(model, inputs, hardware, k).total_s * 1e3, p.measured_ms))
    return rows


def _fit_host(k: StepConstants, decodes: list[DecodeSample]) -> StepConstants:
    """host_step_us + host_request_us x batch through the host's busy times."""
    points = [(d.batch, d.host_busy_ms * 1e3) for d in decodes if d.host_busy_ms is not None]
    if len({b for b, _ in points}) < 2:
        return k
    mean_b = sum(b for b, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = (sum((b - mean_b) * (t - mean_t) for b, t in points)
             / sum((b - mean_b) ** 2 for b, _ in points))
    slope = max(slope, 0.0)
    return dataclasses.replace(k, host_request_us=slope,
                               host_step_us=max(mean_t - slope * mean_b, 0.0))


def _towards(centre: list[float], point: list[float], factor: float) -> list[float]:
    """centre + factor x (point - centre)."""
    return [c + factor * (x - c) for c, x in zip(centre, point)]


def nelder_mead(objective: Callable[[list[float]], float], start: list[float],
                steps: list[float], iterations: int = MAX_ITERATIONS) -> list[float]:
    """Minimise ``objective`` from ``start`` (simplex edges ``steps``)."""
    simplex = [list(start)]
    for i, step in enumerate(steps):
        point = list(start)
        point[i] += step
        simplex.append(point)
    values = [objective(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-12:
            break
        centroid = [sum(c) / (len(simplex) - 1) for c in zip(*simplex[:-1])]
        reflected = _towards(centroid, simplex[-1], -1.0)
        value = objective(reflected)
        if value < values[0]:
            expanded = _towards(centroid, simplex[-1], -2.0)
            expanded_value = objective(expanded)
            simplex[-1], values[-1] = ((expanded, expanded_value) if expanded_value < value
                                       else (reflected, value))
        elif value < values[-2]:
            simplex[-1], values[-1] = reflected, value
        else:
            contracted = _towards(centroid, simplex[-1], 0.5)
            contracted_value = objective(contracted)
            if contracted_value < values[-1]:
                simplex[-1], values[-1] = contracted, contracted_value
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p)]
                                    for p in simplex[1:]]
                values = [values[0]] + [objective(p) for p in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def fit_constants(model: ModelConfig, hardware: Hardware, base: PlanInputs,
                  start: StepConstants, decodes: list[DecodeSample],
                  prefills: list[PrefillSample], source: str,
                  names: tuple[str, ...] = tuple(BOUNDS)) -> FitResult:
    """The constants (``names`` free, within ``BOUNDS``) that fit the samples best."""
    if not decodes and not prefills:
        raise ValueError("nothing to fit: the sweep has no measured points")
    unknown = [n for n in names if n not in BOUNDS]
    if unknown:
        raise ValueError(f"cannot fit {unknown}; fittable: {', '.join(BOUNDS)}")
    given, start = start, _fit_host(start, decodes)

    def constants(x: list[float]) -> StepConstants:
        values: dict[str, Any] = {n: min(max(v, BOUNDS[n][0]), BOUNDS[n][1])
                                  for n, v in zip(names, x)}
        return dataclasses.replace(start, **values)

    def cost(k: StepConstants) -> float:
        rows = _predictions(model, hardware, base, k, decodes, prefills)
        return sum(math.log(pred / got) ** 2 for *_, pred, got in rows)

    x0 = [float(getattr(start, n)) for n in names]
    edges = [0.1 * (BOUNDS[n][1] - BOUNDS[n][0]) for n in names]
    best = nelder_mead(lambda x: cost(constants(x)), x0, edges)
    best = nelder_mead(lambda x: cost(constants(x)), best, [e / 4 for e in edges])
    # the host's regression can leave the search worse off than the constants given
    fitted = min(constants(best), given, key=cost)
    fitted = dataclasses.replace(fitted, source=source)

    def errors(k: StepConstants) -> list[tuple[str, int, int, float]]:
        return [(kind, b, c, pred / got - 1)
                for kind, b, c, pred, got in _predictions(model, hardware, base, k,
                                                          decodes, prefills)]

    before, after = errors(given), errors(fitted)
    return FitResult(fitted, max(abs(e[3]) for e in before), max(abs(e[3]) for e in after),
                     cost(given), cost(fitted), after)


def constants_literal(name: str, k: StepConstants) -> str:
    """``k`` as the Python entry of ``STEP_CONSTANTS`` for table name ``name``."""
    lines = [f'    "{name}": StepConstants(']
    for key, value in k.values().items():
        lines.append(f"        {key}={value:.4g},")
    lines.append(f"        source={k.source!r},")
    lines.append("    ),")
    return "\n".join(lines)
