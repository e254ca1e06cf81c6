"""GPTQ checkpoints (GPTQModel, AutoGPTQ) -> kvserve's packed layout.

A GPTQ linear of ``K`` inputs, ``N`` outputs and ``G`` groups is stored
input-major, values packed lowest bits first into int32 words:

- ``qweight`` int32 ``[K * bits // 32, N]``, packed along K;
- ``qzeros`` int32 ``[G, N * bits // 32]``, packed along N;
- ``scales`` float ``[G, N]``;
- ``g_idx`` int32 ``[K]``: the group of each input column (``k // group_size``
  unless ``desc_act``, whose groups are columns in activation order).

The weight is ``(q - zero) * scale``. ``checkpoint_format: gptq`` (v1) stores
``zero - 1``, subtracted from each int32 word as a whole (GPTQModel writes it
so, borrows included), so it is undone the same way; ``gptq_v2`` stores the
zero itself. A symmetric checkpoint's zeros are all ``2**(bits - 1)`` and
are checked, then dropped.
"""

from __future__ import annotations

import torch

from kvserve.quant.config import QuantConfig
from kvserve.quant.formats.tensors import (
    FLOAT_DTYPES,
    CheckpointFormat,
    Parts,
    act_order_perm,
    add_to_words,
    check_trivial_g_idx,
    effective_group_size,
    expect,
    packed_weight,
    unpack_int32,
)
from kvserve.quant.packing import QuantizedWeight

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def required(config: QuantConfig) -> tuple[str, ...]:
    parts: tuple[str, ...] = ("qweight", "scales")
    parts += () if config.symmetric else ("qzeros",)
    return parts + (("g_idx",) if config.act_order else ())


def unpack_zeros(qzeros: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """``qzeros [G, N * bits // 32]`` -> the zero points ``[G, N]`` (v1's ``- 1`` undone)."""
    if config.checkpoint_format == "gptq":
        qzeros = add_to_words(qzeros, config.bits, 1)
    return unpack_int32(qzeros, config.bits)


def check_alone(part: str, tensor: torch.Tensor, config: QuantConfig, name: str) -> None:
    """A trivial ``g_idx`` without act-order; a symmetric checkpoint's ``qzeros``
    all at the midpoint."""
    if part == "g_idx":
        check_trivial_g_idx(tensor, config, name)
        return
    expect(tensor, name, None, (torch.int32,))
    zeros = unpack_zeros(tensor, config)
    midpoint = 2 ** (config.bits - 1)
    if not bool((zeros == midpoint).all()):
        stored = "zero - 1" if config.checkpoint_format == "gptq" else "zero"
        found = sorted(set(zeros.flatten().tolist()))[:8]
        raise ValueError(
            f"checkpoint tensor '{name}': quantization_config says sym=true, so every zero "
            f"point must be {midpoint} (stored as {stored}); found {found}"
        )


def convert(parts: Parts, config: QuantConfig, module: str) -> QuantizedWeight:
    """One GPTQ linear's tensors -> ``QuantizedWeight`` (shapes and dtypes checked)."""
    bits, per_word = config.bits, 32 // config.bits
    qweight, scales = parts["qweight"], parts["scales"]
    expect(scales, f"{module}.scales", None, FLOAT_DTYPES)
    groups, n = scales.shape
    if qweight.dim() != 2:
        expect(qweight, f"{module}.qweight", None, (torch.int32,))
    k = qweight.shape[0] * per_word
    group_size = effective_group_size(config, k)
    expect(qweight, f"{module}.qweight", (k // per_word, n), (torch.int32,))
    expect(scales, f"{module}.scales", (k // group_size, n), FLOAT_DTYPES)
    if k % group_size:
        raise ValueError(f"checkpoint tensor '{module}.qweight': {k} input columns are not a "
                         f"multiple of quantization_config.group_size={config.group_size}")
    zeros = None
    if not config.symmetric:
        qzeros = parts["qzeros"]
        if n % per_word:
            raise ValueError(f"checkpoint tensor '{module}.qzeros': {n} output columns do not "
                             f"pack into int32 words of {per_word} values")
        expect(qzeros, f"{module}.qzeros", (groups, n // per_word), (torch.int32,))
        zeros = unpack_zeros(qzeros, config).T
    perm = None
    if config.act_order:
        perm = act_order_perm(parts["g_idx"], k, group_size, f"{module}.g_idx")
    q = unpack_int32(qweight.T.contiguous(), bits)  # [N, K]
    return packed_weight(q, scales.T, zeros, bits, group_size, perm)


GPTQ = CheckpointFormat(parts=PARTS, required=required, check_alone=check_alone, convert=convert)
