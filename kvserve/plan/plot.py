"""``kvserve plan --plot``: the roofline and a batch sweep as one PNG.

Owns the drawing only; every number comes from ``planner.py``. matplotlib is
an optional extra (``kvserve[plot]``, docs/decisions/0002) imported here and
only when a plot is asked for, through the object API (no pyplot, no global
backend state).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from kvserve.config import ModelConfig
from kvserve.plan.planner import (
    Hardware,
    PlanInputs,
    compute_plan,
    decode_cost,
    prefill_cost,
)

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
                      inputs: PlanInputs, max_batch: int) -> None:
    batches = _sweep_batches(inputs.batch, max_batch)
    plans = [compute_plan(model, hardware, dataclasses.replace(inputs, batch=b))
             for b in batches]
    ax.plot(batches, [p.decode_ms_per_step for p in plans], "o-", color="tab:blue",
            label="ms per decode step")
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
               title: str) -> None:
    """Draw both panels and save them to ``path`` (format from its suffix)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    plan = compute_plan(model, hardware, inputs)
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    roofline_ax, sweep_ax = fig.subplots(1, 2)
    _draw_roofline(roofline_ax, model, hardware, inputs)
    _draw_batch_sweep(sweep_ax, model, hardware, inputs, plan.max_batch_at_context)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
