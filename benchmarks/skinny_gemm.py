"""The skinny GEMM (``kvserve/kernels/skinny_gemm.py``) against ``F.linear``
(cuBLAS) on the GPU, at Llama-3-8B's five weight shapes (qkv, o_proj,
gate_up, down, lm_head; bf16) and 1, 2, 4, 8, 16 rows: the weight GEMMs of
a decode step of that many requests.

Each candidate is timed inside a CUDA graph of ``CALLS_PER_GRAPH``
back-to-back calls replayed ``REPLAYS`` times (so launch gaps are the
graph's, as in a decode step). The calls rotate over enough copies of the
weight (at least ``ROTATION_BYTES`` in all, several times the 50-60 MB L2)
that every call reads its weight from HBM. GB/s counts the bytes a call
must move (weight, x, output) over its time, beside the device-to-device
copy rate (1 GiB, read + written) measured in the same run. Candidates:
``F.linear``, ``skinny_matmul``'s default configuration, and a sweep of
alternatives (FMA tiles for 1-8 rows, ``tl.dot`` tiles for all). Every
skinny result is checked against ``F.linear`` (relative error of the norm
below 1e-2); the script exits 1 on a mismatch. One line per candidate as it
runs, then one markdown table last. ``--gated`` adds the down projection as
the layers run it, its input the gate-and-up product ``[M, 2K]``: the fused
SiLU gate (``skinny_matmul(..., gated=True)``) against ``silu_and_mul`` then
``F.linear``.

    PYTHONPATH=. python benchmarks/skinny_gemm.py [--no-sweep] [--gated] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvserve.bench.device_rates import (
    LLAMA3_8B_LINEARS,
    copy_rate_gb_s,
    cuda_card,
    graph_call_us,
)
from kvserve.kernels.activation import silu_and_mul
from kvserve.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_matmul

SHAPES = LLAMA3_8B_LINEARS
ROWS = (1, 2, 4, 8, 16)
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 48
REPLAYS = 10
ROTATION_BYTES = 256 << 20
MAX_ERROR = 1e-2
# (block_n, block_k at one row, num_warps, num_stages); FMA halves block_k per
# doubling of the rows, so its accumulator stays the same size
FMA_SWEEP = [(8, 1024, 4, 3), (16, 512, 4, 3), (8, 512, 4, 4), (16, 256, 2, 4),
             (32, 256, 8, 3), (8, 1024, 4, 1), (4, 1024, 2, 3), (4, 512, 2, 4),
             (2, 1024, 2, 4)]
FMA_SWEEP_MAX_ROWS = 8
# (block_n, block_k, num_warps, num_stages) for 3-8 rows, block_k as given: a deeper
# pipeline of smaller tiles keeps the 3-D accumulator in registers
MULTI_ROW_FMA_SWEEP = [(4, 256, 2, 4), (4, 256, 2, 6), (4, 128, 2, 8), (8, 128, 4, 6),
                       (8, 256, 4, 4), (2, 512, 2, 4), (2, 256, 1, 6), (4, 512, 4, 3),
                       (16, 64, 4, 6), (8, 64, 2, 8)]
# (block_n, block_k, num_warps, num_stages): mma.sync at block_n 16 / 32, wgmma at 64
DOT_SWEEP = [(16, 256, 1, 4), (16, 256, 2, 4), (16, 512, 1, 3), (16, 128, 1, 6),
             (32, 128, 2, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3)]


def graph_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """µs per call of ``fn(weight)``, rotating over ``weights``, in a CUDA graph."""
    return graph_call_us(lambda i: fn(weights[i % len(weights)]), CALLS_PER_GRAPH, REPLAYS)


def sweep_configs(rows: int) -> list[SkinnyConfig]:
    block_m = 1 << (rows - 1).bit_length()
    configs = []
    if rows <= FMA_SWEEP_MAX_ROWS:
        configs += [SkinnyConfig(n, max(16, k // block_m), w, s, use_dot=False)
                    for n, k, w, s in FMA_SWEEP]
    if rows > 2:
        configs += [SkinnyConfig(n, k, w, s, use_dot=False) for n, k, w, s in MULTI_ROW_FMA_SWEEP]
    configs += [SkinnyConfig(n, k, w, s, use_dot=True) for n, k, w, s in DOT_SWEEP]
    return configs


def config_name(c: SkinnyConfig) -> str:
    kind = "dot" if c.use_dot else "fma"
    return f"{kind} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


@dataclass
class Timing:
    config: str
    us: float
    gb_s: float
    error: float  # relative to F.linear's output


@dataclass
class Case:
    shape: str
    n: int
    k: int
    rows: int
    linear_us: float
    linear_gb_s: float
    timings: list[Timing]  # the default config first

    @property
    def best(self) -> Timing:
        return min(self.timings, key=lambda t: t.us)

    @property
    def max_error(self) -> float:
        return max(t.error for t in self.timings)


def run_case(shape: str, weights: list[torch.Tensor], rows: int, sweep: bool,
             gated: bool = False) -> Case:
    """Time ``F.linear`` and the skinny candidates; with ``gated`` the input is a
    gate-and-up product and the reference applies ``silu_and_mul`` first."""
    n, k = weights[0].shape
    x = torch.randn(rows, 2 * k if gated else k, dtype=DTYPE, device="cuda")
    num_bytes = (n * k + x.numel() + rows * n) * weights[0].element_size()

    def reference(w: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(x) if gated else x, w)

    ref = reference(weights[0]).float()
    linear_us = graph_us(reference, weights)
    default = default_config(rows, n, k)
    candidates = [default] + [c for c in (sweep_configs(rows) if sweep else []) if c != default]
    timings = []
    for config in candidates:
        out = skinny_matmul(x, weights[0], None, config, gated).float()
        error = ((out - ref).norm() / ref.norm()).item()
        us = graph_us(functools.partial(skinny_matmul, x, bias=None, config=config,
                                        gated=gated), weights)
        timings.append(Timing(config_name(config), us, num_bytes / us / 1e3, error))
        print(f"  {shape:8} M={rows:<2d} {config_name(config):24} {us:8.2f} µs "
              f"{num_bytes / us / 1e3:6.0f} GB/s  err {error:.1e}"
              f"{'' if error < MAX_ERROR else '  MISMATCH'}", flush=True)
    print(f"  {shape:8} M={rows:<2d} {'F.linear':24} {linear_us:8.2f} µs "
          f"{num_bytes / linear_us / 1e3:6.0f} GB/s", flush=True)
    return Case(shape, n, k, rows, linear_us, num_bytes / linear_us / 1e3, timings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sweep", action="store_true", help="time the default config only")
    parser.add_argument("--json", default=None, help="also write every result to this file")
    parser.add_argument("--gated", action="store_true",
                        help="also time the down projection with its SiLU gate fused")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="comma-separated row counts (a verify step at k = 4 has 5)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    card = cuda_card()
    if card is None:
        return 2
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gb_s = copy_rate_gb_s()
    print(f"{card} ({num_sms} SMs): device-to-device copy {copy_gb_s:,.0f} GB/s; "
          f"{CALLS_PER_GRAPH} calls a graph, {REPLAYS} replays, {DTYPE}", flush=True)
    cases = []
    for shape, (n, k) in SHAPES.items():
        num_copies = -(-ROTATION_BYTES // (n * k * DTYPE.itemsize))
        weights = [(0.02 * torch.randn(n, k, device="cuda")).to(DTYPE)
                   for _ in range(num_copies)]
        for rows in rows_list:
            cases.append(run_case(shape, weights, rows, not args.no_sweep))
            if args.gated and shape == "down":
                cases.append(run_case("down+silu", weights, rows, not args.no_sweep, True))
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "num_sms": num_sms, "copy_gb_s": copy_gb_s,
                       "cases": [asdict(case) for case in cases]}, f, indent=2)
    print(f"\n{card}, copy {copy_gb_s:,.0f} GB/s; speed-up = F.linear µs / skinny µs\n")
    print("| shape | M | F.linear µs | F.linear GB/s | skinny µs | skinny GB/s | of copy "
          "| speed-up | best config | best GB/s | best speed-up | max rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for case in cases:
        default, best = case.timings[0], case.best
        print(f"| {case.shape} {case.n}x{case.k} | {case.rows} | {case.linear_us:.2f} "
              f"| {case.linear_gb_s:,.0f} | {default.us:.2f} | {default.gb_s:,.0f} "
              f"| {default.gb_s / copy_gb_s:.0%} | {case.linear_us / default.us:.2f}x "
              f"| {best.config} | {best.gb_s:,.0f} | {case.linear_us / best.us:.2f}x "
              f"| {case.max_error:.1e} |")
    if any(not case.max_error < MAX_ERROR for case in cases):
        print(f"\nFAILED: a skinny result differs from F.linear by {MAX_ERROR:.0e} or more")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
