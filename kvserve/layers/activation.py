"""Gated activations: ``SiluAndMul`` turns a packed ``[gate | up]`` into ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]``: silu of the first half times the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act``."""
    if hidden_act == "silu":
        return SiluAndMul()
    raise ValueError(f"config.json: hidden_act='{hidden_act}' is not supported; supported: silu")
