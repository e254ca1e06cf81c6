"""Long-context decode with the KV cache in bf16, fp8_e4m3 and int8, on one
CUDA device, every figure of one run (issue 18's KV targets).

    PYTHONPATH=. python benchmarks/kv_cache_dtype.py --output-json kv_cache_dtype.json \\
        [--parts kernels engine] [--model llama-3-8b] [--long-model llama-3.1-8b]

``kernels``: the decode attention kernel alone at llama-3-8b's layer shape
(32 heads, 8 KV heads, head_dim 128, block 16) over a cache already
written, batch 64 with 8,192-token contexts and batch 1 with 32,768: µs a
call (back to back in a CUDA graph, rotating over block ranges larger than
the L2, as ``attention_kernels.py`` times them), the KV bytes read a second
(int8's scales counted) and the speed-up over bf16; each output is checked
against the torch reference reading the same cache (relative error < 1e-2).

``engine``: ``kvserve bench latency`` in a fresh process per KV dtype
(random weights, ``--load-format dummy``, bf16): decode at ``--batch``
requests of ``--context`` tokens (prompt ``context - 128``, 128 new: the
decode tokens/s and TPOT), and W1 with a ``--long-prompt``-token prompt
(256 new) on ``--long-model``; first the KV pool's token capacity
(``kv_blocks_total`` x block size) of an engine allowed ``CAPACITY_SEQS``
requests of ``--context`` tokens, so memory, not the sequence budget, sizes
it. A configuration that does not fit the card (bf16 at batch 64 x 8k needs
~69 GB of KV on llama-3-8b: an H200, not an H100) is recorded with its error
and the run goes on.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
KERNEL_CASES = [(64, 8192), (1, 32768)]  # (batch, context)
ROTATION_BYTES = 256 << 20
GRAPH_CALLS = 32
MAX_ERROR = 1e-2
NEW_TOKENS = 128
CAPACITY_SEQS = 2048


def metadata(batch: int, context: int, first_block: int) -> AttentionMetadata:
    blocks = -(-context // BLOCK_SIZE)
    table = (torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
             + first_block).cuda()
    starts = list(range(batch + 1))
    return AttentionMetadata(
        num_reqs=batch, num_tokens=batch, max_query_len=1, max_seq_len=context,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_table=table, slot_mapping=torch.zeros(batch, dtype=torch.long, device="cuda"),
        query_start_loc_cpu=starts, seq_lens_cpu=[context] * batch)


def quantised_cache(num_blocks: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache of ``num_blocks`` blocks of random normal K/V, as ``dtype`` stores it."""
    from kvserve.attention.kv_quant import quantize_kv

    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if dtype == torch.bfloat16:
        return torch.randn(shape, dtype=dtype, device="cuda"), None
    cache = torch.empty(shape, dtype=dtype, device="cuda")
    if dtype == torch.int8:
        scales = torch.empty((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS), device="cuda")
    else:
        scales = torch.full((2, NUM_KV_HEADS), 0.02, device="cuda")
    step = 4096  # blocks quantised at a time, to bound the float32 temporaries
    for start in range(0, num_blocks, step):
        for i in (0, 1):
            x = torch.randn((min(step, num_blocks - start) * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                            device="cuda")
            values, token_scales = quantize_kv(x, dtype, scales[i] if dtype != torch.int8
                                               else None)
            cache[i, start:start + step] = values.view(-1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            if token_scales is not None:
                scales[i, start:start + step] = token_scales.view(-1, BLOCK_SIZE, NUM_KV_HEADS)
    return cache, scales


def kernel_rows(copy_gb_s: float) -> list[dict[str, Any]]:
    from kvserve.bench.device_rates import graph_call_us
    from kvserve.kernels.paged_attention import decode_attention

    rows = []
    for batch, context in KERNEL_CASES:
        blocks = batch * -(-context // BLOCK_SIZE)
        base_us = None
        for name, dtype in KV_DTYPES.items():
            per_token = NUM_KV_HEADS * 2 * (HEAD_DIM * dtype.itemsize
                                            + (4 if dtype == torch.int8 else 0))
            kv_bytes = batch * context * per_token
            rotations = max(1, min(4, -(-ROTATION_BYTES // kv_bytes)))
            cache, scales = quantised_cache(1 + rotations * blocks, dtype)
            tables = [metadata(batch, context, 1 + r * blocks) for r in range(rotations)]
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            md = tables[0]

            def call(i: int, cache: torch.Tensor = cache, scales: torch.Tensor | None = scales,
                     q: torch.Tensor = q, tables: list[AttentionMetadata] = tables
                     ) -> torch.Tensor:
                t = tables[i % len(tables)]
                return decode_attention(q, cache, t.query_start_loc, t.seq_lens, t.block_table,
                                        t.max_seq_len, HEAD_DIM ** -0.5, kv_scales=scales)

            us = graph_call_us(call, GRAPH_CALLS, 5)
            ref = paged_attention_ref(q, cache, md, HEAD_DIM ** -0.5, None, scales).float()
            error = float(((call(0).float() - ref).norm() / ref.norm()).item())
            base_us = base_us or us
            rows.append({"batch": batch, "context": context, "kv_cache_dtype": name,
                         "us": us, "kv_gb_s": kv_bytes / us / 1e3,
                         "kv_share_of_copy": kv_bytes / us / 1e3 / copy_gb_s,
                         "speedup_vs_bf16": base_us / us, "rel_error_vs_reference": error})
            print(f"decode kernel batch {batch:3d} x {context:6d} {name:9s} {us:9.1f} µs "
                  f"{kv_bytes / us / 1e3:7.0f} GB/s  {base_us / us:5.2f}x bf16  "
                  f"err {error:.1e}", flush=True)
            del cache, scales
            torch.cuda.empty_cache()
    return rows


def bench_latency(model: str, kv_cache_dtype: str, batch: int, input_len: int,
                  output_len: int, max_model_len: int, iters: int,
                  max_num_seqs: int) -> dict[str, Any]:
    """One ``kvserve bench latency`` run in its own process: its JSON, or the error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "latency.json"
        cmd = [sys.executable, "-m", "kvserve.cli", "bench", "latency", "--model", model,
               "--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype",
               "auto" if kv_cache_dtype == "bf16" else kv_cache_dtype,
               "--batch-size", str(batch), "--max-num-seqs", str(max_num_seqs),
               "--input-len", str(input_len), "--output-len", str(output_len),
               "--max-model-len", str(max_model_len), "--num-iters", str(iters),
               "--num-iters-warmup", "1", "--disable-tqdm", "--output-json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-3:]}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def engine_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    workloads = [
        # the pool as memory sizes it: max_num_seqs far above what fits, so it is no cap
        ("capacity", args.model, 1, 128, 16, args.context, CAPACITY_SEQS),
        ("decode", args.model, args.batch, args.context - NEW_TOKENS, NEW_TOKENS, args.context,
         args.batch),
        ("w1-long", args.long_model, 1, args.long_prompt, 256, args.long_prompt + 256, 1),
    ]
    for workload, model, batch, input_len, output_len, max_len, seqs in workloads:
        if workload not in args.workloads:
            continue
        base = None
        for name in KV_DTYPES:
            result = bench_latency(model, name, batch, input_len, output_len, max_len,
                                   args.num_iters, seqs)
            row: dict[str, Any] = {"workload": workload, "model": model, "batch": batch,
                                   "input_len": input_len, "output_len": output_len,
                                   "kv_cache_dtype": name}
            if "error" in result:
                row["error"] = result["error"]
            else:
                stats = result.get("engine_stats", {})
                row |= {"decode_tok_s": result.get("decode_tok_s"),
                        "mean_tpot_ms": result.get("mean_tpot_ms"),
                        "mean_ttft_ms": result.get("mean_ttft_ms"),
                        "mean_e2e_ms": result.get("mean_e2e_ms"),
                        "mbu_vs_copy": result.get("mbu_vs_copy"),
                        "kv_capacity_tokens": stats.get("kv_blocks_total", 0) * BLOCK_SIZE,
                        "card": result.get("card"), "copy_gb_s": result.get("copy_gb_s")}
                if name == "bf16":
                    base = row
                elif base is not None and base.get("mean_tpot_ms") and row.get("mean_tpot_ms"):
                    row["tpot_speedup_vs_bf16"] = base["mean_tpot_ms"] / row["mean_tpot_ms"]
                    row["capacity_vs_bf16"] = (row["kv_capacity_tokens"]
                                               / max(1, base["kv_capacity_tokens"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["kernels", "engine"],
                        choices=["kernels", "engine"])
    parser.add_argument("--model", default="llama-3-8b", help="the decode workload's model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--long-model", default="llama-3.1-8b",
                        help="W1's model (needs the long prompt's positions)")
    parser.add_argument("--long-prompt", type=int, default=32768)
    parser.add_argument("--num-iters", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["capacity", "decode", "w1-long"],
                        choices=["capacity", "decode", "w1-long"],
                        help="the engine part's runs (each takes 1-3 minutes per KV dtype)")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    from kvserve.bench.device_rates import copy_rate_gb_s, cuda_card

    card = cuda_card()
    if card is None:
        return 2
    copy_gb_s = copy_rate_gb_s()
    print(f"{card}: device-to-device copy {copy_gb_s:,.0f} GB/s")
    report: dict[str, Any] = {"card": card, "copy_gb_s": copy_gb_s, "torch": torch.__version__}
    failed = False
    if "kernels" in args.parts:
        report["kernels"] = kernel_rows(copy_gb_s)
        failed = any(not r["rel_error_vs_reference"] < MAX_ERROR for r in report["kernels"])
    if "engine" in args.parts:
        report["engine"] = engine_rows(args)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        print(f"FAILED: a kernel output differs from the reference by {MAX_ERROR:.0e} or more")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
