"""The gated-activation kernel ``silu_and_mul``: ``[..., 2d] -> [..., d]``,
``silu(gate) * up`` with ``gate`` the first half of the last dim, ``up`` the second.

With programmatic dependent launch (``kernels/pdl.py``, Hopper) a program
waits for the kernel that writes ``x`` and at once lets the next kernel
start: the down projection after it loads its first weight tiles while
this short pass runs.

Rounding is torch's for ``F.silu(gate) * up`` (``kvserve/layers/activation.py``,
the oracle): silu computed in float32 and rounded once to the dtype, then
the product of the two upcast 16-bit values computed in float32 and rounded
once. Grid ``(num_tokens, cdiv(d, BLOCK))``. The output is a new contiguous
tensor (torch.empty, so CUDA-graph capture works); nothing is read back to
the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.pdl import use_pdl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 1024


@triton.jit
def silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * D]
    out_ptr,  # [num_tokens, D] contiguous
    stride_x_token,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (kernels/pdl.py)
):
    if PDL:  # x is the previous kernel's output; the next may load its weights meanwhile
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = x_ptr + token * stride_x_token
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + D + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2d] -> [..., d] contiguous
    """``silu(x[..., :d]) * x[..., d:]`` into a new tensor."""
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x: shape {tuple(x.shape)}; expected [..., 2 * d]")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: dtype {x.dtype}; allowed: {DTYPES}")
    if x.stride(-1) != 1:
        raise ValueError(f"x: last-dimension stride {x.stride(-1)}; must be 1")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # a view for a 2-D x with any row stride; a copy only for unmergeable leading dims
    rows = x.reshape(-1, 2 * d)
    block = min(MAX_BLOCK, triton.next_power_of_2(d))
    pdl = use_pdl(x.device)
    silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
        rows, out, rows.stride(0),
        D=d,
        BLOCK=block,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
