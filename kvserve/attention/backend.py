"""The attention backend interface and its registry.

A backend writes the step's new K/V into the paged cache through the slot
mapping (quantising them into an fp8 or int8 cache, whose scales it is
given beside it), then computes causal attention of each request's new tokens over
its whole cached context (prefix + themselves). A backend that
``fuses_rope`` also takes q and k un-rotated, with a ``FusedRope``, and
rotates them itself in the same launch as the KV write; the attention layer
rotates them first for one that does not. Backends register by a short
name and are imported lazily, so CPU runs never import Triton.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple, Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata


class FusedRope(NamedTuple):
    """Rotary embedding for a backend to apply itself: neox-style rotation of q and
    the new keys by ``positions``, as ``kvserve/kernels/rotary.py`` defines it."""

    positions: torch.Tensor  # [num_tokens] int32 or int64
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] float32: cos | sin
    rotary_dim: int  # the first rotary_dim dims of each head rotate, the rest pass through


class AttentionBackend(Protocol):
    """One attention implementation over the paged KV cache."""

    name: str
    # whether a decode step through it can be captured in a CUDA graph: it reads
    # no host copies of the metadata and never synchronises with the device
    supports_cuda_graphs: bool
    # whether forward accepts ``rope``; a backend without it raises when given one
    fuses_rope: bool

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rope: FusedRope | None = None,  # q and k arrive un-rotated: rotate q in place, k as stored
        # an fp8 or int8 cache's scales (kernels/kv_quant.py); None for a 16- or 32-bit one
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("kvserve.attention.torch_ref", "TorchRefAttentionBackend"),
    "triton": ("kvserve.attention.triton_backend", "TritonAttentionBackend"),
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate the backend registered as ``name``."""
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend '{name}'; available: {', '.join(_BACKENDS)}"
        )
    module_name, class_name = _BACKENDS[name]
    backend: AttentionBackend = getattr(importlib.import_module(module_name), class_name)()
    return backend
