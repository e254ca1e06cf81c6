"""INT8 W8A8 arithmetic in plain torch: the oracle of the CUDA path.

- Weights: int8 values round(w / scale[row]) in [-127, 127], ties to even,
  one float32 scale per output channel, ``amax / 127`` of the row
  (``quantize_weight``); a checkpoint's may also hold -128 (llm-compressor
  divides by 127.5), which the product takes as it is.
- Activations: dynamic, one float32 scale per token (row of x), ``amax /
  127``, values round(x / scale) in [-127, 127], ties to even
  (``quantize_per_token``); a row of zeros gets scale 0 and zeros.
- The product: int8 values multiplied and summed exactly into int32
  (``int8_matmul``: float32 GEMMs over chunks of columns small enough that
  every sum is an exact integer), then
  times the token's scale and the channel's scale in float32, plus the bias,
  cast to the activations' dtype (``int8_linear_reference``): what
  ``torch._int_mm`` and the epilogue of ``Int8W8A8LinearMethod`` compute on
  the GPU, bit for bit up to the float32 epilogue's rounding.

The Triton per-token quantiser (``kernels/fp8_quant.py``,
``per_token_quant_int8``) writes bit-equal values and scales. Owns no layer
state (``quant/methods.py``'s ``Int8W8A8LinearMethod`` does).
"""

from __future__ import annotations

import torch

from kvserve.quant.scales import absmax_scales

INT8_MAX = 127.0
# input columns whose int8 products sum exactly in float32: every partial sum
# is an integer of magnitude <= 1024 * 128 * 128 = 2**24
EXACT_FLOAT32_COLUMNS = 1024


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    scales = absmax_scales(x, INT8_MAX, keepdim=True)  # [rows, 1]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / safe).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[N, K]``, float32 ``[N, 1]`` per-channel scales) of a 16- or 32-bit
    ``weight [N, K]``."""
    return _quantize_rows(weight)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[M, K]``, float32 ``[M, 1]`` per-token scales) of activations ``x [M, K]``."""
    return _quantize_rows(x)


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """``xq [M, K] @ wq [N, K].T`` of int8 values, summed exactly into int32:
    float32 GEMMs over column chunks whose sums are exact (so the CPU's
    BLAS runs it; an int32 matmul is several times slower there)."""
    k = xq.shape[1]
    acc = torch.zeros(xq.shape[0], wq.shape[0], dtype=torch.int32, device=xq.device)
    for start in range(0, k, EXACT_FLOAT32_COLUMNS):
        stop = min(k, start + EXACT_FLOAT32_COLUMNS)
        acc += (xq[:, start:stop].float() @ wq[:, start:stop].float().t()).to(torch.int32)
    return acc


def scale_int32_product(
    acc: torch.Tensor,  # [M, N] int32
    x_scales: torch.Tensor,  # [M, 1] float32
    scales: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in dtype
    """The epilogue of an int8 GEMM: ``acc * x_scale * w_scale + bias`` in float32, cast."""
    out = acc.float() * x_scales * scales.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def int8_linear_reference(
    x: torch.Tensor,  # [..., K]
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [..., N] in x's dtype
    """``x @ w.T + bias`` with x quantised per token and w per channel (INT8 W8A8)."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scales = quantize_per_token(rows)
    acc = int8_matmul(xq, qweight)
    out = scale_int32_product(acc, x_scales, scales, bias, x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[0])
