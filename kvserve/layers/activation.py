"""Gated activations: ``SiluAndMul`` turns a packed ``[gate | up]`` into ``silu(gate) * up``.

With ``use_triton`` (see ``layers/custom_ops.py``) it runs the Triton kernel of
``kernels/activation.py``, imported only then; the torch code stays the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]``: silu of the first half times the second half."""

    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from kvserve.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act``."""
    if hidden_act == "silu":
        return SiluAndMul()
    raise ValueError(f"config.json: hidden_act='{hidden_act}' is not supported; supported: silu")
