"""The batched LoRA kernels (``kvserve/kernels/lora.py``) on the GPU, beside
the base GEMM they ride on, at Llama-3-8B's packed shapes (qkv, o_proj,
gate_up, down; bf16): for each token count and rank, the µs of one shrink
+ expand pair (gathered form for up to 256 one-token requests, segmented
for every count) with ``--num-loras`` adapters spread round-robin over the
tokens, the µs of the base ``F.linear``, and the torch reference path
(per adapter ``index_select`` / two matmuls / ``index_add_``, eager: it
cannot be captured). Kernel and base times are per call inside a CUDA graph
(``graph_call_us``); the torch path is timed with events over 20 calls.
The per-token budget the issue sets (LoRA at >= 0.8x the base's speed)
means the pair's µs should stay under a quarter of the base's.

    PYTHONPATH=. python benchmarks/lora_kernels.py [--num-loras 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.bench.device_rates import graph_call_us
from kvserve.kernels.lora import SPLIT_K, lora_expand, lora_shrink, num_tiles
from kvserve.lora.manager import write_segments

SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o_proj": (4096, [4096]),
          "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}
TOKENS = (1, 8, 64, 256, 1024, 4096)
RANKS = (8, 16, 32, 64)
DTYPE = torch.bfloat16


def _indices(num_tokens: int, num_loras: int, form: str) -> dict[str, torch.Tensor]:
    slots = np.arange(num_tokens, dtype=np.int32) % num_loras
    if form == "gathered":
        return {"token_slots": torch.tensor(slots, device="cuda")}
    sorted_ids = np.zeros(num_tokens, dtype=np.int32)
    tiles = np.zeros((3, num_tiles(num_tokens, num_loras)), dtype=np.int32)
    write_segments(slots, num_loras, sorted_ids, tiles)
    return {"sorted_ids": torch.tensor(sorted_ids, device="cuda"),
            "tiles": torch.tensor(tiles, device="cuda")}


def _base(x: torch.Tensor, weight: torch.Tensor, _: int) -> torch.Tensor:
    return F.linear(x, weight)


def _pair(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, shrunk: torch.Tensor,
          out: torch.Tensor, slices: torch.Tensor, max_size: int,
          indices: dict[str, torch.Tensor], _: int) -> None:
    lora_shrink(x, a, shrunk, **indices)
    lora_expand(shrunk, b, out, slices, max_size, **indices)


def _torch_path_us(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   sizes: list[int], num_loras: int) -> float:
    slots = torch.arange(x.shape[0], device="cuda") % num_loras
    rows = [torch.nonzero(slots == s).flatten() for s in range(num_loras)]
    offsets = np.cumsum([0, *sizes])

    def step() -> None:
        for slot, r in enumerate(rows):
            if not len(r):
                continue
            rx = x.index_select(0, r)
            deltas = [(rx @ a[i, slot].T) @ b[slot, offsets[i]:offsets[i + 1]].T
                      for i in range(len(sizes))]
            out.index_add_(0, r, torch.cat(deltas, dim=1))

    step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-loras", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name, (k, sizes) in SHAPES.items():
        n = sum(sizes)
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5
        slices = torch.tensor([np.cumsum([0, *sizes])[:-1].tolist(), sizes],
                              dtype=torch.int32, device="cuda")
        for rank in RANKS:
            a = torch.randn(len(sizes), args.num_loras, rank, k, device="cuda",
                            dtype=DTYPE) / k ** 0.5
            b = torch.randn(args.num_loras, n, rank, device="cuda", dtype=DTYPE) / rank ** 0.5
            shrunk = torch.empty(SPLIT_K, len(sizes), max(TOKENS), rank, device="cuda")
            for num_tokens in TOKENS:
                x = torch.randn(num_tokens, k, device="cuda", dtype=DTYPE)
                out = torch.randn(num_tokens, n, device="cuda", dtype=DTYPE)
                row = {"shape": name, "rank": rank, "num_tokens": num_tokens,
                       "base_us": graph_call_us(functools.partial(_base, x, weight), calls=16)}
                for form in ("gathered", "segmented"):
                    if form == "gathered" and num_tokens > 256:
                        continue
                    pair = functools.partial(_pair, x, a, b, shrunk, out, slices, max(sizes),
                                             _indices(num_tokens, args.num_loras, form))
                    row[f"{form}_us"] = graph_call_us(pair, calls=16)
                row["torch_path_us"] = _torch_path_us(x, a, b, out, sizes, args.num_loras)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| shape | rank | tokens | base µs | gathered µs | segmented µs | torch µs |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        gathered = f"{row['gathered_us']:.1f}" if "gathered_us" in row else "—"
        print(f"| {row['shape']} | {row['rank']} | {row['num_tokens']} | {row['base_us']:.1f} "
              f"| {gathered} | {row['segmented_us']:.1f} | {row['torch_path_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "num_loras": args.num_loras,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
