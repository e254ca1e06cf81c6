"""The attention backend interface and its registry.

A backend writes the step's new K/V into the paged cache through the slot
mapping, then computes causal attention of each request's new tokens over
its whole cached context (prefix + themselves). Backends register by a short
name and are imported lazily, so CPU runs never import Triton.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from kvserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """One attention implementation over the paged KV cache."""

    name: str
    # whether a decode step through it can be captured in a CUDA graph: it reads
    # no host copies of the metadata and never synchronises with the device
    supports_cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
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
