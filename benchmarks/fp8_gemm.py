"""FP8 and INT8 W8A8 linears against bf16 at llama-3-8b's shapes, one CUDA
device, one run (issue 18's FP8 GEMM choice and SmoothQuant's INT8 GEMM).

    PYTHONPATH=. python benchmarks/fp8_gemm.py [--types fp8 w8a8-int8] \
        --output-json fp8_gemm.json

For each linear (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336) and each row count (1, 16, 64, 256, 1024, 4096, 8192): µs of
bf16 ``F.linear``, and per W8A8 type of its per-token quantiser alone and
of the whole path as the layer runs it (FP8: quantiser + ``torch._scaled_mm``
with row-wise scales; INT8: ``Int8W8A8LinearMethod.apply``, quantiser (rows
padded to 32 below that) + ``torch._int_mm`` + the float32 scaling
epilogue), each back to back in a CUDA graph over weights rotated past the
L2; the speed-up and the path's relative error against its torch reference.
Also the 8192³ products' rates (bf16, FP8, INT8) for MFU. Exits 1 if any
error is 1e-2 or more.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = [1, 16, 64, 256, 1024, 4096, 8192]
ROTATION_BYTES = 512 << 20
MAX_ERROR = 1e-2


TYPES = ("fp8", "w8a8-int8")


def rate_tflop_s(product: str) -> float:
    """TFLOP/s (TOP/s for int8) of an 8192³ product: ``bf16``, ``fp8`` or ``int8``."""
    from kvserve.bench.device_rates import graph_call_us

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if product == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        us = graph_call_us(lambda i: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16), 8, 5)
    elif product == "int8":
        a8, b8 = (a * 20).to(torch.int8), (b * 20).to(torch.int8).t().contiguous().t()
        us = graph_call_us(lambda i: torch._int_mm(a8, b8), 8, 5)
    else:
        us = graph_call_us(lambda i: a @ b, 8, 5)
    return 2 * n**3 / us / 1e6


def w8a8_paths(w8a8: str, weights: list[torch.Tensor], x: torch.Tensor) -> tuple[
        Callable[[int], torch.Tensor], Callable[[int], Any], Callable[[], torch.Tensor]]:
    """(the whole path on weight copy i, the quantiser alone, the torch reference on copy 0)."""
    from kvserve.kernels.fp8_quant import per_token_quant_fp8, per_token_quant_int8
    from kvserve.quant import fp8, int8
    from kvserve.quant.config import quantize_at_load
    from kvserve.quant.methods import Int8W8A8LinearMethod

    if w8a8 == "fp8":
        quantised = [fp8.quantize_weight(w) for w in weights]

        def fp8_call(i: int) -> torch.Tensor:
            qweight, scales = quantised[i % len(quantised)]
            xq, x_scales = per_token_quant_fp8(x)
            return torch._scaled_mm(xq, qweight.t(), scale_a=x_scales, scale_b=scales.t(),
                                    out_dtype=torch.bfloat16)

        return (fp8_call, lambda i: per_token_quant_fp8(x),
                lambda: fp8.fp8_linear_reference(x, *quantised[0], None))
    method = Int8W8A8LinearMethod(quantize_at_load("w8a8-int8"))
    layers = []
    for w in weights:
        layer = SimpleNamespace(output_size=w.shape[0], input_size=w.shape[1], use_triton=True)
        layer.qweight, layer.scales = int8.quantize_weight(w)
        layers.append(layer)
    pad = 32 if x.shape[0] < 32 else None
    return (lambda i: method.apply(layers[i % len(layers)], x, None),
            lambda i: per_token_quant_int8(x, pad),
            lambda: int8.int8_linear_reference(x, layers[0].qweight, layers[0].scales, None))


def rows_for(name: str, n: int, k: int, m: int, types: list[str]) -> dict[str, Any]:
    from kvserve.bench.device_rates import graph_call_us

    copies = max(1, min(8, ROTATION_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bf16_us = graph_call_us(lambda i: F.linear(x, weights[i % copies]), 32, 5)
    row: dict[str, Any] = {"linear": name, "n": n, "k": k, "rows": m, "bf16_us": bf16_us}
    for w8a8 in types:
        call, quantise, reference = w8a8_paths(w8a8, weights, x)
        key = "fp8" if w8a8 == "fp8" else "int8"
        quant_us = graph_call_us(quantise, 32, 5)
        path_us = graph_call_us(call, 32, 5)
        ref = reference().float()
        error = float(((call(0).float() - ref).norm() / ref.norm()).item())
        # the FP8 keys keep their first names (quantise_us, speedup, rel_error_vs_reference)
        prefix = "" if key == "fp8" else "int8_"
        row |= {f"{prefix}quantise_us": quant_us, f"{key}_us": path_us,
                f"{prefix}speedup": bf16_us / path_us, f"{prefix}rel_error_vs_reference": error}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES,
                        help="W8A8 paths to time against bf16 (default: both)")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    from kvserve.bench.device_rates import cuda_card

    card = cuda_card()
    if card is None:
        return 2
    report: dict[str, Any] = {"card": card, "torch": torch.__version__,
                              "bf16_tflop_s": rate_tflop_s("bf16"), "types": args.types,
                              "rows": []}
    if "fp8" in args.types:
        report["fp8_tflop_s"] = rate_tflop_s("fp8")
    if "w8a8-int8" in args.types:
        report["int8_tops"] = rate_tflop_s("int8")
    print(f"{card}: 8192^3 bf16 {report['bf16_tflop_s']:.0f} TFLOP/s, fp8 "
          f"{report.get('fp8_tflop_s', 0):.0f} TFLOP/s, int8 {report.get('int8_tops', 0):.0f} "
          "TOP/s")
    for name, (n, k) in SHAPES.items():
        for m in args.rows:
            row = rows_for(name, n, k, m, args.types)
            report["rows"].append(row)
            line = f"{name:8s} {n:6d}x{k:<6d} rows {m:5d}: bf16 {row['bf16_us']:8.1f} µs"
            for key, prefix in (("fp8", ""), ("int8", "int8_")):
                if f"{key}_us" in row:
                    line += (f"  {key} {row[f'{key}_us']:8.1f} µs (quantise "
                             f"{row[f'{prefix}quantise_us']:6.1f}) {row[f'{prefix}speedup']:5.2f}x"
                             f" err {row[f'{prefix}rel_error_vs_reference']:.1e}")
            print(line, flush=True)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    errors = [r[key] for r in report["rows"] for key in ("rel_error_vs_reference",
                                                         "int8_rel_error_vs_reference") if key in r]
    return 1 if any(not e < MAX_ERROR for e in errors) else 0


if __name__ == "__main__":
    sys.exit(main())
