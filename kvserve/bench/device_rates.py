"""The two rates every GPU figure is reported against, measured in the same
run: the device-to-device copy rate (bytes read + written per second, the
practical ceiling for MBU) and the bf16 matmul rate of an 8192^3 product
(the practical ceiling for MFU)."""

from __future__ import annotations

import time


def copy_rate_gb_s(num_bytes: int = 1 << 30, iters: int = 10) -> float:
    """Device-to-device copy on the current CUDA device, GB/s read + written."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * iters / (time.perf_counter() - start) / 1e9


def matmul_tflop_s(size: int = 8192, iters: int = 10) -> float:
    """bf16 matmul rate on the current CUDA device, TFLOP/s."""
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * iters / (time.perf_counter() - start) / 1e12
