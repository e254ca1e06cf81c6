"""Greedy decoding's row argmax on the GPU: ``torch.argmax(x, dim=-1)`` (one
thread block a row) against the two-pass Triton ``argmax_rows``
(``kvserve/kernels/argmax.py``) at its default chunk and at other chunk
sizes, for 1, 8, 64 and 256 rows of Llama-3's 128,256-column float32 logits.

Each candidate is timed inside a CUDA graph of ``CALLS_PER_GRAPH``
back-to-back calls on the same input, replayed ``REPLAYS`` times (so launch
gaps are the graph's, as in a decode step); inputs up to a few MB stay in L2
across the calls, as logits the LM head has just written do. Every kernel
result is checked against ``torch.argmax`` (random rows, then tie-heavy
ones); the script exits 1 on a mismatch. One line per case as it runs, then
one markdown table last.

    PYTHONPATH=. python benchmarks/argmax.py
"""

from __future__ import annotations

import functools
import sys

import torch

from kvserve.bench.device_rates import cuda_card, graph_call_us
from kvserve.kernels.argmax import CHUNK, argmax_rows

VOCAB_SIZE = 128256
ROWS = (1, 8, 64, 256)
CHUNKS = tuple(sorted({1024, 2048, 4096, 8192, CHUNK}))
CALLS_PER_GRAPH = 64
REPLAYS = 10


def call_torch(x: torch.Tensor, _: int) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


def call_kernel(x: torch.Tensor, chunk: int, _: int) -> torch.Tensor:
    return argmax_rows(x, chunk)


def matches(x: torch.Tensor, chunk: int) -> bool:
    """The kernel equals torch.argmax on ``x`` and on a tie-heavy copy of it."""
    ties = x.mul(0.7).round().clamp(-2, 2)
    ties[:, -1] = 2.0
    return all(torch.equal(argmax_rows(v, chunk), v.argmax(dim=-1)) for v in (x, ties))


def main() -> int:
    card = cuda_card()
    if card is None:
        return 2
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{card} ({num_sms} SMs): [R, {VOCAB_SIZE}] float32, {CALLS_PER_GRAPH} calls a "
          f"graph, {REPLAYS} replays; default chunk {CHUNK}", flush=True)
    results: list[tuple[int, float, dict[int, float]]] = []
    all_match = True
    for num_rows in ROWS:
        x = torch.randn(num_rows, VOCAB_SIZE, device="cuda")
        torch_us = graph_call_us(functools.partial(call_torch, x), CALLS_PER_GRAPH, REPLAYS)
        kernel_us: dict[int, float] = {}
        for chunk in CHUNKS:
            ok = matches(x, chunk)
            all_match &= ok
            kernel_us[chunk] = graph_call_us(functools.partial(call_kernel, x, chunk),
                                             CALLS_PER_GRAPH, REPLAYS)
            print(f"  R={num_rows:<3d} chunk {chunk:<5d} {kernel_us[chunk]:7.2f} µs "
                  f"(torch {torch_us:7.2f} µs){'' if ok else '  MISMATCH'}", flush=True)
        results.append((num_rows, torch_us, kernel_us))
    print(f"\n{card}; µs per call; speed-up = torch µs / default-chunk µs\n")
    print("| R | torch.argmax µs | argmax_rows µs (chunk " + str(CHUNK) + ") | speed-up | "
          + " | ".join(f"chunk {c} µs" for c in CHUNKS) + " |")
    print("|---:|---:|---:|---:|" + "---:|" * len(CHUNKS))
    for num_rows, torch_us, kernel_us in results:
        print(f"| {num_rows} | {torch_us:.2f} | {kernel_us[CHUNK]:.2f} "
              f"| {torch_us / kernel_us[CHUNK]:.2f}x | "
              + " | ".join(f"{kernel_us[c]:.2f}" for c in CHUNKS) + " |")
    if not all_match:
        print("\nFAILED: argmax_rows differs from torch.argmax")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
