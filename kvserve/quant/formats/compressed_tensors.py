"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor) -> kvserve's layout.

A linear of ``N`` outputs, ``K`` inputs and ``G`` groups (``G = 1`` per
channel) is stored output-major; values are signed (``[-2**(bits-1),
2**(bits-1) - 1]``), offset by ``2**(bits-1)`` into unsigned and packed
lowest bits first into int32 words:

- ``weight_packed`` int32 ``[N, K * bits // 32]``, packed along K;
- ``weight_scale`` float ``[N, G]``;
- ``weight_zero_point`` (asymmetric only) int32 ``[N * bits // 32, G]``,
  packed along N with the same offset (compressed-tensors >= 0.9's
  ``pack_to_int32(..., packed_dim=0)``);
- ``weight_shape`` int ``[2]`` = ``(N, K)``;
- ``weight_g_idx`` int32 ``[K]`` (``actorder: group`` only, written by
  llm-compressor before it dropped that option).

The weight is ``(q - zero) * scale`` in the signed values, which is the same
in the offset ones: kvserve's unsigned values and zeros (the symmetric zero
being ``2**(bits-1)``) are the packed numbers as they are.
"""

from __future__ import annotations

import torch

from kvserve.quant.config import QuantConfig
from kvserve.quant.formats.tensors import (
    FLOAT_DTYPES,
    CheckpointFormat,
    Parts,
    act_order_perm,
    check_trivial_g_idx,
    effective_group_size,
    expect,
    packed_weight,
    unpack_int32,
)
from kvserve.quant.packing import QuantizedWeight

PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_INT_DTYPES = (torch.int32, torch.int64)


def required(config: QuantConfig) -> tuple[str, ...]:
    parts: tuple[str, ...] = ("weight_packed", "weight_scale", "weight_shape")
    parts += () if config.symmetric else ("weight_zero_point",)
    return parts + (("weight_g_idx",) if config.act_order else ())


def check_alone(part: str, tensor: torch.Tensor, config: QuantConfig, name: str) -> None:
    """A trivial ``weight_g_idx`` without act-order; a symmetric scheme's zero
    point (older versions wrote one) must be all zeros."""
    if part == "weight_g_idx":
        check_trivial_g_idx(tensor, config, name)
    elif bool((tensor != 0).any()):
        raise ValueError(f"checkpoint tensor '{name}': the scheme is symmetric, so its zero "
                         "point must be 0; found non-zero values")


def _shape(tensor: torch.Tensor, module: str) -> tuple[int, int]:
    name = f"{module}.weight_shape"
    expect(tensor, name, (2,), _INT_DTYPES)
    n, k = (int(v) for v in tensor.tolist())
    if n < 1 or k < 1:
        raise ValueError(f"checkpoint tensor '{name}': ({n}, {k}) is not a weight shape")
    return n, k


def convert(parts: Parts, config: QuantConfig, module: str) -> QuantizedWeight:
    """One linear's compressed-tensors tensors -> ``QuantizedWeight`` (shapes,
    dtypes checked)."""
    bits, per_word = config.bits, 32 // config.bits
    n, k = _shape(parts["weight_shape"], module)
    group_size = effective_group_size(config, k)
    if k % group_size or k % per_word:
        raise ValueError(
            f"checkpoint tensor '{module}.weight_shape': {k} input columns are not a multiple "
            f"of the group size {group_size} and of {per_word} (values per int32 word)")
    groups = k // group_size
    expect(parts["weight_packed"], f"{module}.weight_packed", (n, k // per_word), (torch.int32,))
    scales = parts["weight_scale"]
    expect(scales, f"{module}.weight_scale", (n, groups), FLOAT_DTYPES)
    zeros = None
    if not config.symmetric:
        packed_zeros = parts["weight_zero_point"]
        words = -(-n // per_word)
        expect(packed_zeros, f"{module}.weight_zero_point", (words, groups), (torch.int32,))
        zeros = unpack_int32(packed_zeros.T.contiguous(), bits)[:, :n].T  # [N, G]
    perm = None
    if config.act_order:
        perm = act_order_perm(parts["weight_g_idx"], k, group_size, f"{module}.weight_g_idx")
    q = unpack_int32(parts["weight_packed"], bits)
    return packed_weight(q, scales, zeros, bits, group_size, perm)


COMPRESSED_TENSORS = CheckpointFormat(
    parts=PARTS, required=required, check_alone=check_alone, convert=convert)
