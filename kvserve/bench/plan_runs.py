"""The heavy paths of ``kvserve plan``: ``--measure`` (and ``--sweep``),
``--calibrate`` and ``--fit``. ``plan_cli`` parses and checks the flags and
imports this module only when one of them is asked for, so a plain plan
never loads torch or the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.plan_cli import (
    MEASURABLE_WEIGHTS,
    load_model,
    measured_json,
    predicted_points,
    print_measured,
    sweep_points,
)
from kvserve.plan.compare import DecodeMeasurement, PrefillMeasurement
from kvserve.plan.counts import PLAN_KV_DTYPES, Hardware, PlanError, PlanInputs
from kvserve.plan.fit import DecodeSample, PrefillSample, fit_constants
from kvserve.plan.gpus import GPUS, GpuSpec, get_gpu
from kvserve.plan.report import format_fit
from kvserve.plan.step_model import CONSTANT_NAMES, StepConstants

if TYPE_CHECKING:
    from kvserve.bench.plan_cli import _Setup


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device", "cuda was asked for but no CUDA device is available; "
                                    "use --device cpu")
    return name


def run_calibrate(args: argparse.Namespace) -> None:
    """Measure this machine's card and cache it (``bench/calibration.py``)."""
    from kvserve.bench.calibration import cache_path, calibrate

    entry = calibrate(_device(args.device))
    fp8 = f", FP8 {entry.fp8_tflop_s:,.0f} TFLOP/s" if entry.fp8_tflop_s else ""
    print(f"calibrated {entry.card} ({entry.gpu or 'not in the GPU table: use --gpu local'}): "
          f"copy {entry.copy_gb_s:,.0f} GB/s, {entry.matmul_dtype} matmul "
          f"{entry.matmul_tflop_s:,.1f} TFLOP/s{fp8}, {entry.memory_gb:,.1f} GB; "
          f"saved in {cache_path()}", file=sys.stderr if args.json else sys.stdout)


def _engine_length(setup: _Setup, decodes: list[PlanInputs], prefills: list[PlanInputs],
                   steps: int) -> int:
    """The engine's max_model_len: room for every point (a decode point's
    requests reach ``decode_length``), within the model's."""
    from kvserve.bench.plan_measure import admission_steps, decode_length, prefill_chunk

    max_pos = setup.model.max_position_embeddings
    chunk = prefill_chunk(max((d.batch for d in decodes), default=1))
    lengths = []
    for d in decodes:
        length = decode_length(d.context, steps, admission_steps(d.batch, d.context, chunk))
        if length > max_pos:
            raise PlanError("--context", f"{d.context} leaves no room to time {steps} steps "
                                         f"within the model's max_position_embeddings "
                                         f"{max_pos:,}; use at most "
                                         f"{d.context - (length - max_pos):,}")
        lengths.append(length)
    for p in prefills:
        if p.prompt + 1 > max_pos:
            raise PlanError("--prompt", f"{p.prompt} tokens and one new one exceed the model's "
                                        f"max_position_embeddings {max_pos:,}")
    return max(lengths + [p.prompt + 1 for p in prefills])


def run_measure(args: argparse.Namespace, setup: _Setup) -> int:
    """``--measure`` (one point of each kind) or ``--measure --sweep``."""
    from kvserve.bench.plan_measure import MeasurementError, PlanMeasurer

    steps = args.measure_steps
    try:
        decodes, prefills = sweep_points(args, setup, setup.model.max_position_embeddings, steps)
        max_model_len = _engine_length(setup, decodes, prefills, steps)
        device = _device(args.device)
        dtype = ("float16" if setup.inputs.weights == "fp16" else "bfloat16") \
            if device == "cuda" else "auto"
        measurer = PlanMeasurer.start(
            args.model, device=device, dtype=dtype, max_batch=max(d.batch for d in decodes),
            max_model_len=max_model_len, steps=steps, repeats=args.measure_repeats,
            quantization=MEASURABLE_WEIGHTS[setup.inputs.weights],
            kv_cache_dtype={v: k for k, v in PLAN_KV_DTYPES.items()}.get(setup.inputs.kv_dtype,
                                                                         "auto"))
        run = measurer.run_info()
        measured: dict[tuple[str, int, int], DecodeMeasurement | PrefillMeasurement] = {}
        skipped: dict[tuple[str, int, int], str] = {}
        failed: dict[tuple[str, int, int], str] = {}
        for d in decodes:
            key = ("decode", d.batch, d.context)
            reason = measurer.decode_fits(d.batch, d.context)
            if reason is not None:
                skipped[key] = reason
                continue
            print(f"kvserve plan: timing decode at batch {d.batch}, context {d.context}",
                  file=sys.stderr)
            try:
                measured[key] = measurer.decode(d.batch, d.context)
            except MeasurementError as e:  # reported with the point; the sweep goes on
                skipped[key] = failed[key] = f"FAILED: {e}"
        for p in prefills:
            print(f"kvserve plan: timing the prefill of {p.prompt} tokens", file=sys.stderr)
            key = ("prefill", 1, p.prompt)
            try:
                measured[key] = measurer.prefill(p.prompt)
            except MeasurementError as e:
                skipped[key] = failed[key] = f"FAILED: {e}"
    except PlanError as e:
        print(f"kvserve plan: error: {e}", file=sys.stderr)
        return 2
    points = predicted_points(setup, decodes, prefills, run, measured, skipped)
    print_measured(args, setup, points, run)
    if args.plot:
        from kvserve.plan.plot import write_sweep_plot

        write_sweep_plot(args.plot, points, f"{args.model} on {run.card}: predicted "
                                            f"({setup.gpu.name}) against measured")
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    if args.output_json:
        from kvserve.bench.report import write_json

        write_json(args.output_json, measured_json(args, setup, points, run))
    for reason in failed.values():
        print(f"kvserve plan: measurement {reason}", file=sys.stderr)
    return 1 if failed else 0


def _fit_gpu(echo: dict[str, Any]) -> GpuSpec:
    if echo["gpu"] in GPUS:
        return get_gpu(echo["gpu"])
    return GpuSpec(echo["gpu"], "from the sweep's inputs", echo["memory_gb"],
                   echo["bandwidth_gb_s"], echo["flops_tflop_s"])


def run_fit(args: argparse.Namespace) -> int:
    """``--fit SWEEP.json``: the step model's constants that fit a measured sweep."""
    try:
        data = json.loads(Path(args.fit).read_text())
        echo, run, points = data["inputs"], data["run"], data["measured"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlanError("--fit", f"'{args.fit}' is not the --json output of kvserve plan "
                                 f"--measure: {e}") from e
    model = load_model(echo["model"])
    gpu = _fit_gpu(echo)
    hardware = Hardware.from_gpu(gpu, echo["weights"], copy_gb_s=run["copy_gb_s"],
                                 matmul_tflop_s=run["matmul_tflop_s"],
                                 rates_source=f"measured in the sweep's run on {run['card']}")
    given = {name: echo["constants"][name] for name in CONSTANT_NAMES}
    start = StepConstants(**given, source="the sweep's")
    base = PlanInputs(tp=echo["tp"], weights=echo["weights"], kv_dtype=echo["kv_dtype"])
    # the host's busy time is its own work only where it overlaps the device (CUDA)
    overlapped = run.get("device") == "cuda"
    decodes = [DecodeSample(p["batch"], p["context"], p["measured_ms"],
                            p["measured"]["host_busy_ms_per_step"] if overlapped else None)
               for p in points if p["kind"] == "decode" and p["measured_ms"] is not None]
    prefills = [PrefillSample(p["context"], p["measured_ms"])
                for p in points if p["kind"] == "prefill" and p["measured_ms"] is not None]
    source = (f"fitted by kvserve plan --fit to the sweep of {run['card']} "
              f"({data.get('date', 'undated')}, commit {data.get('commit')})")
    try:
        result = fit_constants(model, hardware, base, start, decodes, prefills, source)
    except ValueError as e:
        raise PlanError("--fit", str(e)) from e
    if args.json:
        print(json.dumps({"gpu": gpu.name, "constants": result.constants.values(),
                          "source": result.constants.source,
                          "worst_error_before": result.worst_before,
                          "worst_error_after": result.worst_after,
                          "cost_before": result.cost_before, "cost_after": result.cost_after,
                          "errors": result.errors}, indent=2))
    else:
        print(format_fit(result, gpu.name))
    return 0
