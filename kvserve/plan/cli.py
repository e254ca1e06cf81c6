"""The ``kvserve plan`` command: flags, model loading, table and JSON output.

Owns the user-facing side of the planner: parsing and checking flags (every
error names its flag and exits 2), reading the model's ``config.json`` or
preset, printing. The arithmetic lives in ``planner.py``, drawing in
``plot.py`` (imported only for ``--plot``). ``kvserve/cli.py`` mounts this
with ``add_plan_parser``; ``python -m kvserve.plan`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig
from kvserve.plan.gpus import GPUS, GpuSpec, get_gpu
from kvserve.plan.measure import Measurement, check_measurable, measure
from kvserve.plan.planner import (
    DEFAULT_MEMORY_UTILIZATION,
    KV_DTYPE_BYTES,
    WEIGHT_DTYPE_BYTES,
    Hardware,
    Plan,
    PlanError,
    PlanInputs,
    compute_plan,
    prefill_cost,
)
from kvserve.plan.plot import MissingMatplotlibError, require_matplotlib, write_plot

DESCRIPTION = """\
KV-cache size, what fits, and roofline TTFT / TPOT / throughput for a model on
a GPU, computed from the model's architecture. Byte figures are per GPU
(weights and KV split --tp ways); GB are decimal (1e9 bytes).

  KV bytes      = 2 x layers x KV heads x head_dim x tokens x bytes/element
  decode step   = max((weights + KV of the batch) / bandwidth, FLOPs / compute)
  prefill       = (2 x params x prompt + causal attention FLOPs) / compute
  speculative   = k*alpha + 1 tokens per step, speed-up (k*alpha + 1) / (1 + k*r)
"""


def _number(kind: Callable[[str], Any], low: float, low_ok: bool = True,
            high: float | None = None) -> Callable[[str], Any]:
    """An argparse type: ``kind`` parsed and range-checked (argparse names the flag)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got '{text}'"
            ) from None
        too_low = value < low if low_ok else value <= low
        if too_low or (high is not None and value > high):
            allowed = f"{'>=' if low_ok else '>'} {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value
    return parse


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` flags to ``parser``."""
    parser.add_argument("--model", required=True, metavar="PATH_OR_PRESET",
                        help="a directory with config.json, or a built-in preset name such as "
                             "llama-3-8b (an unknown name lists them all)")
    parser.add_argument("--gpu", required=True,
                        help=f"GPU from the table: {', '.join(GPUS)}")
    parser.add_argument("--tp", type=_number(int, 1), default=1, help="tensor-parallel GPUs")
    parser.add_argument("--batch", type=_number(int, 1), default=1,
                        help="concurrent requests (default 1)")
    parser.add_argument("--context", type=_number(int, 1), default=None,
                        help="tokens per request the decode step attends to "
                             "(default prompt + output)")
    parser.add_argument("--prompt", type=_number(int, 1), default=1024,
                        help="prompt tokens for prefill (default 1024)")
    parser.add_argument("--output", type=_number(int, 0), default=256,
                        help="output tokens for e2e (default 256)")
    parser.add_argument("--weights", choices=list(WEIGHT_DTYPE_BYTES), default="bf16",
                        help="weight dtype of the linear layers (default bf16)")
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPE_BYTES), default="bf16",
                        help="KV-cache dtype (default bf16)")
    spec = parser.add_argument_group("speculative decoding (give all three)")
    spec.add_argument("--spec-k", type=_number(int, 1), help="draft tokens per step")
    spec.add_argument("--spec-alpha", type=_number(float, 0.0, high=1.0),
                      help="acceptance rate of one draft token, in [0, 1]")
    spec.add_argument("--spec-cost-ratio", type=_number(float, 0.0),
                      help="cost of one draft token / one target step")
    hw = parser.add_argument_group("hardware overrides")
    hw.add_argument("--bandwidth", type=_number(float, 0.0, low_ok=False), metavar="GB/s",
                    help="memory bandwidth instead of the table's")
    hw.add_argument("--flops", type=_number(float, 0.0, low_ok=False), metavar="TFLOP/s",
                    help="peak compute instead of the table's (used for every --weights)")
    hw.add_argument("--memory", type=_number(float, 0.0, low_ok=False), metavar="GB",
                    help="GPU memory instead of the table's")
    parser.add_argument("--json", action="store_true", help="print a JSON object, not a table")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the roofline and a batch sweep (needs matplotlib)")
    parser.add_argument("--measure", action="store_true",
                        help="run the engine on the same shapes and compare (needs a CUDA GPU)")


def add_plan_parser(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "plan", help="KV-cache and roofline arithmetic for a model on a GPU",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)
    parser.set_defaults(func=run_plan)


def load_model(spec: str) -> ModelConfig:
    """A preset name or a checkpoint directory to a ModelConfig."""
    # imported here so building the parser stays instant
    from kvserve.models.source import resolve_model_config

    try:
        return resolve_model_config(spec)[0]
    except (ValueError, TypeError) as e:
        raise PlanError("--model", str(e)) from e


def _echo_inputs(args: argparse.Namespace, gpu: GpuSpec, hardware: Hardware,
                 inputs: PlanInputs) -> dict[str, Any]:
    return {
        "model": args.model, "gpu": gpu.name, "tp": inputs.tp, "batch": inputs.batch,
        "context": inputs.context, "prompt": inputs.prompt, "output": inputs.output,
        "weights": inputs.weights, "kv_dtype": inputs.kv_dtype,
        "spec_k": inputs.spec_k, "spec_alpha": inputs.spec_alpha,
        "spec_cost_ratio": inputs.spec_cost_ratio,
        "bandwidth_gb_s": hardware.bandwidth_bytes_s / 1e9,
        "flops_tflop_s": hardware.flops_s / 1e12,
        "memory_gb": hardware.memory_bytes / 1e9,
        "memory_utilization": inputs.memory_utilization,
    }


def _build(args: argparse.Namespace) -> tuple[ModelConfig, GpuSpec, Hardware, PlanInputs]:
    """Check and resolve every input; raises PlanError naming the flag."""
    try:
        gpu = get_gpu(args.gpu)
    except ValueError as e:
        raise PlanError("--gpu", str(e)) from e
    model = load_model(args.model)
    context = args.context if args.context is not None else args.prompt + args.output
    inputs = PlanInputs(
        tp=args.tp, batch=args.batch, context=context, prompt=args.prompt, output=args.output,
        weights=args.weights, kv_dtype=args.kv_dtype, spec_k=args.spec_k,
        spec_alpha=args.spec_alpha, spec_cost_ratio=args.spec_cost_ratio,
        memory_utilization=DEFAULT_MEMORY_UTILIZATION,
    )
    hardware = Hardware.from_gpu(gpu, args.weights, args.bandwidth, args.flops, args.memory)
    return model, gpu, hardware, inputs


def run_plan(args: argparse.Namespace) -> int:
    """Run ``kvserve plan`` on parsed flags; returns the exit code."""
    try:
        model, gpu, hardware, inputs = _build(args)
        if args.measure:
            check_measurable(inputs)
        if args.plot:
            require_matplotlib()
            if not Path(args.plot).resolve().parent.is_dir():
                raise PlanError("--plot", f"directory of '{args.plot}' does not exist")
    except (PlanError, MissingMatplotlibError) as e:
        print(f"kvserve plan: error: {e}", file=sys.stderr)
        return 2
    plan = compute_plan(model, hardware, inputs)
    measured = measure(args.model, inputs, plan) if args.measure else None
    if args.json:
        out = {**plan.to_dict(), "inputs": _echo_inputs(args, gpu, hardware, inputs)}
        if measured is not None:
            out["measured"] = measured.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(format_table(plan, model, gpu, hardware, inputs, args.model))
        if measured is not None:
            print(format_measurement(plan, measured))
    if args.plot:
        title = f"{args.model} on {gpu.name} (tp {inputs.tp}), weights {inputs.weights}"
        write_plot(args.plot, model, hardware, inputs, title)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table_rows(plan: Plan, model: ModelConfig, hardware: Hardware,
                inputs: PlanInputs) -> list[tuple[str, str, str]]:
    usable = hardware.memory_bytes * inputs.memory_utilization
    used = plan.weight_bytes + plan.kv_bytes_total
    max_pos = model.max_position_embeddings
    beyond = f"; model max_position_embeddings is {max_pos:,}"
    prefill_bound = prefill_cost(model, inputs).bound_on(hardware)
    rows = [
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
        ("decode_ms_per_step", f"{plan.decode_ms_per_step:.3f}", "time per output token"),
        ("decode_tokens_per_s", f"{plan.decode_tokens_per_s:,.1f}", "all requests"),
        ("decode_tokens_per_s_per_request", f"{plan.decode_tokens_per_s_per_request:,.1f}", ""),
        ("prefill_ms", f"{plan.prefill_ms:.2f}",
         f"{inputs.prompt:,} prompt tokens, {prefill_bound}-bound"),
        ("arithmetic_intensity_decode", f"{plan.arithmetic_intensity_decode:.1f}", "FLOP/byte"),
        ("ridge_point", f"{plan.ridge_point:.1f}", "FLOP/byte"),
        ("bound", plan.bound, "decode"),
        ("e2e_ms", f"{plan.e2e_ms:,.1f}", f"prefill + {inputs.output:,} x decode step"),
    ]
    if plan.spec_tokens_per_step is not None and plan.spec_speedup is not None:
        rows += [
            ("spec_tokens_per_step", f"{plan.spec_tokens_per_step:.2f}",
             f"k {inputs.spec_k}, alpha {inputs.spec_alpha}"),
            ("spec_speedup", f"{plan.spec_speedup:.2f}x", f"cost ratio {inputs.spec_cost_ratio}"),
        ]
    return rows


def format_table(plan: Plan, model: ModelConfig, gpu: GpuSpec, hardware: Hardware,
                 inputs: PlanInputs, model_name: str) -> str:
    """The plan as aligned plain-text columns under a header of the inputs."""
    header = [
        f"kvserve plan: {model_name} on {gpu.name} ({gpu.description}), tp {inputs.tp}",
        f"  weights {inputs.weights}, KV cache {inputs.kv_dtype}; "
        f"{hardware.bandwidth_bytes_s / 1e9:,.0f} GB/s, {hardware.flops_s / 1e12:,.1f} TFLOP/s, "
        f"{_bytes(hardware.memory_bytes)} per GPU",
        f"  batch {inputs.batch:,}, context {inputs.context:,}, prompt {inputs.prompt:,}, "
        f"output {inputs.output:,}; byte figures are per GPU, GB = 1e9 bytes",
        "",
    ]
    rows = _table_rows(plan, model, hardware, inputs)
    label_width = max(len(label) for label, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"  {label:<{label_width}}  {value:>{value_width}}  {note}".rstrip()
             for label, value, note in rows]
    return "\n".join(header + lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvserve.plan``: the plan flags alone."""
    parser = argparse.ArgumentParser(
        prog="kvserve plan", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)
    return run_plan(parser.parse_args(argv))


def format_measurement(plan: Plan, measured: Measurement) -> str:
    """Predicted beside measured, with MBU and MFU of the measured run."""
    rows = [
        ("decode ms / step", f"{plan.decode_ms_per_step:.2f}",
         f"{measured.decode_ms_per_step:.2f}"),
        ("decode tokens/s (all requests)", f"{plan.decode_tokens_per_s:.1f}",
         f"{measured.decode_tokens_per_s:.1f}"),
        ("prefill ms", f"{plan.prefill_ms:.2f}", f"{measured.prefill_ms:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"\nmeasured on {measured.card} (copy {measured.copy_gb_s:.0f} GB/s, "
             f"bf16 matmul {measured.matmul_tflop_s:.0f} TFLOP/s)",
             f"{'':<{width}}  {'predicted':>12}  {'measured':>12}  {'measured/predicted':>18}"]
    for name, predicted, got in rows:
        ratio = float(got) / float(predicted) if float(predicted) else float("nan")
        lines.append(f"{name:<{width}}  {predicted:>12}  {got:>12}  {ratio:>17.2f}x")
    lines.append(f"MBU {100 * measured.mbu:.1f}% of copy, MFU decode "
                 f"{100 * measured.mfu_decode:.2f}%, MFU prefill {100 * measured.mfu_prefill:.1f}%")
    return "\n".join(lines)
