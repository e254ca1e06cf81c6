"""FP8 W8A8 linears against bf16 at llama-3-8b's shapes, one CUDA device,
one run (issue 18's FP8 GEMM choice).

    PYTHONPATH=. python benchmarks/fp8_gemm.py --output-json fp8_gemm.json

For each linear (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336) and each row count (1, 16, 64, 256, 1024, 4096, 8192): µs of
bf16 ``F.linear``, of the per-token FP8 quantiser alone, and of the whole
FP8 path (quantiser + ``torch._scaled_mm`` with row-wise scales), each
back to back in a CUDA graph over weights rotated past the L2; the speed-up
and the FP8 path's relative error against the torch reference. Also the
8192³ products' rates (bf16 and FP8) for MFU. Exits 1 if any error is 1e-2
or more.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = [1, 16, 64, 256, 1024, 4096, 8192]
ROTATION_BYTES = 512 << 20
MAX_ERROR = 1e-2


def rate_tflop_s(fp8_product: bool) -> float:
    from kvserve.bench.device_rates import graph_call_us

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8_product:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        us = graph_call_us(lambda i: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16), 8, 5)
    else:
        us = graph_call_us(lambda i: a @ b, 8, 5)
    return 2 * n**3 / us / 1e6


def rows_for(name: str, n: int, k: int, m: int) -> dict[str, Any]:
    from kvserve.bench.device_rates import graph_call_us
    from kvserve.kernels.fp8_quant import per_token_quant_fp8
    from kvserve.quant import fp8

    copies = max(1, min(8, ROTATION_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]
    quantised = [fp8.quantize_weight(w) for w in weights]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def fp8_call(i: int) -> torch.Tensor:
        qweight, scales = quantised[i % copies]
        xq, x_scales = per_token_quant_fp8(x)
        return torch._scaled_mm(xq, qweight.t(), scale_a=x_scales, scale_b=scales.t(),
                                out_dtype=torch.bfloat16)

    bf16_us = graph_call_us(lambda i: F.linear(x, weights[i % copies]), 32, 5)
    quant_us = graph_call_us(lambda i: per_token_quant_fp8(x), 32, 5)
    fp8_us = graph_call_us(fp8_call, 32, 5)
    ref = fp8.fp8_linear_reference(x, *quantised[0], None).float()
    error = float(((fp8_call(0).float() - ref).norm() / ref.norm()).item())
    return {"linear": name, "n": n, "k": k, "rows": m, "bf16_us": bf16_us,
            "quantise_us": quant_us, "fp8_us": fp8_us, "speedup": bf16_us / fp8_us,
            "rel_error_vs_reference": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    from kvserve.bench.device_rates import cuda_card

    card = cuda_card()
    if card is None:
        return 2
    report: dict[str, Any] = {"card": card, "torch": torch.__version__,
                              "bf16_tflop_s": rate_tflop_s(False),
                              "fp8_tflop_s": rate_tflop_s(True), "rows": []}
    print(f"{card}: 8192^3 bf16 {report['bf16_tflop_s']:.0f} TFLOP/s, "
          f"fp8 {report['fp8_tflop_s']:.0f} TFLOP/s")
    for name, (n, k) in SHAPES.items():
        for m in args.rows:
            row = rows_for(name, n, k, m)
            report["rows"].append(row)
            print(f"{name:8s} {n:6d}x{k:<6d} rows {m:5d}: bf16 {row['bf16_us']:8.1f} µs  "
                  f"fp8 {row['fp8_us']:8.1f} µs (quantise {row['quantise_us']:6.1f})  "
                  f"{row['speedup']:5.2f}x  err {row['rel_error_vs_reference']:.1e}",
                  flush=True)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(not r["rel_error_vs_reference"] < MAX_ERROR for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
