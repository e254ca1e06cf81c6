"""AWQ "gemm" checkpoints (AutoAWQ, transformers' AwqConfig) -> kvserve's packed layout.

An AWQ linear of ``K`` inputs, ``N`` outputs and ``G`` groups is stored
input-major with eight 4-bit values per int32 word along the OUTPUT dim,
interleaved: the value in bits ``4i .. 4i + 3`` of word ``c`` belongs to
output column ``8c + AWQ_ORDER[i]``:

- ``qweight`` int32 ``[K, N // 8]``;
- ``qzeros`` int32 ``[G, N // 8]``, same interleave, zero points as they are;
- ``scales`` float16 ``[G, N]``.

The weight is ``(q - zero) * scale``, groups of ``group_size`` consecutive
inputs; there is no act-order and always a zero point.
"""

from __future__ import annotations

import torch

from kvserve.quant.config import QuantConfig
from kvserve.quant.formats.tensors import (
    FLOAT_DTYPES,
    CheckpointFormat,
    Parts,
    expect,
    packed_weight,
    unpack_int32,
)
from kvserve.quant.packing import QuantizedWeight

PARTS = ("qweight", "qzeros", "scales")
# output column (within its word's 8) of the value in nibble i
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def required(config: QuantConfig) -> tuple[str, ...]:
    return PARTS


def check_alone(part: str, tensor: torch.Tensor, config: QuantConfig, name: str) -> None:
    raise AssertionError(f"AWQ converts every part it writes together; got {name}")


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` in AWQ's interleaved order -> int32 ``[R, 8 * C]`` in column order."""
    nibbles = unpack_int32(words, 4).reshape(words.shape[0], words.shape[1], 8)
    columns = torch.empty_like(nibbles)
    columns[:, :, list(AWQ_ORDER)] = nibbles
    return columns.reshape(words.shape[0], -1)


def convert(parts: Parts, config: QuantConfig, module: str) -> QuantizedWeight:
    """One AWQ linear's tensors -> ``QuantizedWeight`` (shapes and dtypes checked)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    expect(scales, f"{module}.scales", None, FLOAT_DTYPES)
    groups, n = scales.shape
    if qweight.dim() != 2:
        expect(qweight, f"{module}.qweight", None, (torch.int32,))
    k = qweight.shape[0]
    if n % 8 or groups * config.group_size != k:
        raise ValueError(
            f"checkpoint tensor '{module}.scales': shape {tuple(scales.shape)} does not fit "
            f"'{module}.qweight' of shape {tuple(qweight.shape)} with "
            f"quantization_config.group_size={config.group_size}; expected "
            f"({k // config.group_size}, {qweight.shape[1] * 8})"
        )
    expect(qweight, f"{module}.qweight", (k, n // 8), (torch.int32,))
    expect(qzeros, f"{module}.qzeros", (groups, n // 8), (torch.int32,))
    q = unpack_awq(qweight).T  # [N, K]
    zeros = unpack_awq(qzeros).T  # [N, G]
    return packed_weight(q, scales.T, zeros, 4, config.group_size, None)


AWQ = CheckpointFormat(parts=PARTS, required=required, check_alone=check_alone, convert=convert)
