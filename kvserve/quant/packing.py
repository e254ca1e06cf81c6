"""kvserve's one layout of weight-only quantised linears, and its torch reference.

Every checkpoint format (GPTQ, AWQ, compressed-tensors) is converted at load
into ``QuantizedWeight``; the kernels of ``kernels/quant_matmul.py`` read
only this layout, and ``dequantize`` here is their oracle. Every tensor has
the output dimension ``N`` first, so a packed ``qkv_proj`` / ``gate_up_proj``
stacks its shards by rows, exactly as the 16-bit weights do.

For a weight ``W [N, K]`` with ``bits`` in (4, 8) and groups of ``group_size``
consecutive input columns (``group_size == K``: one scale per output row):

- ``qweight`` uint8: ``[N, K]`` for 8 bits; ``[N, K // 2]`` for 4 bits, input
  column ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in the high one;
- ``scales`` ``[N, K // group_size]`` in the model's dtype;
- ``zeros`` the same shape and dtype, integers in ``[0, 2**bits - 1]``
  (exact in bfloat16), or None for symmetric weights, whose zero point is
  ``2**(bits - 1)``;
- ``perm`` None, or ``[K]`` int64 for GPTQ's act-order: the layer's input is
  ``x[:, perm]``, so each group is ``group_size`` consecutive columns again.

Dequantised: ``W'[n, k] = (qweight[n, k] - zero[n, g]) * scales[n, g]`` with
``g = k // group_size``, in float32; the linear is ``x[:, perm] @ W'.T``.
Nothing here imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_BITS = (4, 8)


@dataclass
class QuantizedWeight:
    """One linear's weight in kvserve's packed layout (see the module docstring)."""

    qweight: torch.Tensor  # uint8 [N, K * bits // 8]
    scales: torch.Tensor  # [N, K // group_size]
    zeros: torch.Tensor | None  # [N, K // group_size] or None (symmetric)
    bits: int
    group_size: int  # K for one group per output row
    perm: torch.Tensor | None = None  # [K] int64, act-order only

    def __post_init__(self) -> None:
        if self.bits not in WEIGHT_BITS:
            raise ValueError(f"bits={self.bits}; allowed: {WEIGHT_BITS}")
        if self.qweight.dtype != torch.uint8 or self.qweight.dim() != 2:
            raise ValueError(f"qweight: {self.qweight.dtype} of shape "
                             f"{tuple(self.qweight.shape)}; expected a 2-D uint8 tensor")
        n, k = self.shape
        if self.group_size < 1 or k % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide the input size {k}")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups:
            raise ValueError(f"scales: shape {tuple(self.scales.shape)}; expected {groups}")
        if self.zeros is not None and (tuple(self.zeros.shape) != groups
                                       or self.zeros.dtype != self.scales.dtype):
            raise ValueError(f"zeros: {self.zeros.dtype} of shape {tuple(self.zeros.shape)}; "
                             f"expected {self.scales.dtype} of shape {groups}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm: shape {tuple(self.perm.shape)}; expected ({k},)")

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the dequantised weight."""
        n, packed = self.qweight.shape
        return n, packed * 8 // self.bits

    @property
    def symmetric(self) -> bool:
        return self.zeros is None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers in ``[0, 15]`` -> uint8 ``[N, K // 2]`` (even column low)."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even input size; got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed ``qweight`` -> uint8 ``[N, K]`` of quantised values."""
    if bits == 8:
        return qweight
    low, high = qweight & 0xF, qweight >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def zero_points(qw: QuantizedWeight) -> torch.Tensor:
    """``[N, K // group_size]`` zero points in the scales' dtype (the midpoint if symmetric)."""
    if qw.zeros is not None:
        return qw.zeros
    return torch.full_like(qw.scales, 2 ** (qw.bits - 1))


def dequantize(qw: QuantizedWeight, original_order: bool = False) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the kernels multiply by: columns in the
    kernel's (permuted) order, or with ``original_order`` in the checkpoint's,
    so that ``x @ W.T`` is the linear."""
    q = unpack(qw.qweight, qw.bits).float()
    scales = qw.scales.float().repeat_interleave(qw.group_size, dim=1)
    zeros = zero_points(qw).float().repeat_interleave(qw.group_size, dim=1)
    weight = (q - zeros) * scales
    if original_order and qw.perm is not None:
        unpermuted = torch.empty_like(weight)
        unpermuted[:, qw.perm] = weight
        return unpermuted
    return weight


def quantized_linear_reference(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W'.T + bias`` in float32 over the permuted input, cast to ``x``'s dtype:
    the arithmetic the kernels round like (one rounding, at the output)."""
    if qw.perm is not None:
        x = x.index_select(-1, qw.perm)
    out = x.float() @ dequantize(qw).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True,
    scale_dtype: torch.dtype | None = None,
) -> QuantizedWeight:
    """Round-to-nearest quantisation of ``weight [N, K]`` (``group_size`` -1: one
    group per row), as compressed-tensors does it: symmetric scales are
    ``absmax / ((2**bits - 1) / 2)``, asymmetric ones ``(max - min) / (2**bits - 1)``
    with the zero point rounded into range. Scales are stored in ``scale_dtype``
    (default: the weight's), and rounding uses the stored scale."""
    if bits not in WEIGHT_BITS:
        raise ValueError(f"bits={bits}; allowed: {WEIGHT_BITS}")
    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size} must divide the input size {k}")
    scale_dtype = scale_dtype or weight.dtype
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    max_q = 2**bits - 1
    if symmetric:
        amax = w.abs().amax(dim=-1)
        scales = (amax / (max_q / 2)).clamp(min=torch.finfo(torch.float16).tiny)
        scales = scales.to(scale_dtype).float()
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        w_min = w.amin(dim=-1).clamp(max=0.0)
        w_max = w.amax(dim=-1).clamp(min=0.0)
        scales = ((w_max - w_min) / max_q).clamp(min=torch.finfo(torch.float16).tiny)
        scales = scales.to(scale_dtype).float()
        zeros = torch.round(-w_min / scales).clamp(0, max_q)
    q = torch.round(w / scales[..., None] + zeros[..., None]).clamp(0, max_q).to(torch.uint8)
    q = q.reshape(n, k)
    return QuantizedWeight(
        qweight=pack_int4(q) if bits == 4 else q,
        scales=scales.to(scale_dtype),
        zeros=None if symmetric else zeros.to(scale_dtype),
        bits=bits,
        group_size=group_size,
    )
