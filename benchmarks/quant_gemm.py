"""Weight-only quantised GEMMs (``kernels/quant_matmul.py``) against bf16 on the
GPU, at Llama-3-8B's five projection shapes (qkv, o_proj, gate_up, down,
lm_head) and 1 to 8,192 rows: bf16 cuBLAS (``F.linear``) and the bf16 skinny
GEMM (one row), then INT8 per channel, INT4 g128 and INT4 g128 with zero
points through every path that applies (the one-row FMA kernel, the dot
kernel's skinny tile up to 16 rows and its tiles above, dequantise + cuBLAS
from 256 rows) and through ``quant_matmul``'s own choice ("auto"). The down
projection at 1-16 rows also runs gated, the SiLU gate fused into the kernel
against ``silu_and_mul`` + the plain kernel (``FUSED_GATE_MAX_M``).

Timing: each call is captured ``calls`` times back to back in a CUDA graph
(``calls`` chosen so a replay takes ~2 ms, at most 48), rotating over copies
of the weight (at least ``ROTATION_BYTES``, several times the 50 MB L2, so
every call reads its weight from HBM; x stays put, as a decode step's
activations do); the graph is replayed ``REPLAYS`` times, each timed with
CUDA events, and the median replay over ``calls`` is the time of a call.
GB/s counts the bytes a call must read and write once (packed weight,
scales, zeros, x, output), beside the device-to-device copy rate measured
in the same run; TFLOP/s counts 2 * M * N * K. Every quantised output is
checked against ``F.linear`` over the dequantised bf16 weight (relative
error of the norm under 1e-2); the script exits 1 on a mismatch.

Then a whole-step estimate at one row: one decoder layer (qkv, o_proj,
gate_up, gated down) x 32 + lm_head, for bf16 and each quantised kind (the
lm_head bf16, as ``QuantConfig`` leaves it by default, and quantised), plus
``--other-ms`` for everything else in a decode step: the predicted W1
speed-up.

``--sweep`` instead times candidate configurations per path, kind (INT8 and
INT4 g128 unless ``--kinds``), shape and row count (defaults first) and
prints the best per case, to pick the module constants and
``default_*_config`` from one GPU call; ``--shapes``, ``--kinds`` and
``--rows`` narrow either mode. JSON goes to ``--json``
(default ``$OUT/quant_gemm.json``, or ``quant_gemm_sweep.json``); the compact
tables come last.

    PYTHONPATH=. python benchmarks/quant_gemm.py [--sweep] [--shapes qkv,down] \\
        [--kinds int4-g128] [--rows 1,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from kvserve.bench.device_rates import LLAMA3_8B_LINEARS, copy_rate_gb_s, cuda_card
from kvserve.kernels import quant_matmul as qm
from kvserve.kernels.activation import silu_and_mul
from kvserve.kernels.skinny_gemm import skinny_matmul

SHAPES = LLAMA3_8B_LINEARS
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)
KINDS = {"int8": (8, -1, True), "int4-g128": (4, 128, True), "int4-g128-asym": (4, 128, False)}
SWEEP_KINDS = ["int8", "int4-g128"]  # zero points cost like symmetric but for one load
SWEEP_ROWS = (1, 2, 8, 16, 64, 256, 1024, 8192)
DEQUANT_FROM_M = 256  # the dequantise + cuBLAS path is timed from this many rows
NUM_LAYERS = 32
ROTATION_BYTES = 256 << 20
REPLAYS = 15
TARGET_REPLAY_US = 2000.0
MAX_CALLS = 48
MAX_ERROR = 1e-2
DTYPE = torch.bfloat16
# sweep candidates; "bytes" is the packed bytes of a row per K step (block_k = bytes * 8 / bits)
# (block_n, bytes, warps, stages, PDL preload)
FMA_SWEEP = [(16, 512, 2, 3, 1), (16, 512, 2, 4, 2), (8, 512, 2, 3, 2), (8, 512, 2, 3, 1),
             (8, 512, 1, 4, 2), (32, 512, 4, 3, 2), (16, 1024, 4, 3, 2), (8, 1024, 2, 3, 2),
             (4, 1024, 1, 3, 2), (16, 256, 2, 4, 2), (32, 256, 2, 4, 2)]
SKINNY_DOT_SWEEP = [(16, 64, 1, 6, 2), (16, 128, 1, 4, 2), (16, 128, 1, 4, 1), (16, 256, 1, 3, 2),
                    (32, 128, 2, 4, 2), (32, 256, 2, 3, 2), (64, 64, 4, 6, 2), (64, 128, 4, 4, 2),
                    (64, 128, 4, 4, 1), (64, 256, 4, 3, 2)]
# (block_m, block_n, bytes, warps, stages)
TILE_SWEEP = [(32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 8, 4), (64, 128, 128, 8, 3),
              (128, 64, 64, 4, 4), (128, 128, 32, 8, 4), (128, 128, 64, 8, 3),
              (128, 256, 64, 8, 2), (256, 128, 64, 8, 2)]
DEQUANT_SWEEP = [(16, 512, 4), (8, 1024, 4), (32, 256, 4), (64, 128, 4), (16, 1024, 8)]


# (qweight, scales, zeros) in the kernel layout; bf16: (weight, None, None)
KernelWeight = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
GemmCall = Callable[[torch.Tensor, KernelWeight], torch.Tensor]


@dataclass
class Timing:
    shape: str
    n: int
    k: int
    m: int
    kind: str  # bf16 or a KINDS key
    path: str  # cublas, skinny, fma, dot, dequant, auto, fma-gated, fma+silu, ...
    config: str
    us: float
    gb_s: float
    copy_pct: float
    tflop_s: float
    error: float  # relative to F.linear over the dequantised bf16 weight (0 for bf16)
    default: bool = True  # the path's default config (sweep candidates: False)


@dataclass
class Weights:
    """Rotating copies of one weight: bf16, or a quantised kind's kernel tensors."""

    kind: str
    copies: list[KernelWeight]
    bits: int = 16
    group_size: int = 0
    reference: torch.Tensor | None = None  # bf16 dequantised weight (quantised kinds)

    @property
    def bytes_read(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies[0] if t is not None)


def graph_us(call: Callable[[int], object]) -> float:
    """Median µs per ``call(i)`` in CUDA-graph replays of back-to-back calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call(0)
    end.record()
    end.synchronize()
    calls = max(1, min(MAX_CALLS, int(TARGET_REPLAY_US / max(start.elapsed_time(end) * 1e3, 1.0))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def make_weights(kind: str, n: int, k: int) -> Weights:
    if kind == "bf16":
        copies = -(-ROTATION_BYTES // (n * k * 2))
        return Weights(kind, [((0.02 * torch.randn(n, k, device="cuda")).to(DTYPE), None, None)
                              for _ in range(copies)])
    bits, group, symmetric = KINDS[kind]
    group = k if group == -1 else group
    first = random_kernel_weight(n, k, bits, group, symmetric)
    num_bytes = sum(t.numel() * t.element_size() for t in first if t is not None)
    qweight, scales, zeros = first
    assert scales is not None
    weights = Weights(kind, [first], bits, group,
                      qm.dequantize_weight(qweight, scales, zeros, bits, group))
    weights.copies += [random_kernel_weight(n, k, bits, group, symmetric)
                       for _ in range(-(-ROTATION_BYTES // num_bytes) - 1)]
    return weights


def random_kernel_weight(n: int, k: int, bits: int, group: int, symmetric: bool
                         ) -> KernelWeight:
    """Random codes (uniform bytes), scales ~0.01 and zero points, in the kernel layout."""
    qweight = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device="cuda")
    scales = (0.005 + 0.01 * torch.rand(k // group, n, device="cuda")).to(DTYPE)
    zeros = None if symmetric else torch.randint(0, 2**bits, (k // group, n),
                                                 device="cuda").to(DTYPE)
    return qweight, scales, zeros


class Runner:
    """Times and checks calls on one shape; collects ``Timing`` rows."""

    def __init__(self, shape: str, copy_gb_s: float) -> None:
        self.shape, (self.n, self.k) = shape, SHAPES[shape]
        self.copy_gb_s = copy_gb_s
        self.timings: list[Timing] = []
        self.mismatch = False

    def time(self, weights: Weights, x: torch.Tensor, path: str, config: str,
             fn: GemmCall, default: bool = True, gated: bool = False) -> Timing:
        m = x.shape[0]
        out = fn(x, weights.copies[0])
        error = 0.0
        if weights.reference is not None:
            ref = F.linear(silu_and_mul(x) if gated else x, weights.reference).float()
            error = ((out.float() - ref).norm() / ref.norm()).item()
        us = graph_us(lambda i: fn(x, weights.copies[i % len(weights.copies)]))
        num_bytes = weights.bytes_read + x.numel() * x.element_size() + m * self.n * 2
        timing = Timing(self.shape, self.n, self.k, m, weights.kind, path, config, us,
                        num_bytes / us / 1e3, 100 * num_bytes / us / 1e3 / self.copy_gb_s,
                        2 * m * self.n * self.k / us / 1e6, error, default)
        self.timings.append(timing)
        bad = not error < MAX_ERROR
        self.mismatch |= bad
        print(f"  {self.shape:8} M={m:<5d} {weights.kind:15} {path:10} {config:28} {us:10.2f} µs "
              f"{timing.gb_s:6.0f} GB/s {timing.copy_pct:5.1f}% {timing.tflop_s:6.1f} TFLOP/s"
              f"  err {error:.1e}{'  MISMATCH' if bad else ''}", flush=True)
        return timing


CONFIG_LETTERS = {"block_m": "m", "block_n": "n", "block_k": "k", "num_warps": "w",
                  "num_stages": "s", "group_m": "g", "preload": "p"}


def config_name(config: qm.QuantGemmConfig) -> str:
    """``fma n16 k1024 w2 s3``: the path and its fields, one letter each."""
    return type(config).__name__.removesuffix("Config").lower() + " " + " ".join(
        f"{CONFIG_LETTERS[key]}{value}" for key, value in asdict(config).items())


def quant_call(weights: Weights, config: qm.QuantGemmConfig | None, gated: bool = False
               ) -> GemmCall:
    def call(x: torch.Tensor, t: KernelWeight) -> torch.Tensor:
        q, s, z = t
        assert s is not None
        return qm.quant_matmul(x, q, s, z, weights.bits, weights.group_size, gated=gated,
                               config=config)
    return call


def silu_first(call: GemmCall) -> GemmCall:
    """``call`` on ``silu_and_mul`` of a gate-and-up input (the unfused gated GEMM)."""
    return lambda x, t: call(silu_and_mul(x), t)


def default_paths(weights: Weights, m: int, n: int, k: int) -> list[tuple[str, qm.QuantGemmConfig]]:
    """Each path that applies at ``m`` rows, with its default config."""
    paths: list[tuple[str, qm.QuantGemmConfig]] = []
    if m == 1:
        paths.append(("fma", qm.default_fma_config(weights.bits, n, k)))
    else:
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        paths.append(("dot", qm.default_dot_config(weights.bits, m, n, k, num_sms)))
    if m >= DEQUANT_FROM_M:
        paths.append(("dequant", qm.default_dequant_config(weights.bits, k)))
    return paths


def run_shape(shape: str, kinds: list[str], rows: list[int], copy_gb_s: float) -> Runner:
    runner = Runner(shape, copy_gb_s)
    n, k = SHAPES[shape]
    xs = {m: torch.randn(m, k, device="cuda").to(DTYPE) for m in rows}
    bf16 = make_weights("bf16", n, k)
    for m in rows:
        runner.time(bf16, xs[m], "cublas", "F.linear", lambda x, t: F.linear(x, t[0]))
        if m == 1:
            runner.time(bf16, xs[m], "skinny", "default", lambda x, t: skinny_matmul(x, t[0]))
    if shape == "down" and 1 in rows:
        gate_up = torch.randn(1, 2 * k, device="cuda").to(DTYPE)
        runner.time(bf16, gate_up, "skinny-gated", "default",
                    lambda x, t: skinny_matmul(x, t[0], gated=True))
    del bf16
    for kind in kinds:
        weights = make_weights(kind, n, k)
        for m in rows:
            for path, config in default_paths(weights, m, n, k):
                runner.time(weights, xs[m], path, config_name(config), quant_call(weights, config))
            runner.time(weights, xs[m], "auto", "quant_matmul", quant_call(weights, None))
        if shape == "down":
            time_gates(runner, weights, [m for m in rows if m <= qm.SKINNY_MAX_M])
        del weights
        torch.cuda.empty_cache()
    return runner


def time_gates(runner: Runner, weights: Weights, rows: list[int]) -> None:
    """The gated down projection: the gate fused into the kernel against
    ``silu_and_mul`` then the plain kernel, at decode row counts."""
    for m in rows:
        gate_up = torch.randn(m, 2 * runner.k, device="cuda").to(DTYPE)
        path = "fma" if m == 1 else "dot"
        if m == 1:
            fused = quant_call(weights, None, gated=True)
        else:
            def fused(x: torch.Tensor, t: KernelWeight) -> torch.Tensor:
                q, s, z = t
                assert s is not None
                return qm.quant_matmul_dot(x, q, s, z, weights.bits, weights.group_size,
                                           gated=True, fuse_gate=True)
        runner.time(weights, gate_up, f"{path}-gated", "default", fused, gated=True)
        runner.time(weights, gate_up, f"{path}+silu", "silu_and_mul + default",
                    silu_first(quant_call(weights, None)), gated=True)


def sweep_configs(weights: Weights, m: int, k: int) -> list[tuple[str, qm.QuantGemmConfig]]:
    per_byte = 8 // weights.bits  # columns per packed byte

    def cap(block_k: int) -> int:  # never much wider than K, as the defaults
        return max(32, min(block_k, triton.next_power_of_2(k)))

    if m == 1:
        return [("fma", qm.FmaConfig(bn, cap(b * per_byte), w, s, p))
                for bn, b, w, s, p in FMA_SWEEP]
    if m <= qm.SKINNY_MAX_M:
        return [("dot", qm.DotConfig(16, bn, cap(b * per_byte), w, s, preload=p))
                for bn, b, w, s, p in SKINNY_DOT_SWEEP]
    return [("dot", qm.DotConfig(bm, bn, cap(b * per_byte), w, s)) for bm, bn, b, w, s in TILE_SWEEP
            if bm <= 2 * max(m, 16)] + (
        [("dequant", qm.DequantConfig(bn, cap(b * per_byte), w)) for bn, b, w in DEQUANT_SWEEP]
        if m >= DEQUANT_FROM_M else [])


def sweep_shape(shape: str, kinds: list[str], rows: list[int], copy_gb_s: float) -> Runner:
    runner = Runner(shape, copy_gb_s)
    n, k = SHAPES[shape]
    for kind in kinds:
        weights = make_weights(kind, n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(DTYPE)
            defaults = default_paths(weights, m, n, k)
            for path, config in defaults:
                runner.time(weights, x, path, config_name(config), quant_call(weights, config))
            for path, config in sweep_configs(weights, m, k):
                if (path, config) not in defaults:
                    runner.time(weights, x, path, config_name(config),
                                quant_call(weights, config), default=False)
        del weights
        torch.cuda.empty_cache()
    return runner


def print_tables(timings: list[Timing], kinds: list[str], copy_gb_s: float) -> None:
    def best(shape: str, m: int, kind: str, paths: tuple[str, ...] = ()) -> Timing | None:
        rows = [t for t in timings if t.shape == shape and t.m == m and t.kind == kind
                and (not paths or t.path in paths)]
        return min(rows, key=lambda t: t.us) if rows else None

    print(f"\nper shape and rows: µs of the fastest bf16 (cuBLAS or skinny) and of quant_matmul's "
          f"own path (speed-up over bf16); copy {copy_gb_s:,.0f} GB/s")
    print("| shape | M | bf16 µs | " + " | ".join(f"{kind} µs (x)" for kind in kinds)
          + " | best quantised path |")
    print("|---|---:|---:|" + "---:|" * len(kinds) + "---|")
    for shape in SHAPES:
        for m in ROWS:
            base = best(shape, m, "bf16", ("cublas", "skinny"))
            if base is None:
                continue
            cells = []
            for kind in kinds:
                auto = best(shape, m, kind, ("auto",))
                cells.append("—" if auto is None else f"{auto.us:.1f} ({base.us / auto.us:.2f}x)")
            quant = [t for t in timings if t.shape == shape and t.m == m
                     and t.kind != "bf16" and t.path != "auto"]
            winner = min(quant, key=lambda t: t.us) if quant else None
            note = "—" if winner is None else f"{winner.kind} {winner.path} {winner.us:.1f} µs"
            print(f"| {shape} | {m} | {base.us:.1f} | " + " | ".join(cells) + f" | {note} |")
    print("\none row (decode): GB/s over the bytes a call reads, % of the copy rate")
    print("| shape | " + " | ".join(f"{kind}" for kind in ["bf16", *kinds]) + " |")
    print("|---|" + "---:|" * (len(kinds) + 1))
    for shape in SHAPES:
        cells = []
        for kind in ["bf16", *kinds]:
            t = best(shape, 1, kind, ("skinny",) if kind == "bf16" else ("auto",))
            cells.append("—" if t is None else f"{t.us:.1f} µs, {t.gb_s:,.0f} GB/s, "
                         f"{t.copy_pct:.0f}%")
        print(f"| {shape} | " + " | ".join(cells) + " |")


def print_step_estimate(timings: list[Timing], kinds: list[str], other_ms: float) -> None:
    def one_row(shape: str, kind: str, paths: tuple[str, ...]) -> float | None:
        rows = [t.us for t in timings
                if t.shape == shape and t.m == 1 and t.kind == kind and t.path in paths]
        return min(rows) if rows else None

    bf16_paths = ("skinny", "cublas")
    layer_bf16 = [one_row(s, "bf16", bf16_paths) for s in ("qkv", "o_proj", "gate_up")]
    down_bf16 = one_row("down", "bf16", ("skinny-gated",))
    head_bf16 = one_row("lm_head", "bf16", bf16_paths)
    if None in layer_bf16 or down_bf16 is None or head_bf16 is None:
        print("\n(whole-step estimate needs all five shapes at one row)")
        return
    bf16_ms = (NUM_LAYERS * (sum(layer_bf16) + down_bf16) + head_bf16) / 1e3  # type: ignore[arg-type]
    print(f"\nwhole decode step at one row: {NUM_LAYERS} x (qkv + o_proj + gate_up + gated down)"
          f" + lm_head, plus {other_ms} ms outside the GEMMs (--other-ms)")
    print("| weights | GEMMs ms (lm_head bf16) | step speed-up | GEMMs ms (lm_head quantised) "
          "| step speed-up |")
    print("|---|---:|---:|---:|---:|")
    print(f"| bf16 | {bf16_ms:.3f} | 1.00x | {bf16_ms:.3f} | 1.00x |")
    for kind in kinds:
        layer = [one_row(s, kind, ("auto",)) for s in ("qkv", "o_proj", "gate_up")]
        down = one_row("down", kind, ("fma-gated", "fma+silu"))
        head = one_row("lm_head", kind, ("auto",))
        if None in layer or down is None or head is None:
            continue
        body = NUM_LAYERS * (sum(layer) + down) / 1e3  # type: ignore[arg-type]
        ms_bf16_head, ms_quant_head = body + head_bf16 / 1e3, body + head / 1e3
        print(f"| {kind} | {ms_bf16_head:.3f} | "
              f"{(bf16_ms + other_ms) / (ms_bf16_head + other_ms):.2f}x | {ms_quant_head:.3f} | "
              f"{(bf16_ms + other_ms) / (ms_quant_head + other_ms):.2f}x |")


def print_sweep(timings: list[Timing]) -> None:
    print("\nsweep: the default config and the fastest candidate per shape, kind, rows and path")
    print("| shape | M | kind | path | default µs | best µs | gain | best config |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    cases = sorted({(t.shape, t.m, t.kind, t.path) for t in timings},
                   key=lambda c: (list(SHAPES).index(c[0]), c[2], c[1], c[3]))
    for shape, m, kind, path in cases:
        rows = [t for t in timings if (t.shape, t.m, t.kind, t.path) == (shape, m, kind, path)]
        default = next((t for t in rows if t.default), None)
        winner = min(rows, key=lambda t: t.us)
        base = default.us if default else float("nan")
        print(f"| {shape} | {m} | {kind} | {path} | {base:.2f} | {winner.us:.2f} | "
              f"{base / winner.us:.2f}x | {winner.config} |")


def parse_list(text: str | None, allowed: list[str]) -> list[str]:
    if text is None:
        return allowed
    chosen = text.split(",")
    unknown = [item for item in chosen if item not in allowed]
    if unknown:
        raise SystemExit(f"unknown {unknown}; allowed: {', '.join(allowed)}")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate configs per path")
    parser.add_argument("--shapes", help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--kinds", help=f"comma-separated subset of {','.join(KINDS)} "
                        f"(sweep default: {','.join(SWEEP_KINDS)})")
    parser.add_argument("--rows", help=f"comma-separated row counts (default {ROWS}; "
                        f"sweep {SWEEP_ROWS})")
    parser.add_argument("--other-ms", type=float, default=0.4,
                        help="ms of a W1 decode step outside the weight GEMMs (H100: ~0.4)")
    parser.add_argument("--json", help="output file (default $OUT/quant_gemm[_sweep].json)")
    args = parser.parse_args()
    if cuda_card() is None:
        return 2
    shapes = parse_list(args.shapes, list(SHAPES))
    kinds = parse_list(args.kinds, list(KINDS))
    if args.sweep and args.kinds is None:
        kinds = SWEEP_KINDS
    default_rows = SWEEP_ROWS if args.sweep else ROWS
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(default_rows)
    card = torch.cuda.get_device_name()
    copy_gb_s = copy_rate_gb_s()
    print(f"{card}: device-to-device copy {copy_gb_s:,.0f} GB/s; {REPLAYS} graph replays, "
          f"weights rotated over >= {ROTATION_BYTES >> 20} MB", flush=True)
    timings: list[Timing] = []
    mismatch = False
    for shape in shapes:
        runner = (sweep_shape if args.sweep else run_shape)(shape, kinds, rows, copy_gb_s)
        timings += runner.timings
        mismatch |= runner.mismatch
        torch.cuda.empty_cache()
    name = "quant_gemm_sweep.json" if args.sweep else "quant_gemm.json"
    path = Path(args.json) if args.json else Path(os.environ.get("OUT", ".")) / name
    path.write_text(json.dumps({"card": card, "copy_gb_s": copy_gb_s, "sweep": args.sweep,
                                "timings": [asdict(t) for t in timings]}, indent=1))
    print(f"\n{card}, copy {copy_gb_s:,.0f} GB/s; JSON in {path}")
    if args.sweep:
        print_sweep(timings)
    else:
        print_tables(timings, kinds, copy_gb_s)
        print_step_estimate(timings, kinds, args.other_ms)
    if mismatch:
        print(f"\nFAILED: a quantised output differs from F.linear over the dequantised weight "
              f"by {MAX_ERROR:.0e} or more")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
