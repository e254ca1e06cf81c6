"""What the checkpoint formats share: tensor checks, int32 unpacking, act-order.

``CheckpointFormat`` describes one producer's tensors for a quantised linear
(which suffixes it writes, which of them a config needs, how to check the
ones it does not need, how to convert the rest into ``QuantizedWeight``);
``stream.py`` drives it. The helpers here check a tensor's dtype and shape
with an error naming the tensor, unpack 4-/8-bit values from int32 words
(lowest bits first, as GPTQ and compressed-tensors store them), and turn a
GPTQ-style ``g_idx`` into kvserve's ``perm``. No format knowledge lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.quant.config import QuantConfig
from kvserve.quant.packing import QuantizedWeight, pack_int4

Parts = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CheckpointFormat:
    """One format's tensors of a quantised linear ``{module}.{part}``."""

    parts: tuple[str, ...]  # every suffix the producer writes (bias aside)
    required: Callable[[QuantConfig], tuple[str, ...]]  # the ones converted together
    # a written part the config does not need: check it alone (raise) and drop it
    check_alone: Callable[[str, torch.Tensor, QuantConfig, str], None]
    # ``{part: tensor}`` of one module (its HF name) -> kvserve's layout
    convert: Callable[[Parts, QuantConfig, str], QuantizedWeight]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def expect(
    tensor: torch.Tensor, name: str, shape: Sequence[int] | None,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """ValueError naming ``name`` unless ``tensor`` has one of ``dtypes`` and
    ``shape`` (None: any 2-D shape)."""
    shape_ok = tensor.dim() == 2 if shape is None else tuple(tensor.shape) == tuple(shape)
    if tensor.dtype in dtypes and shape_ok:
        return
    want = " or ".join(_dtype_name(d) for d in dtypes)
    want_shape = "a 2-D tensor" if shape is None else f"shape {tuple(shape)}"
    raise ValueError(
        f"checkpoint tensor '{name}': {_dtype_name(tensor.dtype)} of shape "
        f"{tuple(tensor.shape)}; expected {want} of {want_shape}"
    )


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack_int32(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, W]`` -> int32 ``[R, W * 32 // bits]``: value ``j`` of word
    ``w`` is bits ``(j * bits) .. (j + 1) * bits - 1`` (lowest first)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    values = (words.to(torch.int32)[:, :, None] >> shifts) & (2**bits - 1)
    return values.reshape(words.shape[0], words.shape[1] * per_word)


def add_to_words(words: torch.Tensor, bits: int, amount: int) -> torch.Tensor:
    """``words + amount * 0x..010101`` as whole int32 words, wrapping mod 2**32:
    how GPTQModel undoes (and AutoGPTQ meant) v1's ``zero - 1`` per packed
    value, carries between values included."""
    ones = sum(1 << shift for shift in range(0, 32, bits))
    wide = (words.to(torch.int64) + amount * ones) & 0xFFFFFFFF
    return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)


def effective_group_size(config: QuantConfig, k: int) -> int:
    return k if config.group_size == -1 else config.group_size


def num_groups(config: QuantConfig, k: int) -> int:
    return k // effective_group_size(config, k)


def check_trivial_g_idx(g_idx: torch.Tensor, config: QuantConfig, name: str) -> None:
    """A ``g_idx`` the config does not use (no act-order) must be ``k // group_size``."""
    expect(g_idx, name, (g_idx.numel(),), (torch.int32, torch.int64))
    k = g_idx.numel()
    trivial = torch.arange(k, device=g_idx.device) // effective_group_size(config, k)
    if not torch.equal(g_idx.long(), trivial):
        raise ValueError(
            f"checkpoint tensor '{name}' reorders the input columns (act-order), but the "
            "quantization_config does not say so (desc_act / actorder); the config and the "
            "tensors disagree"
        )


def act_order_perm(
    g_idx: torch.Tensor, k: int, group_size: int, name: str
) -> torch.Tensor | None:
    """The ``perm`` that gathers each group's columns together: the stable
    argsort of ``g_idx``; None when it is the identity. Every group must then
    be exactly ``group_size`` consecutive columns (GPTQ's act-order makes
    them so), else ValueError."""
    expect(g_idx, name, (k,), (torch.int32, torch.int64))
    perm = torch.argsort(g_idx.long(), stable=True)
    expected = torch.arange(k, device=g_idx.device) // group_size
    if not torch.equal(g_idx.long()[perm], expected):
        counts = torch.bincount(g_idx.long().clamp(min=0)).tolist()
        raise ValueError(
            f"checkpoint tensor '{name}': act-order groups must each hold exactly "
            f"{group_size} of the {k} input columns, numbered 0..{k // group_size - 1}; "
            f"got group sizes {counts[:8]}{' ...' if len(counts) > 8 else ''}"
        )
    if torch.equal(perm, torch.arange(k, device=perm.device)):
        return None
    return perm


def packed_weight(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
    group_size: int, perm: torch.Tensor | None,
) -> QuantizedWeight:
    """kvserve's layout from unsigned values ``q [N, K]`` in the checkpoint's
    column order, ``scales`` / ``zeros`` ``[N, K // group_size]`` per group of
    the permuted order."""
    if perm is not None:
        q = q.index_select(1, perm)
    q8 = q.to(torch.uint8)
    return QuantizedWeight(
        qweight=pack_int4(q8) if bits == 4 else q8.contiguous(),
        scales=scales.contiguous(),
        zeros=None if zeros is None else zeros.to(scales.dtype).contiguous(),
        bits=bits,
        group_size=group_size,
        perm=perm,
    )
