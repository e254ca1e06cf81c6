"""Rotary position embedding, applied by absolute token position.

Owns the inverse frequencies for ``rope_type`` ``"default"`` and ``"llama3"``
(Llama 3.1 frequency scaling) and one cos/sin cache of
``[max_position, rotary_dim]`` computed once at construction, indexed by the
step's ``positions``. Rotation follows Hugging Face's ``rotate_half`` (neox)
convention: the first and second halves of each head form the pairs. Models
build one instance and share it across layers, so the cache exists once.

With ``use_triton`` (see ``layers/custom_ops.py``) the rotation runs in the
Triton kernel of ``kernels/rotary.py``, imported only then, which rotates q
and k in place (they are views of the step's packed qkv, read by nothing
else) and computes in float32; the torch code stays the oracle. Models hand
this module to the attention layer (``layers/attention.py``), which, with
``use_triton`` under a backend that fuses rope (the Triton one), passes
the cos/sin cache to the backend's fused rope + KV write instead of
calling this module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept,
    the band between them interpolated smoothly."""
    try:
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"config.json: rope_scaling of type 'llama3' lacks field {e}") from e
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """``[rotary_dim // 2]`` float32 inverse frequencies for the configured rope type."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_type='{rope_type}' is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    base = float(rope_parameters.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their tokens' positions."""

    def __init__(
        self, head_dim: int, max_position: int, rope_parameters: dict[str, Any]
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * float(rope_parameters.get("partial_rotary_factor", 1.0)))
        self.max_position = max_position
        self.use_triton = False
        inv_freq = compute_inv_freq(self.rotary_dim, rope_parameters)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim // 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim // 2]
        half = self.rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half : self.rotary_dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim < self.head_dim:
            rotated = torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)
        return rotated

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [num_tokens] int64; ``q``/``k`` either ``[num_tokens, heads * head_dim]``
        or ``[num_tokens, heads, head_dim]``. Returns new tensors of the input shapes, or,
        with ``use_triton``, ``q`` and ``k`` themselves, rotated in place."""
        if self.use_triton:
            from kvserve.kernels.rotary import apply_rotary

            apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim, self.rotary_dim)
            return q, k
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [num_tokens, rotary_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim // 2]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q_rot = self._rotate(q.reshape(num_tokens, -1, self.head_dim), cos, sin)
        k_rot = self._rotate(k.reshape(num_tokens, -1, self.head_dim), cos, sin)
        return q_rot.reshape(q.shape), k_rot.reshape(k.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max={self.max_position}"
