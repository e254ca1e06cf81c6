"""Dynamic per-token quantisation of activations to FP8 (e4m3) or INT8, the
input of a W8A8 GEMM (``torch._scaled_mm`` with row-wise scales for FP8,
``torch._int_mm`` for INT8).

One program per row: the row's largest magnitude, its scale ``amax / QMAX``
(448 for e4m3, 127 for int8; 0 for a row of zeros), then its values
quantised from float32 by ``kv_quant.to_cache`` (the KV cache's writes use
the same code): e4m3(clamp(x / scale, +-448)) rounded to nearest even, or
round(clamp(x / scale, +-127)) ties to even, with IEEE division, so the
output is bit-equal to the torch references (``kvserve/quant/fp8.py``,
``kvserve/quant/int8.py``) on the GPU and under the interpreter. It owns no
allocation beyond its outputs and reads nothing but x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_quant import KV_FP8, KV_INT8, abs_max, to_cache

MAX_BLOCK = 4096  # columns a program holds at a time
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


@triton.jit
def per_token_quant_kernel(
    x_ptr,  # [num_rows, K]
    out_ptr,  # [num_rows, K] float8_e4m3fn or int8
    scale_ptr,  # [num_rows] float32
    K,
    stride_x_row,
    stride_out_row,
    QMAX: tl.constexpr,
    QUANT: tl.constexpr,  # kv_quant's KV_FP8 or KV_INT8
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
        amax = abs_max(x, mask)
    else:
        amax = 0.0
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, abs_max(x, mask))
    scale = tl.math.div_rn(amax, QMAX)
    tl.store(scale_ptr + row, scale)
    safe = tl.where(scale > 0.0, scale, 1.0)
    if ONE_PASS:
        tl.store(out_row + cols, to_cache(x, safe, out_ptr, QUANT), mask=cols < K)
    else:
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + start + cols, to_cache(x, safe, out_ptr, QUANT), mask=mask)


def _per_token_quant(
    x: torch.Tensor, dtype: torch.dtype, num_rows_padded: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with a unit last stride, got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x: dtype {x.dtype}; expected float16, bfloat16 or float32")
    num_rows, k = x.shape
    rows_out = num_rows if num_rows_padded is None else max(num_rows, num_rows_padded)
    alloc = torch.zeros if rows_out > num_rows else torch.empty
    out = alloc((rows_out, k), dtype=dtype, device=x.device)
    scales = alloc((rows_out, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out, scales
    block = min(triton.next_power_of_2(k), MAX_BLOCK)
    per_token_quant_kernel[(num_rows,)](
        x, out, scales, k, x.stride(0), out.stride(0), QMAX=QMAX[dtype],
        QUANT=KV_FP8 if dtype == torch.float8_e4m3fn else KV_INT8, BLOCK=block,
        ONE_PASS=block >= k, num_warps=4 if block <= 2048 else 8,
    )
    return out, scales


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``[M, K]``, float32 ``[M, 1]`` scales) of ``x [M, K]`` (16- or 32-bit,
    unit last stride)."""
    return _per_token_quant(x, torch.float8_e4m3fn)


def per_token_quant_int8(
    x: torch.Tensor, num_rows_padded: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[M', K]``, float32 ``[M', 1]`` scales) of ``x [M, K]`` (16- or 32-bit,
    unit last stride); ``M' = max(M, num_rows_padded)``, the rows past ``M``
    zeros (for a GEMM that needs more rows than the batch has)."""
    return _per_token_quant(x, torch.int8, num_rows_padded)
