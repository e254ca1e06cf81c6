"""What a model's weight quantisation is, as plain data (no torch).

``QuantConfig`` says how the linears of a model are stored: bits, group
size, symmetric or with zero points, act-order, which linears stay in 16
bits, whether the weights are integers (weight-only, 16-bit activations) or
FP8 e4m3 with FP8 activations (``weight_type="fp8"``: W8A8, per-channel
weight scales, dynamic per-token activation scales) or int8 with int8
activations (``weight_type="w8a8-int8"``, the same scales), and the checkpoint
format the tensors come in (None when kvserve quantises a 16-bit checkpoint
itself at load, round-to-nearest). It is read
from ``config.json``'s ``quantization_config`` (``quant/formats``) or made
from ``--quantization``; ``ModelConfig.quantization`` carries it to the
layers. Nothing here reads files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WEIGHT_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, -1)  # -1: one group per output row (per channel)
# "fp8": HF's quant_method fp8 (e4m3 weight + weight_scale)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors", "fp8")
# --quantization values that round a 16-bit checkpoint at load: (bits, group size)
QUANTIZE_AT_LOAD = {
    "int8": (8, -1), "int4": (4, 128), "int4-g32": (4, 32), "int4-g64": (4, 64),
    "int4-g128": (4, 128), "fp8": (8, -1), "w8a8-int8": (8, -1),
}
# "int": weight-only; the W8A8 types quantise activations per token as the model runs
WEIGHT_TYPES = ("int", "fp8", "w8a8-int8")
W8A8_TYPES = ("fp8", "w8a8-int8")


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantisation of a model's linears (see ``quant/packing.py``)."""

    bits: int
    group_size: int  # -1: per output channel
    symmetric: bool = True
    # None: quantised by kvserve at load from 16-bit weights; else the stored format
    checkpoint_format: str | None = None
    act_order: bool = False  # GPTQ desc_act: each linear has a g_idx
    # linears left in 16 bits: full module names (``lm_head``,
    # ``model.layers.0.mlp.down_proj``) or ``re:``-prefixed regexes, as
    # compressed-tensors writes them; a packed linear matches by its HF parts
    ignore: tuple[str, ...] = ("lm_head",)
    # "int": weight-only integers; "fp8": e4m3 weights and per-token e4m3
    # activations; "w8a8-int8": int8 weights and per-token int8 activations
    weight_type: str = "int"

    def __post_init__(self) -> None:
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"quantization: weight_type='{self.weight_type}' is not "
                             f"supported; allowed: {', '.join(WEIGHT_TYPES)}")
        if self.weight_type in W8A8_TYPES and (self.bits, self.group_size, self.symmetric,
                                               self.act_order) != (8, -1, True, False):
            raise ValueError(f"quantization: {self.weight_type} weights are 8-bit, symmetric, "
                             "one scale per "
                             f"output channel, no act-order; got bits={self.bits}, group_size="
                             f"{self.group_size}, symmetric={self.symmetric}, act_order="
                             f"{self.act_order}")
        if self.bits not in WEIGHT_BITS:
            raise ValueError(f"quantization: bits={self.bits} is not supported; "
                             f"allowed: {WEIGHT_BITS}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"quantization: group_size={self.group_size} is not supported; "
                             f"allowed: {GROUP_SIZES} (-1: per channel)")
        if self.checkpoint_format is not None and self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization: checkpoint format '{self.checkpoint_format}' is "
                             f"not supported; allowed: {', '.join(CHECKPOINT_FORMATS)}")

    @property
    def name(self) -> str:
        """A short label: ``int4-g128``, ``int8`` (per channel), ``-asym`` for zero
        points, ``fp8`` / ``w8a8-int8`` for the W8A8 types."""
        if self.weight_type in W8A8_TYPES:
            return self.weight_type
        group = "" if self.group_size == -1 else f"-g{self.group_size}"
        return f"int{self.bits}{group}{'' if self.symmetric else '-asym'}"

    def bytes_per_weight(self, input_size: int, scale_bytes: int) -> float:
        """Bytes a weight takes in memory: its packed value plus its share of
        the group's scale (and zero point); ``input_size`` is the group of a
        per-channel config."""
        group = input_size if self.group_size == -1 else self.group_size
        return self.bits / 8 + scale_bytes * (1 if self.symmetric else 2) / group

    def num_quantized(self, num_linear: int, num_lm_head: int) -> int:
        """Of a model's decoder-layer linear and LM-head weights, how many are quantised."""
        return num_linear + (num_lm_head if self.quantizes("lm_head") else 0)

    def quantizes(self, module_name: str) -> bool:
        """Whether the linear called ``module_name`` (HF's name) is stored quantised."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True


def quantize_at_load(name: str, quantize_lm_head: bool = False) -> QuantConfig:
    """The config of ``--quantization NAME`` on a 16-bit checkpoint: symmetric
    round-to-nearest, the LM head too with ``quantize_lm_head``."""
    if name not in QUANTIZE_AT_LOAD:
        raise ValueError(f"quantization='{name}' does not quantise at load; allowed: "
                         f"{', '.join(QUANTIZE_AT_LOAD)}")
    bits, group_size = QUANTIZE_AT_LOAD[name]
    return QuantConfig(bits=bits, group_size=group_size,
                       ignore=() if quantize_lm_head else ("lm_head",),
                       weight_type=name if name in W8A8_TYPES else "int")
