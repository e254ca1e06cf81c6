"""Triton attention kernels against the torch reference on the GPU, at
llama-3-8b attention shapes (32 heads, 8 KV heads, head_dim 128, block
size 16, bf16), for batch 1 / 32 / 128 and contexts 256 / 1k / 4k / 16k.

- decode: one new token per request over a context of ``context`` tokens
  (``decode_attention``, split-K);
- prefill: a chunked-prefill step of at most 8,192 new tokens in all: each
  request's last ``min(context, 8192 // batch)`` tokens are new
  (``prefill_attention``).

The triton kernels are timed as a decode step runs them: back to back in a
CUDA graph (``graph_call_us``), the calls rotating over disjoint block
ranges of the cache (``ROTATION_BYTES`` of KV at least, several times the
L2) so each reads its KV from HBM and no launch time is counted. The torch
reference is timed alone between L2 flushes (CUDA events, median). Prints
µs per call, effective GB/s of KV read (and its share of the copy rate
measured in the same run) and TFLOP/s for prefill; the reference runs
where its float32 score matrix stays small. It checks every triton output
against the reference it ran (relative error below 1e-2) and exits 1 on a
mismatch, so one command both measures and checks.

    python benchmarks/attention_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_ref import paged_attention_ref
from kvserve.bench.device_rates import copy_rate_gb_s, cuda_card, graph_call_us

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
STEP_TOKENS = 8192
REF_SCORE_BYTES_LIMIT = 4 << 30
MAX_ERROR = 1e-2
ROTATION_BYTES = 256 << 20
GRAPH_CALLS = 64


def time_us(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    """Median µs of ``iters`` calls, each after an L2 flush, by CUDA events."""
    fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def make_metadata(batch: int, query_len: int, context: int,
                  first_block: int = 1) -> AttentionMetadata:
    """``batch`` requests of ``context`` tokens, the last ``query_len`` new, with
    consecutive disjoint block ranges from ``first_block`` (block 0 is the null
    block)."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    block_table = (torch.arange(batch * blocks_per_req, dtype=torch.int32)
                   .view(batch, blocks_per_req) + first_block)
    starts = [i * query_len for i in range(batch + 1)]
    positions = torch.arange(context - query_len, context)
    slots = (block_table[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE
             + positions % BLOCK_SIZE).flatten()
    return AttentionMetadata(
        num_reqs=batch,
        num_tokens=batch * query_len,
        max_query_len=query_len,
        max_seq_len=context,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_table=block_table.cuda(),
        slot_mapping=slots.cuda(),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[context] * batch,
    )


def run_case(kind: str, batch: int, context: int, kv_cache: torch.Tensor,
             flush: torch.Tensor, copy_gb_s: float) -> dict[str, float | int | str | None]:
    from kvserve.kernels.paged_attention import decode_attention, prefill_attention

    query_len = 1 if kind == "decode" else min(context, STEP_TOKENS // batch)
    md = make_metadata(batch, query_len, context)
    q = torch.randn(md.num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM ** -0.5
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * kv_cache.element_size()
    blocks = batch * -(-context // BLOCK_SIZE)
    rotations = max(1, min(-(-ROTATION_BYTES // kv_bytes), (kv_cache.shape[1] - 1) // blocks))
    tables = [make_metadata(batch, query_len, context, 1 + r * blocks).block_table
              for r in range(rotations)]

    def triton_call(block_table: torch.Tensor) -> torch.Tensor:
        if kind == "decode":
            return decode_attention(q, kv_cache, md.query_start_loc, md.seq_lens,
                                    block_table, md.max_seq_len, scale)
        return prefill_attention(q, kv_cache, md.query_start_loc, md.seq_lens,
                                 block_table, md.max_query_len, scale)

    triton_us = graph_call_us(lambda i: triton_call(tables[i % rotations]), GRAPH_CALLS, 5)
    # causal (query, key) pairs: each new token sees the prefix and the new tokens before it
    pairs = batch * (query_len * (context - query_len) + query_len * (query_len + 1) // 2)
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    row: dict[str, float | int | str | None] = {
        "kind": kind, "batch": batch, "context": context, "new_tokens_per_req": query_len,
        "triton_us": triton_us, "kv_gb_s": kv_bytes / triton_us / 1e3,
        "kv_share_of_copy": kv_bytes / triton_us / 1e3 / copy_gb_s,
        "tflop_s": flops / triton_us / 1e6, "torch_us": None, "speedup": None, "error": None,
    }
    largest_scores = NUM_HEADS * query_len * context * 4
    if largest_scores <= REF_SCORE_BYTES_LIMIT:
        ref = paged_attention_ref(q, kv_cache, md, scale, None).float()
        out = triton_call(md.block_table).float()
        row["error"] = ((out - ref).norm() / ref.norm()).item()
        torch_us = time_us(lambda: paged_attention_ref(q, kv_cache, md, scale, None),
                           3 if batch * context > 100_000 else 10, flush)
        row["torch_us"], row["speedup"] = torch_us, torch_us / triton_us
    return row


def fmt(value: float | int | str | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    card = cuda_card()
    if card is None:
        return 2
    copy_gb_s = copy_rate_gb_s()
    num_blocks = max(args.batches) * -(-max(args.contexts) // BLOCK_SIZE) + 1
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache = torch.empty(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                           device="cuda").normal_()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"{card}: device-to-device copy {copy_gb_s:,.0f} GB/s; llama-3-8b attention "
          f"(H={NUM_HEADS}, KVH={NUM_KV_HEADS}, D={HEAD_DIM}, block {BLOCK_SIZE}, bf16)")
    header = (f"{'kind':8} {'batch':>5} {'context':>7} {'new/req':>7} {'triton µs':>10} "
              f"{'KV GB/s':>8} {'of copy':>7} {'TFLOP/s':>8} {'torch µs':>10} {'speed-up':>8} "
              f"{'rel err':>8}")
    print(header)
    rows = []
    failed = False
    for kind in ("decode", "prefill"):
        for batch in args.batches:
            for context in args.contexts:
                row = run_case(kind, batch, context, kv_cache, flush, copy_gb_s)
                rows.append(row)
                error = row["error"]
                bad = isinstance(error, float) and not error < MAX_ERROR
                failed |= bad
                print(f"{kind:8} {batch:5d} {context:7d} {row['new_tokens_per_req']:7d} "
                      f"{fmt(row['triton_us'], '10.1f')} {fmt(row['kv_gb_s'], '8.0f')} "
                      f"{fmt(row['kv_share_of_copy'], '7.0%')} {fmt(row['tflop_s'], '8.1f')} "
                      f"{fmt(row['torch_us'], '10.1f')} {fmt(row['speedup'], '7.1f'):>7}x "
                      f"{fmt(error, '8.1e')}{'  MISMATCH' if bad else ''}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "copy_gb_s": copy_gb_s, "rows": rows}, f, indent=2)
    if failed:
        print(f"FAILED: a triton result differs from the reference by {MAX_ERROR:.0e} or more")
        return 1
    print("all checked results within", MAX_ERROR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
