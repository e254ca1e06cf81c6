"""Dynamic per-token FP8 (e4m3) quantisation of activations, the input of an
FP8 W8A8 GEMM (``torch._scaled_mm`` with row-wise scales).

One program per row: the row's largest magnitude, its scale ``amax / 448``
(0 for a row of zeros), then its values e4m3(clamp(x / scale, +-448)),
rounded to nearest even in float32 (``kv_quant.round_to_e4m3``, as the KV
cache's writes do) with IEEE division, so the output is bit-equal to the
torch reference (``kvserve/quant/fp8.py``) on the GPU and under the
interpreter. It owns no allocation beyond its outputs and reads nothing but x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_quant import round_to_e4m3

FP8_MAX = tl.constexpr(448.0)
MAX_BLOCK = 4096  # columns a program holds at a time


@triton.jit
def per_token_quant_fp8_kernel(
    x_ptr,  # [num_rows, K]
    out_ptr,  # [num_rows, K] float8_e4m3fn
    scale_ptr,  # [num_rows] float32
    K,
    stride_x_row,
    stride_out_row,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # the row fits one block: keep it in registers
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x_row
    out_row = out_ptr + row * stride_out_row
    if ONE_PASS:
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        amax = 0.0
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
    scale = tl.math.div_rn(amax, FP8_MAX)
    tl.store(scale_ptr + row, scale)
    safe = tl.where(scale > 0.0, scale, 1.0)
    if ONE_PASS:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -FP8_MAX), FP8_MAX)
        tl.store(out_row + cols, round_to_e4m3(y).to(tl.float8e4nv), mask=cols < K)
    else:
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -FP8_MAX), FP8_MAX)
            tl.store(out_row + start + cols, round_to_e4m3(y).to(tl.float8e4nv), mask=mask)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``[M, K]``, float32 ``[M, 1]`` scales) of ``x [M, K]`` (16- or 32-bit,
    unit last stride)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with a unit last stride, got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x: dtype {x.dtype}; expected float16, bfloat16 or float32")
    num_rows, k = x.shape
    out = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out, scales
    block = min(triton.next_power_of_2(k), MAX_BLOCK)
    per_token_quant_fp8_kernel[(num_rows,)](
        x, out, scales, k, x.stride(0), out.stride(0), BLOCK=block, ONE_PASS=block >= k,
        num_warps=4 if block <= 2048 else 8,
    )
    return out, scales
