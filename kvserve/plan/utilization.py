"""MBU and MFU: the one definition of each (../shared/BENCHMARKS.md), used by
``kvserve plan --measure`` and every ``kvserve bench`` figure.

- MBU = the bytes one decode step must read (every weight but an untied
  embedding table, plus the batch's KV: ``counts.decode_cost``) per second
  of step ÷ a bandwidth (the copy rate measured in the same run, or a spec
  sheet's).
- MFU = 2 × parameters × tokens/s ÷ a matmul rate (measured in the same run,
  in the dtype the model runs in).

Pure arithmetic in bytes, FLOPs and seconds; callers convert their units.
"""

from __future__ import annotations


def mbu(step_bytes: float, step_s: float, bandwidth_bytes_s: float) -> float:
    """Model bandwidth utilisation of steps of ``step_s`` seconds that must
    read ``step_bytes`` each."""
    return step_bytes / step_s / bandwidth_bytes_s


def mfu(params: int, tokens_s: float, matmul_flops_s: float) -> float:
    """Model FLOP utilisation: 2 × ``params`` × ``tokens_s`` ÷ the matmul rate."""
    return 2.0 * params * tokens_s / matmul_flops_s
