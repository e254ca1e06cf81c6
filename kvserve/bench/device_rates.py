"""The two rates every speed figure is reported against, measured in the same
run: the device-to-device copy rate (bytes read + written per second, the
practical ceiling for MBU) and the matmul rate of a square product in the
dtype the model runs in (bf16 for the GPU figures; the practical ceiling
for MFU). They run on CUDA or on the CPU; the CPU uses smaller sizes so the
measurement takes a second, not minutes. ``fp8_matmul_tflop_s`` measures the
FP8 rate of a CUDA card that has one (``kvserve plan --calibrate``).
``graph_call_us`` times one kernel
call inside a CUDA graph, as a decode step replays it; it, ``cuda_card`` and
``LLAMA3_8B_LINEARS`` serve the kernel benchmarks under ``benchmarks/``.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvserve.plan.gpus import gpu_for_device_name

if TYPE_CHECKING:
    import torch

# the llama-3-8b linears a decode step multiplies by, name: (N, K) of the weight [N, K]
LLAMA3_8B_LINEARS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336), "lm_head": (128256, 4096)}

# (copy bytes, matmul size) per device type
_SIZES = {"cuda": (1 << 30, 8192), "cpu": (1 << 26, 1024)}


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_card() -> str | None:
    """The CUDA card's name, with torch's generator seeded for a repeatable
    benchmark; None, said on stderr, where there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return None
    torch.manual_seed(0)
    return torch.cuda.get_device_name()


def graph_call_us(call: Callable[[int], object], calls: int = 64, replays: int = 10) -> float:
    """µs per call of ``call(i)``, ``i`` in ``range(calls)``, captured back to
    back in one CUDA graph and replayed ``replays`` times (``i`` lets a call
    rotate over inputs, e.g. weights larger than L2 in all)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and pick kernels outside the capture
        for i in range(min(calls, 3)):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / (replays * calls)


def copy_rate_gb_s(num_bytes: int | None = None, iters: int = 10,
                   device: str | torch.device = "cuda") -> float:
    """Device-to-device copy on ``device``, GB/s read + written."""
    import torch

    device = torch.device(device)
    num_bytes = num_bytes or _SIZES[device.type][0]
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * num_bytes * iters / (time.perf_counter() - start) / 1e9


def matmul_tflop_s(size: int | None = None, iters: int = 10, device: str | torch.device = "cuda",
                   dtype: torch.dtype | None = None) -> float:
    """Square ``size``^3 matmul rate on ``device`` in ``dtype`` (bf16 by default), TFLOP/s."""
    import torch

    device = torch.device(device)
    size = size or _SIZES[device.type][1]
    dtype = dtype or torch.bfloat16
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * size**3 * iters / (time.perf_counter() - start) / 1e12


def fp8_matmul_tflop_s(size: int = 8192, iters: int = 10) -> float | None:
    """Square ``size``^3 FP8 (e4m3) matmul rate through ``torch._scaled_mm`` on the
    current CUDA card, TFLOP/s; None where the card or torch has no FP8 matmul."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return None
    device = torch.device("cuda")
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()  # column-major
    scale = torch.ones((), device=device)

    def product() -> object:
        return torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)

    try:
        product()
    except (RuntimeError, AttributeError):
        return None
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        product()
    _sync(device)
    return 2 * size**3 * iters / (time.perf_counter() - start) / 1e12


@dataclass(frozen=True)
class DeviceRates:
    """What one run measured on its device, and the card's spec-sheet bandwidth
    (``kvserve/plan/gpus.py``) when the card is in that table."""

    card: str
    copy_gb_s: float
    matmul_tflop_s: float
    matmul_dtype: str
    spec_bandwidth_gb_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_name(device: torch.device) -> str:
    """The CUDA card's name, or the CPU's architecture and thread count."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU {platform.machine()}, {threads} thread{'s' if threads != 1 else ''}"


def measure_rates(device: str | torch.device, dtype: torch.dtype) -> DeviceRates:
    """Both rates on ``device`` (the matmul in ``dtype``), then free what they used."""
    import torch

    device = torch.device(device)
    copy_gb_s = copy_rate_gb_s(device=device)
    tflop_s = matmul_tflop_s(device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    card = device_name(device)
    spec = gpu_for_device_name(card) if device.type == "cuda" else None
    return DeviceRates(card=card, copy_gb_s=copy_gb_s, matmul_tflop_s=tflop_s,
                       matmul_dtype=str(dtype).removeprefix("torch."),
                       spec_bandwidth_gb_s=spec.bandwidth_gb_s if spec else None)
