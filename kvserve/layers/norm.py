"""RMSNorm, with the fused residual-add form the decoder layers use.

``forward(x)`` normalises; ``forward(x, residual)`` first adds the residual
and returns ``(normed, x + residual)`` so the caller keeps the sum as the
next residual (one pass instead of two, the shape a fused kernel will take).
The arithmetic follows Hugging Face's LlamaRMSNorm: statistics in float32,
cast back to the input dtype before the weight multiply. With ``use_triton``
(see ``layers/custom_ops.py``) both forms run the Triton kernels of
``kernels/rms_norm.py``, imported only then; the torch code stays the oracle.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, with a learned scale."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.use_triton = False
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [hidden_size]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)
        return self.weight * normed

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            from kvserve.kernels.rms_norm import add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        summed = residual + x
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
