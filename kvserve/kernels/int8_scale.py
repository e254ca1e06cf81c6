"""The epilogue of an INT8 W8A8 GEMM in one pass: ``torch._int_mm``'s int32
sums times each token's and each output channel's float32 scale, plus the
bias, cast to the activations' dtype.

Done in torch it is four or five elementwise passes over an ``[M, N]``
float32 tensor (as large as the GEMM's reads at prefill sizes); here each
int32 is read once and each output written once. The arithmetic is the
torch reference's (``kvserve/quant/int8.py``'s ``scale_int32_product``):
``(acc * x_scale) * w_scale`` in float32, then ``+ bias``, rounded to the
output dtype; only a fused multiply-add the compiler may form on the GPU
can differ in the last float32 bit. Rows past ``num_rows`` (zero rows a
small batch was padded with for ``torch._int_mm``) are not read. It owns
no allocation beyond its output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_N = 128


@triton.jit
def scale_int32_kernel(
    acc_ptr,  # [>= M, N] int32
    x_scale_ptr,  # [>= M] float32, one per token
    w_scale_ptr,  # [N] float32, one per output channel
    bias_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    M,
    N,
    stride_acc,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    acc = tl.load(acc_ptr + rows[:, None] * stride_acc + cols[None, :], mask=mask, other=0)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_int32(
    acc: torch.Tensor,  # [M', N] int32, M' >= num_rows
    x_scales: torch.Tensor,  # [M', 1] float32
    w_scales: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,  # [N]
    dtype: torch.dtype,
    num_rows: int,
) -> torch.Tensor:  # [num_rows, N] in dtype
    """``acc[:num_rows] * x_scales * w_scales.T + bias`` in float32, cast to ``dtype``."""
    if acc.dtype != torch.int32 or acc.dim() != 2 or acc.stride(1) != 1:
        raise ValueError(f"acc: expected a 2-D int32 tensor with a unit last stride, got "
                         f"{acc.dtype} of shape {tuple(acc.shape)}")
    rows, n = acc.shape
    if not 0 <= num_rows <= rows:
        raise ValueError(f"num_rows={num_rows}: expected 0..{rows} (acc's rows)")
    if x_scales.dtype != torch.float32 or x_scales.numel() < rows or not x_scales.is_contiguous():
        raise ValueError(f"x_scales: expected {rows} contiguous float32 values, got "
                         f"{x_scales.dtype} of shape {tuple(x_scales.shape)}")
    if w_scales.dtype != torch.float32 or w_scales.numel() != n or not w_scales.is_contiguous():
        raise ValueError(f"w_scales: expected {n} contiguous float32 values, got "
                         f"{w_scales.dtype} of shape {tuple(w_scales.shape)}")
    if bias is not None and (bias.numel() != n or not bias.is_contiguous()):
        raise ValueError(f"bias: expected {n} contiguous values, got shape {tuple(bias.shape)}")
    out = torch.empty((num_rows, n), dtype=dtype, device=acc.device)
    if num_rows == 0 or n == 0:
        return out
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    scale_int32_kernel[grid](
        acc, x_scales, w_scales, bias if bias is not None else w_scales, out, num_rows, n,
        acc.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, num_warps=4,
    )
    return out
