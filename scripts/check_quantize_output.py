#!/usr/bin/env python3
"""Check ``kvserve quantize``'s checkpoints against the real compressed-tensors library.

Runs kvserve's quantiser in-process on a model (the bundled one by default) for a
set of schemes and methods, then, with compressed-tensors (not a kvserve
dependency, so this runs in its own venv):

1. parses the written ``quantization_config`` with compressed-tensors' own
   ``QuantizationConfig`` and checks its dump agrees with what was written;
2. decompresses every quantised linear with ``PackedQuantizationCompressor``
   from the safetensors files and compares it with kvserve's dequantisation of
   the ``QuantizedWeight`` the run produced (rounded to the checkpoint's dtype,
   the dtype compressed-tensors dequantises into): must be bit-equal;
3. loads the directory with transformers' ``AutoModelForCausalLM`` (its
   compressed-tensors integration, decompressing) and compares every linear's
   weight the same way, and that lm_head stayed 16-bit.

    python -m venv /work/venvs/ct
    /work/venvs/ct/bin/pip install torch==2.13.0 compressed-tensors
    PYTHONPATH=. /work/venvs/ct/bin/python scripts/check_quantize_output.py

Prints one line per case and exits non-zero if any differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvserve.assets import default_model_path
from kvserve.quant.packing import dequantize
from kvserve.quantize.options import QuantizeOptions
from kvserve.quantize.pipeline import QuantizeResult, quantize_checkpoint

# (method, bits, group_size, symmetric, act_order)
CASES = [
    ("rtn", 8, -1, True, False),
    ("rtn", 4, 128, True, False),
    ("rtn", 4, 32, False, False),
    ("gptq", 4, 128, True, False),
    ("gptq", 4, 64, False, True),
    ("gptq", 8, -1, True, False),
    ("awq", 4, 128, False, False),
    ("awq", 4, 64, True, False),
]


def check_config(written: dict[str, Any]) -> list[str]:
    """Differences between the written quantization_config and compressed-tensors'
    own parse-and-dump of it."""
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(written)
    dumped = parsed.model_dump()
    problems = []
    for key in ("format", "quantization_status", "ignore", "quant_method"):
        if dumped.get(key) != written.get(key):
            problems.append(f"{key}: written {written.get(key)!r}, parsed {dumped.get(key)!r}")
    ours = written["config_groups"]["group_0"]
    theirs = dumped["config_groups"]["group_0"]
    if theirs["targets"] != ours["targets"]:
        problems.append(f"targets: {ours['targets']} vs {theirs['targets']}")
    for key, value in theirs["weights"].items():
        if key in ours["weights"] and ours["weights"][key] != value:
            problems.append(f"weights.{key}: written {ours['weights'][key]!r}, parsed {value!r}")
    return problems


def check_tensors(result: QuantizeResult, written: dict[str, Any]) -> tuple[int, float]:
    """Decompress every quantised linear with compressed-tensors; (count, max |diff|)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = QuantizationConfig.model_validate(written).config_groups["group_0"]
    handle = safe_open(str(result.options.output / "model.safetensors"), "pt")
    worst = 0.0
    for name, qw in result.quantized.items():
        state = {suffix: handle.get_tensor(f"{name}.{suffix}")
                 for suffix in ("weight_packed", "weight_scale", "weight_shape",
                                "weight_zero_point")
                 if f"{name}.{suffix}" in handle.keys()}  # noqa: SIM118
        weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        ours = dequantize(qw).to(weight.dtype)
        worst = max(worst, float((weight.float() - ours.float()).abs().max()))
    return len(result.quantized), worst


def check_transformers(result: QuantizeResult) -> tuple[int, float, bool]:
    """Load the directory with transformers (decompressing); (count, max |diff|, lm_head 16-bit)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(result.options.output), quantization_config=CompressedTensorsConfig(dequantize=True),
        dtype="auto")
    worst = 0.0
    for name, qw in result.quantized.items():
        weight = model.get_submodule(name).weight.detach()
        ours = dequantize(qw).to(weight.dtype)
        worst = max(worst, float((weight.float() - ours.float()).abs().max()))
    head = model.get_submodule("lm_head").weight
    return len(result.quantized), worst, head.dtype in (torch.bfloat16, torch.float16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--calib", type=Path, default=Path(__file__).parents[1] / "kvserve",
                        help="calibration text (default: kvserve's own sources)")
    args = parser.parse_args(argv)
    import compressed_tensors
    import transformers

    print(f"compressed-tensors {compressed_tensors.__version__}, transformers "
          f"{transformers.__version__}, torch {torch.__version__}; model {args.model}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (method, bits, group_size, symmetric, act_order) in enumerate(CASES):
            options = QuantizeOptions(
                model=args.model, output=Path(tmp) / f"case{i}", method=method, bits=bits,
                group_size=group_size, symmetric=symmetric, act_order=act_order,
                calib=None if method == "rtn" else args.calib, num_samples=8, seq_len=128)
            result = quantize_checkpoint(options)
            written = json.loads((options.output / "config.json").read_text())
            written = written["quantization_config"]
            problems = check_config(written)
            count, worst = check_tensors(result, written)
            hf_count, hf_worst, head_16bit = check_transformers(result)
            ok = not problems and worst == 0.0 and hf_worst == 0.0 and head_16bit
            failed += not ok
            label = f"{method} {options.quant_config.name}{' act-order' if act_order else ''}"
            agrees = problems or "agrees"
            print(f"{'OK  ' if ok else 'FAIL'} {label:28s} config {agrees}; compressor: "
                  f"{count} linears, max |diff| {worst:g}; transformers: {hf_count} linears, "
                  f"max |diff| {hf_worst:g}, lm_head 16-bit {head_16bit}")
    print(f"{len(CASES) - failed} of {len(CASES)} cases equal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
