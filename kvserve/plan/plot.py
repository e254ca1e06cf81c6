"""``kvserve plan --plot``: the roofline and a batch sweep as one PNG, or with
``--measure --sweep`` the sweep's predictions against its measurements.

Owns the drawing only; every number comes from ``planner.py`` or the
comparison records of ``compare.py``. matplotlib is an optional extra
(``kvserve[plot]``, docs/decisions/0002) imported here and only when a plot
is asked for, through the object API (no pyplot, no global backend state).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

from kvserve.config import ModelConfig
from kvserve.plan.compare import Comparison
from kvserve.plan.counts import Hardware, PlanInputs, decode_cost, prefill_cost
from kvserve.plan.planner import compute_plan
from kvserve.plan.step_model import StepConstants

MAX_SWEEP_BATCH = 4096


class MissingMatplotlibError(RuntimeError):
    """--plot was asked for but matplotlib is not installed."""


def require_matplotlib() -> None:
    """Fail early, before any output, when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingMatplotlibError(
            "--plot needs matplotlib, which is not installed: "
            "pip install matplotlib  (or pip install 'kvserve[plot]')"
        )


def _sweep_batches(batch: int, max_batch: int) -> list[int]:
    """Powers of two up past both the planned batch and the memory limit."""
    top = min(MAX_SWEEP_BATCH, 1 << (max(2 * batch, max_batch, 2) - 1).bit_length())
    batches = {1 << i for i in range(top.bit_length())}
    batches.add(batch)
    return sorted(batches)


def _draw_roofline(ax: Any, model: ModelConfig, hardware: Hardware, inputs: PlanInputs) -> None:
    decode = decode_cost(model, inputs)
    prefill = prefill_cost(model, inputs)
    points = [
        (f"decode (batch {inputs.batch})", decode, "tab:blue"),
        (f"prefill ({inputs.prompt} tokens)", prefill, "tab:red"),
    ]
    ridge = hardware.flops_s / hardware.bandwidth_bytes_s
    intensities = [cost.intensity for _, cost, _ in points] + [ridge]
    low, high = min(intensities) / 10, max(intensities) * 10
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    ax.loglog(xs, [min(hardware.flops_s, hardware.bandwidth_bytes_s * x) / 1e12 for x in xs],
              color="black", label=f"{hardware.name} roofline")
    ax.axvline(ridge, color="gray", linestyle=":", label=f"ridge {ridge:.0f} FLOP/B")
    for label, cost, color in points:
        achieved = cost.flops / cost.seconds_on(hardware) / 1e12
        ax.plot([cost.intensity], [achieved], "o", color=color,
                label=f"{label}: {cost.intensity:.1f} FLOP/B")
    ax.set_xlabel("arithmetic intensity (FLOP per byte)")
    ax.set_ylabel("attainable TFLOP/s (per GPU)")
    ax.set_title("roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def _draw_batch_sweep(ax: Any, model: ModelConfig, hardware: Hardware,
                      inputs: PlanInputs, max_batch: int, constants: StepConstants | None
                      ) -> None:
    batches = _sweep_batches(inputs.batch, max_batch)
    plans = [compute_plan(model, hardware, dataclasses.replace(inputs, batch=b), constants)
             for b in batches]
    ax.plot(batches, [p.decode_ms_per_step for p in plans], "o-", color="tab:blue",
            label="ms per decode step (predicted)")
    ax.plot(batches, [p.roofline_decode_ms_per_step for p in plans], ":", color="tab:blue",
            label="roofline bound")
    ax.set_xscale("log", base=2)
    ticks = [b for b in batches if b & (b - 1) == 0]
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel(f"batch size (context {inputs.context} tokens)")
    ax.set_ylabel("ms per decode step", color="tab:blue")
    throughput_ax = ax.twinx()
    throughput_ax.plot(batches, [p.decode_tokens_per_s for p in plans], "s-",
                       color="tab:green", label="tokens/s (all requests)")
    throughput_ax.set_ylabel("decode tokens/s (all requests)", color="tab:green")
    if 0 < max_batch <= batches[-1]:
        ax.axvline(max_batch, color="tab:red", linestyle="--",
                   label=f"memory limit: batch {max_batch}")
    ax.axvline(inputs.batch, color="gray", linestyle=":", label=f"planned batch {inputs.batch}")
    ax.set_title("decode latency and throughput against batch")
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = throughput_ax.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, fontsize="small", loc="upper left")


def write_plot(path: str, model: ModelConfig, hardware: Hardware, inputs: PlanInputs,
               title: str, constants: StepConstants | None = None) -> None:
    """Draw both panels and save them to ``path`` (format from its suffix)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    plan = compute_plan(model, hardware, inputs, constants)
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    roofline_ax, sweep_ax = fig.subplots(1, 2)
    _draw_roofline(roofline_ax, model, hardware, inputs)
    _draw_batch_sweep(sweep_ax, model, hardware, inputs, plan.max_batch_at_context, constants)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _measured(points: list[Comparison]) -> list[Comparison]:
    return [p for p in points if p.measured is not None and p.measured_ms is not None]


def _spread(point: Comparison) -> tuple[float, float]:
    """(below, above) the median: the p10-p90 error bar of a measured point."""
    assert point.measured is not None and point.measured_ms is not None
    spread = point.measured["step" if point.kind == "decode" else "ttft"]
    return point.measured_ms - spread["p10"], spread["p90"] - point.measured_ms


def _draw_curve(ax: Any, row: list[Comparison], x: Callable[[Comparison], int], color: str,
                what: str) -> None:
    """A predicted curve (dashed) and its measured points with p10-p90 bars."""
    ax.plot([x(p) for p in row], [p.predicted_ms for p in row], "--", color=color,
            label=f"predicted{what}")
    done = _measured(row)
    if done:
        below, above = zip(*(_spread(p) for p in done))
        ax.errorbar([x(p) for p in done], [p.measured_ms for p in done], yerr=[below, above],
                    fmt="o", color=color, label=f"measured (p10-p90){what}")


def _label_axes(ax: Any, xlabel: str, ylabel: str, title: str, xbase: int = 10) -> None:
    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small")


def _draw_decode(ax: Any, points: list[Comparison]) -> None:
    decode = [p for p in points if p.kind == "decode"]
    for i, context in enumerate(sorted({p.context for p in decode})):
        row = sorted((p for p in decode if p.context == context), key=lambda p: p.batch)
        _draw_curve(ax, row, lambda p: p.batch, f"C{i}", f", context {context:,}")
    _label_axes(ax, "batch", "ms per decode step", "decode step", xbase=2)


def _draw_prefill(ax: Any, points: list[Comparison]) -> None:
    prefill = sorted((p for p in points if p.kind == "prefill"), key=lambda p: p.context)
    _draw_curve(ax, prefill, lambda p: p.context, "tab:red", "")
    _label_axes(ax, "prompt tokens", "ms to first token", "prefill", xbase=2)


def _draw_agreement(ax: Any, points: list[Comparison]) -> None:
    done = _measured(points)
    for kind, color, band in (("decode", "tab:blue", 0.10), ("prefill", "tab:red", 0.15)):
        mine = [p for p in done if p.kind == kind]
        if mine:
            ax.scatter([p.measured_ms for p in mine], [p.predicted_ms for p in mine], color=color,
                       label=f"{kind} (target within {band:.0%})")
    values = [v for p in done for v in (p.measured_ms, p.predicted_ms) if v]
    if values:
        low, high = min(values) / 1.5, max(values) * 1.5
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        ax.fill_between([low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1],
                        color="gray", alpha=0.2, label="±10%")
    _label_axes(ax, "measured ms", "predicted ms", "predicted against measured")


def _draw_utilization(ax: Any, points: list[Comparison]) -> None:
    done = _measured(points)
    labels = [f"d {p.batch}x{p.context}" if p.kind == "decode" else f"p {p.context}"
              for p in done]
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], [100 * (p.mbu or 0) for p in done], width=0.4,
           color="tab:blue", label="MBU % of copy")
    ax.bar([x + 0.2 for x in xs], [100 * (p.mfu or 0) for p in done], width=0.4,
           color="tab:green", label="MFU % of matmul")
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=60, fontsize="x-small")
    ax.set_ylabel("% of the rate measured in the run")
    ax.set_title("MBU and MFU per point")
    ax.legend(fontsize="x-small")


def write_sweep_plot(path: str, points: list[Comparison], title: str) -> None:
    """A measured sweep: decode and prefill against their predictions, the
    agreement of every point, and each point's MBU and MFU."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 10), layout="constrained")
    (decode_ax, prefill_ax), (agreement_ax, utilization_ax) = fig.subplots(2, 2)
    _draw_decode(decode_ax, points)
    _draw_prefill(prefill_ax, points)
    _draw_agreement(agreement_ax, points)
    _draw_utilization(utilization_ax, points)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
