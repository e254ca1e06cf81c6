"""The ``kvserve plan`` command: flags, model loading, measuring, output.

Owns the user-facing side of the planner: parsing and checking flags (every
error names its flag and exits 2), resolving the model (preset or
``config.json``) and the card's rates (the GPU table, or this machine's
``--calibrate``), printing tables and JSON, and, with ``--measure`` /
``--sweep``, running the engine on the plan's shapes (``plan_measure``).
It lives in ``bench/`` because it drives the engine: ``plan/`` stays pure
arithmetic (DESIGN.md section 1). ``kvserve/cli.py`` mounts it with
``add_plan_parser``; building the parser imports neither torch nor the
engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig
from kvserve.plan.compare import (
    SWEEP_BATCHES,
    SWEEP_CONTEXTS,
    SWEEP_PROMPTS,
    Comparison,
    RunInfo,
    clamp_contexts,
    clamp_prompts,
    compare_decode,
    compare_prefill,
    worst_errors,
)
from kvserve.plan.counts import (
    DEFAULT_MEMORY_UTILIZATION,
    KV_DTYPE_BYTES,
    WEIGHT_DTYPE_BYTES,
    Hardware,
    PlanError,
    PlanInputs,
    check_tp,
)
from kvserve.plan.gpus import GPUS, GpuSpec, get_gpu
from kvserve.plan.planner import compute_plan
from kvserve.plan.plot import MissingMatplotlibError, require_matplotlib
from kvserve.plan.report import SPEC_UPPER_BOUND_NOTE, format_comparisons, format_table
from kvserve.plan.step_model import CONSTANT_NAMES, StepConstants, constants_for

DESCRIPTION = """\
KV-cache size, what fits, and kvserve's decode step, prefill and throughput
predicted for a model on a GPU, from the model's architecture and the card's
measured copy and matmul rates (docs/plan.md). Byte figures are per GPU
(weights and KV split --tp ways); GB are decimal (1e9 bytes).

  KV bytes      = 2 x layers x KV heads x head_dim x tokens x bytes/element
  decode step   = GEMMs + attention + elementwise + fixed (step model), and
                  the roofline bound max((weights + KV) / bandwidth, FLOPs / compute)
  prefill       = the same parts for one prompt, chunked as the engine does
  speculative   = at most k*alpha + 1 tokens per step (an upper bound), speed-up at
                  most (k*alpha + 1) / (1 + k*r); the i.i.d. expectation is printed beside

--measure runs the engine (random weights) on the same shapes and prints
predicted beside measured; --sweep does it over batch x context and prompt
lengths; --calibrate measures this machine's card once and caches it.
"""
MEASURABLE_WEIGHTS = {"bf16": None, "fp16": None, "int8": "int8", "int4": "int4", "fp8": "fp8"}


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
    parser.add_argument("--model", metavar="PATH_OR_PRESET",
                        help="a directory with config.json, or a built-in preset name such as "
                             "llama-3-8b (an unknown name lists them all); required unless "
                             "--calibrate or --fit")
    parser.add_argument("--gpu", help=f"GPU from the table: {', '.join(GPUS)}; or 'local' for "
                                      "the card --calibrate measured on this machine")
    parser.add_argument("--tp", type=_number(int, 1), default=1,
                        help="tensor-parallel GPUs; refused when the model's heads, KV heads "
                             "or MLP cannot be split that many ways")
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
                        help="KV-cache dtype (default bf16; int8 counts kvserve's float32 "
                             "scale per token and KV head; --measure runs fp8 and int8 as "
                             "--kv-cache-dtype fp8_e4m3 / int8)")
    parser.add_argument("--kv-offload-gb", type=float, default=0.0,
                        help="host memory for the KV tier, GB over all GPUs (default 0: none); "
                             "counted in the tokens the prefix cache holds")
    spec = parser.add_argument_group(
        "speculative decoding (give all three; the figures are upper bounds: "
        + SPEC_UPPER_BOUND_NOTE.removeprefix("upper bound: ") + ")")
    spec.add_argument("--spec-k", type=_number(int, 1), help="draft tokens per step")
    spec.add_argument("--spec-alpha", type=_number(float, 0.0, high=1.0),
                      help="acceptance rate of one draft token, in [0, 1]")
    spec.add_argument("--spec-cost-ratio", type=_number(float, 0.0),
                      help="cost of one draft token / one target step")
    hw = parser.add_argument_group("hardware overrides")
    hw.add_argument("--bandwidth", type=_number(float, 0.0, low_ok=False), metavar="GB/s",
                    help="memory bandwidth instead of the table's (the roofline's peak and "
                         "the rate the step model predicts at)")
    hw.add_argument("--flops", type=_number(float, 0.0, low_ok=False), metavar="TFLOP/s",
                    help="compute instead of the table's (both too; used for every --weights)")
    hw.add_argument("--memory", type=_number(float, 0.0, low_ok=False), metavar="GB",
                    help="GPU memory instead of the table's")
    parser.add_argument("--json", action="store_true", help="print a JSON object, not a table")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the roofline and a batch sweep, or with --sweep predicted "
                             "against measured (needs matplotlib)")
    _configure_measure(parser)


def _configure_measure(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("measuring (runs the engine with random weights)")
    group.add_argument("--measure", action="store_true",
                       help="run the engine on the same shapes and print predicted beside "
                            "measured: the decode step of --batch requests at --context, "
                            "the TTFT of --prompt, each with its spread")
    group.add_argument("--sweep", action="store_true",
                       help="every batch x context of --sweep-batches / --sweep-contexts and "
                            "every --sweep-prompts prefill (with --measure: measured too)")
    group.add_argument("--sweep-batches", type=_number(int, 1), nargs="+",
                       default=list(SWEEP_BATCHES), metavar="B",
                       help="decode batch sizes of --sweep "
                            f"(default {' '.join(map(str, SWEEP_BATCHES))})")
    group.add_argument("--sweep-contexts", type=_number(int, 1), nargs="+",
                       default=list(SWEEP_CONTEXTS), metavar="S",
                       help="decode contexts in tokens of --sweep "
                            f"(default {' '.join(map(str, SWEEP_CONTEXTS))})")
    group.add_argument("--sweep-prompts", type=_number(int, 1), nargs="+",
                       default=list(SWEEP_PROMPTS), metavar="P",
                       help="prefill prompt lengths of --sweep "
                            f"(default {' '.join(map(str, SWEEP_PROMPTS))})")
    group.add_argument("--measure-steps", type=_number(int, 2), default=32,
                       help="decode steps timed per point (default 32)")
    group.add_argument("--measure-repeats", type=_number(int, 1), default=5,
                       help="timed prefills per prompt length (default 5)")
    group.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="where --measure and --calibrate run (default: CUDA if present)")
    group.add_argument("--calibrate", action="store_true",
                       help="measure this machine's card (copy, bf16 and FP8 matmul rates, "
                            "memory) and cache it; later plans for that card use it")
    group.add_argument("--output-json", metavar="FILE",
                       help="with --measure: also write the JSON (with the date, versions "
                            "and commit) to FILE")
    group.add_argument("--fit", metavar="SWEEP.json",
                       help="fit the step model's constants to a --measure --sweep --json "
                            "result and print them")
    group.add_argument("--constants", metavar="FIT.json",
                       help="predict with the constants of a --fit --json result instead of "
                            "the card's (to check a fit on another model or shape)")


def add_plan_parser(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "plan", help="KV-cache, roofline and predicted step times for a model on a GPU",
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


def _resolve_gpu(name: str, weights: str) -> tuple[GpuSpec, dict[str, Any]]:
    """The GPU's table entry and the calibrated rates to use for it, if any."""
    from kvserve.bench.calibration import find

    calibration = find(name if name == "local" else _table_name(name))
    if name == "local":
        if calibration is None:
            raise PlanError("--gpu", "'local' needs a calibration of this machine's card: run "
                                     "kvserve plan --calibrate first")
        gpu = calibration.as_gpu()
    else:
        gpu = _table_gpu(name)
        if calibration is None:
            return gpu, {}
    matmul = calibration.matmul_tflop_s * gpu.tflops_for(weights) / gpu.bf16_tflops
    if weights == "fp8" and calibration.fp8_tflop_s is not None:
        matmul = calibration.fp8_tflop_s
    return gpu, {"copy_gb_s": calibration.copy_gb_s, "matmul_tflop_s": matmul,
                 "rates_source": calibration.source}


def _table_gpu(name: str) -> GpuSpec:
    try:
        return get_gpu(name)
    except ValueError as e:
        raise PlanError("--gpu", f"{e}; or 'local' after --calibrate") from e


def _table_name(name: str) -> str:
    return _table_gpu(name).name


@dataclasses.dataclass(frozen=True)
class _Setup:
    model: ModelConfig
    gpu: GpuSpec
    hardware: Hardware
    inputs: PlanInputs
    constants: StepConstants


def _build(args: argparse.Namespace) -> _Setup:
    """Check and resolve every input; raises PlanError naming the flag."""
    if args.model is None:
        raise PlanError("--model", "required (a preset name or a directory with config.json)")
    if args.gpu is None:
        raise PlanError("--gpu", f"required: one of {', '.join(GPUS)}, or 'local'")
    model = load_model(args.model)
    gpu, calibrated = _resolve_gpu(args.gpu, args.weights)
    context = args.context if args.context is not None else args.prompt + args.output
    inputs = PlanInputs(
        tp=args.tp, batch=args.batch, context=context, prompt=args.prompt, output=args.output,
        weights=args.weights, kv_dtype=args.kv_dtype, spec_k=args.spec_k,
        spec_alpha=args.spec_alpha, spec_cost_ratio=args.spec_cost_ratio,
        memory_utilization=DEFAULT_MEMORY_UTILIZATION, kv_offload_gb=args.kv_offload_gb,
    )
    check_tp(model, inputs.tp)
    hardware = Hardware.from_gpu(gpu, args.weights, args.bandwidth, args.flops, args.memory,
                                 **calibrated)
    constants = (_load_constants(args.constants) if args.constants
                 else constants_for(gpu.name))
    return _Setup(model, gpu, hardware, inputs, constants)


def _load_constants(path: str) -> StepConstants:
    """The constants of a ``--fit --json`` result."""
    try:
        data = json.loads(Path(path).read_text())
        return StepConstants(**{name: float(data["constants"][name])
                                for name in CONSTANT_NAMES},
                             source=f"{data['source']} (from {path})")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError("--constants", f"'{path}' is not the --json output of kvserve plan "
                                       f"--fit: {e}") from e


def _check_measurable(args: argparse.Namespace, inputs: PlanInputs) -> None:
    """Raise PlanError naming the flag when this build cannot measure the plan."""
    if inputs.tp != 1:
        raise PlanError("--tp", f"--measure runs on one GPU; got --tp {inputs.tp} (tensor "
                                "parallelism is measured once it lands)")
    if inputs.weights not in MEASURABLE_WEIGHTS:
        raise PlanError("--weights", f"--measure runs {', '.join(MEASURABLE_WEIGHTS)} weights; "
                                     f"got {inputs.weights}")
    if args.plot and not args.sweep:
        raise PlanError("--plot", "with --measure, --plot draws a --sweep; add --sweep")


def _check_output_paths(args: argparse.Namespace) -> None:
    if args.plot:
        require_matplotlib()
        if not Path(args.plot).resolve().parent.is_dir():
            raise PlanError("--plot", f"directory of '{args.plot}' does not exist")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``kvserve plan`` on parsed flags; returns the exit code."""
    from kvserve.bench.plan_runs import run_calibrate, run_fit, run_measure

    try:
        if args.calibrate:
            run_calibrate(args)
            if args.model is None:
                return 0
        if args.fit:
            return run_fit(args)
        setup = _build(args)
        if args.measure:
            _check_measurable(args, setup.inputs)
        _check_output_paths(args)
    except (PlanError, MissingMatplotlibError) as e:
        print(f"kvserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.measure:
        return run_measure(args, setup)
    return _print_plan(args, setup)


def echo_inputs(args: argparse.Namespace, setup: _Setup) -> dict[str, Any]:
    """Every input of the plan, the rates it used included (the JSON's ``inputs``)."""
    inputs, hardware = setup.inputs, setup.hardware
    return {
        "model": args.model, "gpu": setup.gpu.name, "tp": inputs.tp, "batch": inputs.batch,
        "context": inputs.context, "prompt": inputs.prompt, "output": inputs.output,
        "weights": inputs.weights, "kv_dtype": inputs.kv_dtype,
        "spec_k": inputs.spec_k, "spec_alpha": inputs.spec_alpha,
        "spec_cost_ratio": inputs.spec_cost_ratio,
        "bandwidth_gb_s": hardware.bandwidth_bytes_s / 1e9,
        "flops_tflop_s": hardware.flops_s / 1e12,
        "memory_gb": hardware.memory_bytes / 1e9,
        "memory_utilization": inputs.memory_utilization,
        "kv_offload_gb": inputs.kv_offload_gb,
        "constants": setup.constants.values(),
    }


def sweep_points(args: argparse.Namespace, setup: _Setup, max_model_len: int, steps: int,
                 ) -> tuple[list[PlanInputs], list[PlanInputs]]:
    """The decode and prefill points of this run: the sweep's grid, or the
    plan's own batch, context and prompt."""
    inputs = setup.inputs
    if not args.sweep:
        return [inputs], [inputs]
    contexts = clamp_contexts(args.sweep_contexts, max_model_len, steps)
    decodes = [dataclasses.replace(inputs, batch=b, context=c)
               for c in contexts for b in sorted(set(args.sweep_batches))]
    prefills = [dataclasses.replace(inputs, batch=1, prompt=p)
                for p in clamp_prompts(args.sweep_prompts, max_model_len)]
    return decodes, prefills


def predicted_points(setup: _Setup, decodes: list[PlanInputs], prefills: list[PlanInputs],
                     run: RunInfo | None = None,
                     measured: dict[tuple[str, int, int], Any] | None = None,
                     skipped: dict[tuple[str, int, int], str] | None = None
                     ) -> list[Comparison]:
    """Every point predicted, and beside it what was measured, if it was."""
    measured, skipped = measured or {}, skipped or {}
    points = []
    for d in decodes:
        key = ("decode", d.batch, d.context)
        points.append(compare_decode(setup.model, setup.hardware, d, setup.constants, run,
                                     measured.get(key), skipped.get(key)))
    for p in prefills:
        key = ("prefill", 1, p.prompt)
        points.append(compare_prefill(setup.model, setup.hardware, p, setup.constants, run,
                                      measured.get(key), skipped.get(key)))
    return points


def _print_plan(args: argparse.Namespace, setup: _Setup) -> int:
    plan = compute_plan(setup.model, setup.hardware, setup.inputs, setup.constants)
    points: list[Comparison] = []
    if args.sweep:
        decodes, prefills = sweep_points(args, setup, setup.model.max_position_embeddings,
                                         args.measure_steps)
        points = predicted_points(setup, decodes, prefills, skipped=_unfit(setup, decodes))
    if args.json:
        out: dict[str, Any] = {**plan.to_dict(), "inputs": echo_inputs(args, setup)}
        if args.sweep:
            out["sweep"] = [p.to_dict() for p in points]
        print(json.dumps(out, indent=2))
    else:
        print(format_table(plan, setup.model, setup.gpu, setup.hardware, setup.inputs,
                           args.model))
        if args.sweep:
            print(format_predicted(points))
    if args.plot:
        from kvserve.plan.plot import write_plot

        title = f"{args.model} on {setup.gpu.name} (tp {setup.inputs.tp}), " \
                f"weights {setup.inputs.weights}"
        write_plot(args.plot, setup.model, setup.hardware, setup.inputs, title, setup.constants)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _unfit(setup: _Setup, decodes: list[PlanInputs]) -> dict[tuple[str, int, int], str]:
    """The decode points whose weights and KV exceed the card's usable memory."""
    unfit = {}
    for d in decodes:
        plan = compute_plan(setup.model, setup.hardware, d, setup.constants)
        if not plan.fits:
            unfit[("decode", d.batch, d.context)] = (
                f"does not fit: weights + KV {(plan.weight_bytes + plan.kv_bytes_total) / 1e9:.1f}"
                f" GB > {setup.hardware.memory_bytes * d.memory_utilization / 1e9:.1f} GB usable")
    return unfit


def format_predicted(points: list[Comparison]) -> str:
    """The sweep's predictions alone (no --measure)."""
    lines = ["", "| kind | batch | context / prompt | predicted ms | roofline ms | |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {p.kind} | {p.batch:,} | {p.context:,} | {p.predicted_ms:.2f} | "
              f"{p.roofline_ms:.2f} | {p.skipped or ''} |" for p in points]
    return "\n".join(lines)


def measured_json(args: argparse.Namespace, setup: _Setup, points: list[Comparison],
                  run: RunInfo) -> dict[str, Any]:
    """The JSON of a --measure run: the plan, its inputs, the run and every point."""
    from kvserve.bench.report import environment

    plan = compute_plan(setup.model, setup.hardware, setup.inputs, setup.constants)
    return {**environment(), **plan.to_dict(), "inputs": echo_inputs(args, setup),
            "run": dataclasses.asdict(run), "measured": [p.to_dict() for p in points],
            "worst_error": worst_errors(points)}


def print_measured(args: argparse.Namespace, setup: _Setup, points: list[Comparison],
                   run: RunInfo) -> None:
    if args.json:
        print(json.dumps(measured_json(args, setup, points, run), indent=2))
        return
    plan = compute_plan(setup.model, setup.hardware, setup.inputs, setup.constants)
    print(format_table(plan, setup.model, setup.gpu, setup.hardware, setup.inputs, args.model))
    print(format_comparisons(points, run))


def main(argv: Sequence[str] | None = None) -> int:
    """``kvserve plan`` alone: the plan flags, parsed and run (tests call it)."""
    parser = argparse.ArgumentParser(
        prog="kvserve plan", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)
    return run_plan(parser.parse_args(argv))
