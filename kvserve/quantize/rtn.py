"""Round-to-nearest, the baseline every calibrated method is measured against,
and ``WeightScheme``, how one run stores its weights (shared by the methods).

RTN needs no calibration data: ``quant/packing.py``'s ``quantize_rtn`` per
linear. ``fake_quantize`` is its dequantised result, which AWQ's searches
compare against the 16-bit output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.quant.packing import QuantizedWeight, dequantize, quantize_rtn


@dataclass(frozen=True)
class WeightScheme:
    """Bits, group size (-1: per output channel), zero points, and the dtype the
    scales are stored in (the checkpoint's 16-bit dtype)."""

    bits: int
    group_size: int
    symmetric: bool
    scale_dtype: torch.dtype

    def group(self, input_size: int) -> int:
        """The group size of a linear with ``input_size`` inputs."""
        return input_size if self.group_size == -1 else self.group_size


def rtn_quantize(weight: torch.Tensor, scheme: WeightScheme) -> QuantizedWeight:
    """``weight [N, K]`` rounded to nearest in ``scheme``."""
    return quantize_rtn(weight, scheme.bits, scheme.group_size, scheme.symmetric,
                        scale_dtype=scheme.scale_dtype)


def fake_quantize(weight: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """``weight`` rounded to nearest and dequantised, float32."""
    return dequantize(rtn_quantize(weight, scheme))
