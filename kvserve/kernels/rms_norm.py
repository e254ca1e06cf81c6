"""RMSNorm kernels: ``rms_norm`` and ``add_rms_norm`` (residual add fused in).

One program per row (a token, or a (token, head) pair for Qwen3's per-head
q/k norm) holds the whole row in registers (``BLOCK`` = hidden rounded up to
a power of two), so each input is read once and each output written once.
The arithmetic is ``kvserve/layers/norm.py``'s (Hugging Face LlamaRMSNorm),
which stays the oracle, with torch's rounding of 16-bit ops:

- ``summed = residual + x``: added in float32, rounded once to the dtype;
- ``normed = (s32 * 1 / sqrt(mean(s32²) + eps))`` in float32 on the rounded
  sum ``s32``, rounded to the dtype;
- ``out = weight * normed``: both upcast, multiplied in float32, rounded once.

With programmatic dependent launch (``kernels/pdl.py``) a program loads the
weight, waits for the kernel that writes its input and lets the next kernel
start at once: a one-row norm is short, and the GEMM after it can load its
first weight tile meanwhile.

Outputs are new contiguous tensors (torch.empty, so CUDA-graph capture works);
inputs are never written and nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.pdl import use_pdl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [num_rows, num_cols, hidden]
    residual_ptr,  # [num_rows, num_cols, hidden], read only when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, num_cols, hidden] contiguous
    summed_ptr,  # [num_rows, num_cols, hidden] contiguous, written only when HAS_RESIDUAL
    eps,
    stride_x_row,
    stride_x_col,
    stride_res_row,
    stride_res_col,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (kernels/pdl.py)
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1)
    dims = tl.arange(0, BLOCK)
    mask = dims < HIDDEN
    out_offset = (row * tl.num_programs(1) + col) * HIDDEN + dims
    weight = tl.load(weight_ptr + dims, mask=mask, other=0.0)
    if PDL:  # the weight is constant; x is the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()  # one short pass: the next kernel may load its weights
    x = tl.load(x_ptr + row * stride_x_row + col * stride_x_col + dims, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_res_row + col * stride_res_col + dims,
                           mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(summed_ptr + out_offset, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / HIDDEN
    # correctly rounded sqrt and division: one scalar per row, so precision is free
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., hidden]`` -> ``[num_rows, num_cols, hidden]``: a view for 1-, 2- and 3-D
    inputs (a strided ``[num_tokens, heads, head_dim]`` view of a packed qkv stays a
    view), a copy only for more leading dims that cannot be merged."""
    if x.dim() >= 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x.reshape(-1, 1, x.shape[-1])


def _check(name: str, tensor: torch.Tensor, weight: torch.Tensor) -> None:
    hidden = weight.shape[0]
    if tensor.dim() == 0 or tensor.shape[-1] != hidden:
        raise ValueError(
            f"{name}: shape {tuple(tensor.shape)}; expected [..., hidden={hidden}] (the weight's)"
        )
    if tensor.dtype != weight.dtype or tensor.device != weight.device:
        raise ValueError(
            f"{name}: {tensor.dtype} on {tensor.device}; expected {weight.dtype} on "
            f"{weight.device} (the weight's)"
        )
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name}: last-dimension stride {tensor.stride(-1)}; must be 1")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if weight.dim() != 1 or weight.stride(0) != 1 or weight.dtype not in DTYPES:
        raise ValueError(
            f"weight: {weight.dtype} of shape {tuple(weight.shape)}, strides {weight.stride()}; "
            f"expected a contiguous [hidden] tensor of one of {DTYPES}"
        )
    _check("x", x, weight)
    if residual is not None:
        _check("residual", residual, weight)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual: shape {tuple(residual.shape)}; expected x's {tuple(x.shape)}"
            )
    x_rows = _as_rows(x)
    res_rows = x_rows if residual is None else _as_rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(out)
    num_rows, num_cols, hidden = x_rows.shape
    if out.numel() == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    pdl = use_pdl(x.device)
    rms_norm_kernel[(num_rows, num_cols)](
        x_rows, res_rows, weight, out, out if summed is None else summed, eps,
        x_rows.stride(0), x_rows.stride(1), res_rows.stride(0), res_rows.stride(1),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        PDL=pdl,
        num_warps=min(max(block // 256, 1), 8),
        launch_pdl=pdl,
    )
    return out, summed


def rms_norm(
    x: torch.Tensor,  # [..., hidden], unit last stride
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
) -> torch.Tensor:  # [..., hidden] contiguous
    """``weight * rmsnorm(x)`` over the last dim, into a new tensor."""
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor,  # [..., hidden], unit last stride
    residual: torch.Tensor,  # x's shape and dtype, unit last stride
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, summed), both contiguous
    """``summed = residual + x`` and ``weight * rmsnorm(summed)`` in one pass."""
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
