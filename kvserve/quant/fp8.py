"""FP8 (e4m3) W8A8 arithmetic in plain torch: the oracle of the CUDA path.

- Weights: ``torch.float8_e4m3fn`` values of w / scale[row], one float32
  scale per output channel, ``amax / 448`` of the row (``quantize_weight``).
- Activations: dynamic, one float32 scale per token (row of x), ``amax /
  448``; values e4m3(clamp(x / scale, +-448)), rounded to nearest even
  (``quantize_per_token``); a row of zeros gets scale 0 and zeros.
- The product: e4m3 values multiplied exactly and summed in float32, then
  times the token's scale and the channel's scale, plus the bias, in the
  activations' dtype (``fp8_linear_reference``): what ``torch._scaled_mm``
  with row-wise scales computes on Hopper, up to the order of the sum.

The Triton per-token quantiser (``kernels/fp8_quant.py``) writes bit-equal
values and scales. Owns no layer state (``quant/methods.py``'s
``Fp8LinearMethod`` does).
"""

from __future__ import annotations

import torch

from kvserve.quant.scales import absmax_scales

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    scales = absmax_scales(x, FP8_MAX, keepdim=True)  # [rows, 1]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (x / safe).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``[N, K]``, float32 ``[N, 1]`` per-channel scales) of a 16- or 32-bit
    ``weight [N, K]``."""
    return _quantize_rows(weight)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``[M, K]``, float32 ``[M, 1]`` per-token scales) of activations ``x [M, K]``."""
    return _quantize_rows(x)


def fp8_linear_reference(
    x: torch.Tensor,  # [..., K]
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn
    scales: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [..., N] in x's dtype
    """``x @ w.T + bias`` with x quantised per token and w per channel (FP8 W8A8)."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scales = quantize_per_token(rows)
    out = (xq.float() @ qweight.float().t()) * x_scales * scales.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
