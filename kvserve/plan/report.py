"""The text of ``kvserve plan``: the plan's table, predicted beside measured,
and a fit's result. Strings only (the command prints them); no I/O."""

from __future__ import annotations

from kvserve.config import ModelConfig
from kvserve.plan.compare import Comparison, RunInfo, worst_errors
from kvserve.plan.counts import Hardware, PlanInputs, prefill_cost
from kvserve.plan.fit import FitResult, constants_literal
from kvserve.plan.gpus import GpuSpec
from kvserve.plan.planner import Plan

# issue 29's bars: every decode point within 10% of measured, every prefill within 15%
DECODE_TARGET = 0.10
PREFILL_TARGET = 0.15
SPEC_UPPER_BOUND_NOTE = ("upper bound: k*alpha + 1 counts every draft token at alpha, "
                         "as if a rejection did not end the run")


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _size_rows(plan: Plan, model: ModelConfig, hardware: Hardware,
               inputs: PlanInputs) -> list[tuple[str, str, str]]:
    usable = hardware.memory_bytes * inputs.memory_utilization
    used = plan.weight_bytes + plan.kv_bytes_total
    max_pos = model.max_position_embeddings
    beyond = f"; model max_position_embeddings is {max_pos:,}"
    return [
        ("params", f"{plan.params / 1e9:.2f} B", f"{plan.params:,}"),
        ("weight_bytes", _bytes(plan.weight_bytes), f"{plan.weight_bytes:,} B"),
        ("kv_bytes_per_token", _bytes(plan.kv_bytes_per_token), f"{plan.kv_bytes_per_token:,} B"),
        ("kv_bytes_per_request", _bytes(plan.kv_bytes_per_request),
         f"{plan.kv_bytes_per_request:,} B at context {inputs.context:,}"
         + (beyond if inputs.context > max_pos else "")),
        ("kv_bytes_total", _bytes(plan.kv_bytes_total),
         f"{plan.kv_bytes_total:,} B at batch {inputs.batch:,}"),
        ("fits", "yes" if plan.fits else "NO",
         f"weights + KV {_bytes(used)} of usable {_bytes(usable)} "
         f"({inputs.memory_utilization:.0%} of {_bytes(hardware.memory_bytes)})"),
        ("max_batch_at_context", f"{plan.max_batch_at_context:,}",
         f"at context {inputs.context:,}"),
        ("max_context_at_batch", f"{plan.max_context_at_batch:,}",
         f"at batch {inputs.batch:,}"
         + (beyond if plan.max_context_at_batch > max_pos else "")),
        ("kv_tokens_gpu", f"{plan.kv_tokens_gpu:,}", "tokens of KV the GPU's free memory holds"),
        ("kv_tokens_host", f"{plan.kv_tokens_host:,}",
         f"more in the host tier (--kv-offload-gb {inputs.kv_offload_gb:g}, per GPU): "
         f"{plan.kv_tokens_gpu + plan.kv_tokens_host:,} cached in all"),
    ]


def _time_rows(plan: Plan, model: ModelConfig, hardware: Hardware,
               inputs: PlanInputs) -> list[tuple[str, str, str]]:
    parts = plan.decode_breakdown_ms
    prefill_parts = plan.prefill_breakdown_ms
    prefill_bound = prefill_cost(model, inputs).bound_on(hardware)
    return [
        ("decode_ms_per_step", f"{plan.decode_ms_per_step:.3f}",
         "predicted: kvserve on this card (step model)"),
        ("  device parts", "", f"GEMMs {parts['gemm']:.3f}, attention {parts['attention']:.3f}, "
                               f"elementwise {parts['elementwise']:.3f}, fixed "
                               f"{parts['fixed']:.3f}; host {parts['host']:.3f} (overlapped)"),
        ("decode_tokens_per_s", f"{plan.decode_tokens_per_s:,.1f}", "all requests"),
        ("decode_tokens_per_s_per_request", f"{plan.decode_tokens_per_s_per_request:,.1f}", ""),
        ("prefill_ms", f"{plan.prefill_ms:.2f}",
         f"predicted time to first token of {inputs.prompt:,} prompt tokens"),
        ("  prefill parts", "", f"GEMMs {prefill_parts['gemm']:.2f}, attention "
                                f"{prefill_parts['attention']:.2f}, elementwise "
                                f"{prefill_parts['elementwise']:.2f}, fixed "
                                f"{prefill_parts['fixed']:.2f}"),
        ("e2e_ms", f"{plan.e2e_ms:,.1f}", f"prefill + {inputs.output:,} x decode step"),
        ("roofline_decode_ms_per_step", f"{plan.roofline_decode_ms_per_step:.3f}",
         "bound at the spec sheet's peaks"),
        ("roofline_prefill_ms", f"{plan.roofline_prefill_ms:.2f}", f"{prefill_bound}-bound"),
        ("arithmetic_intensity_decode", f"{plan.arithmetic_intensity_decode:.1f}", "FLOP/byte"),
        ("ridge_point", f"{plan.ridge_point:.1f}", "FLOP/byte"),
        ("bound", plan.bound, "decode"),
    ]


def _spec_rows(plan: Plan, inputs: PlanInputs) -> list[tuple[str, str, str]]:
    if plan.spec_tokens_per_step is None or plan.spec_speedup is None:
        return []
    return [
        ("spec_tokens_per_step", f"<= {plan.spec_tokens_per_step:.2f}",
         f"k {inputs.spec_k}, alpha {inputs.spec_alpha}; {SPEC_UPPER_BOUND_NOTE}"),
        ("spec_speedup", f"<= {plan.spec_speedup:.2f}x",
         f"cost ratio {inputs.spec_cost_ratio}; upper bound"),
        ("spec_tokens_per_step_iid", f"{plan.spec_tokens_per_step_iid:.2f}",
         "expected when acceptance stops at the first rejection (i.i.d. alpha)"),
        ("spec_speedup_iid", f"{plan.spec_speedup_iid:.2f}x", "the same, as a speed-up"),
    ]


def format_table(plan: Plan, model: ModelConfig, gpu: GpuSpec, hardware: Hardware,
                 inputs: PlanInputs, model_name: str) -> str:
    """The plan as aligned plain-text columns under a header of the inputs."""
    header = [
        f"kvserve plan: {model_name} on {gpu.name} ({gpu.description}), tp {inputs.tp}",
        f"  weights {inputs.weights}, KV cache {inputs.kv_dtype}; spec sheet "
        f"{hardware.bandwidth_bytes_s / 1e9:,.0f} GB/s, {hardware.flops_s / 1e12:,.1f} TFLOP/s, "
        f"{_bytes(hardware.memory_bytes)} per GPU",
        f"  predicted at copy {plan.copy_gb_s:,.0f} GB/s, matmul {plan.matmul_tflop_s:,.0f} "
        f"TFLOP/s: {plan.rates_source}",
        f"  step model constants: {plan.constants_source}",
        f"  batch {inputs.batch:,}, context {inputs.context:,}, prompt {inputs.prompt:,}, "
        f"output {inputs.output:,}; byte figures are per GPU, GB = 1e9 bytes",
        "",
    ]
    rows = (_size_rows(plan, model, hardware, inputs) + _time_rows(plan, model, hardware, inputs)
            + _spec_rows(plan, inputs))
    label_width = max(len(label) for label, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"  {label:<{label_width}}  {value:>{value_width}}  {note}".rstrip()
             for label, value, note in rows]
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(header + lines)


def _percent(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{100 * value:+.1f}%" if signed else f"{100 * value:.1f}%"


def _comparison_row(point: Comparison) -> str:
    size = f"{point.batch:,} | {point.context:,}"
    if point.measured is None or point.measured_ms is None:
        reason = point.skipped or "not measured"
        return (f"| {point.kind} | {size} | {point.predicted_ms:.2f} | "
                f"{point.roofline_ms:.2f} | — | — | {reason} | — | — |")
    spread = point.measured["step" if point.kind == "decode" else "ttft"]
    if point.kind == "decode":
        timed = (f"batch {point.measured['batch_timed_min']}"
                 + ("" if point.measured["batch_timed_min"] == point.measured["batch_timed_max"]
                    else f"-{point.measured['batch_timed_max']}")
                 + f", context {point.measured['mean_context_timed']:,.1f}")
    else:
        timed = f"prompt {point.measured['prompt']:,}"
    return (f"| {point.kind} | {size} | {point.predicted_ms:.2f} | {point.roofline_ms:.2f} | "
            f"{point.measured_ms:.2f} ({spread['p10']:.2f}-{spread['p90']:.2f}) | "
            f"{_percent(point.error, signed=True)} | {timed} | {_percent(point.mbu)} | "
            f"{_percent(point.mfu)} |")


def format_comparisons(points: list[Comparison], run: RunInfo) -> str:
    """Predicted beside measured as a Markdown table, ready for docs/plan.md."""
    lines = [
        f"\nmeasured on {run.card} ({run.device}, {run.dtype}): copy {run.copy_gb_s:,.0f} GB/s, "
        f"matmul {run.matmul_tflop_s:,.1f} TFLOP/s; {run.steps} decode steps per point, "
        f"{run.repeats} prefills per prompt; KV pool {run.kv_capacity_tokens:,} tokens",
        "",
        "| kind | batch | context / prompt | predicted ms | roofline ms | measured ms "
        "(p10-p90) | error | timed | MBU | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_comparison_row(p) for p in points]
    worst = worst_errors(points)
    lines.append("")
    lines.append(f"worst |error|: decode {_percent(worst['decode'])} (target "
                 f"{DECODE_TARGET:.0%}), prefill {_percent(worst['prefill'])} (target "
                 f"{PREFILL_TARGET:.0%}); error = predicted / measured - 1; MBU of the copy "
                 "rate and MFU of the matmul rate measured in this run")
    return "\n".join(lines)


def format_fit(result: FitResult, gpu_name: str) -> str:
    """A fit's constants as a ``STEP_CONSTANTS`` entry, and the errors left."""
    lines = [f"worst |error| with the constants given: {result.worst_before:.1%}; "
             f"fitted: {result.worst_after:.1%} (sum of squared log errors "
             f"{result.cost_before:.4f} -> {result.cost_after:.4f})", ""]
    lines += [f"  {kind:<8} batch {batch:>4}  {'context' if kind == 'decode' else 'prompt '} "
              f"{size:>6}  {error:+.1%}" for kind, batch, size, error in result.errors]
    lines += ["", "# paste into STEP_CONSTANTS in kvserve/plan/step_model.py:",
              constants_literal(gpu_name, result.constants)]
    return "\n".join(lines)
