"""The attention layer models call, and the binding of KV caches to it.

``Attention`` owns no weights: it reshapes flat q/k/v into heads and hands
them, with its layer's paged KV cache, to the attention backend. Given the
rotary module, it also owns where rope runs: inside the backend, fused with
the KV write, when the backend ``fuses_rope`` and the module's
``use_triton`` is on (the Triton backend on CUDA: one launch fewer per
layer), else through the module before the backend (the torch reference
path, unchanged). The model runner allocates the caches (and an fp8 or
int8 cache's scales) and calls ``bind_kv_cache`` once; the layer never
allocates or frees cache memory itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, FusedRope
from kvserve.attention.metadata import AttentionMetadata
from kvserve.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Causal (optionally sliding-window) attention over one layer's paged KV cache."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # [2, num_blocks, block_size, num_kv_heads, head_dim], set by bind_kv_cache
        self.kv_cache: torch.Tensor | None = None
        # an fp8 or int8 cache's scales (kernels/kv_quant.py), set by bind_kv_cache
        self.kv_scales: torch.Tensor | None = None
        # the checkpoint's fp8 KV-cache scales, [2 (K, V), num_kv_heads] float32,
        # set by the loader (models/kv_scales.py) when it has them
        self.checkpoint_kv_scales: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        metadata: AttentionMetadata,
        positions: torch.Tensor | None = None,  # [num_tokens] int64
        rotary_emb: RotaryEmbedding | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """With ``rotary_emb``, ``q`` and ``k`` arrive un-rotated and are rotated by
        ``positions`` here (q possibly in place); ``q``/``k`` may also be
        ``[num_tokens, heads, head_dim]``."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError(
                "Attention: no KV cache bound; call bind_kv_cache(model, kv_caches, backend) first"
            )
        rope = None
        if rotary_emb is not None:
            if positions is None:
                raise ValueError("Attention: rotary_emb given without positions")
            if rotary_emb.use_triton and self.backend.fuses_rope:
                rope = FusedRope(positions, rotary_emb.cos_sin_cache, rotary_emb.rotary_dim)
            else:
                q, k = rotary_emb(positions, q, k)
        num_tokens = q.shape[0]
        out = self.backend.forward(
            q.reshape(num_tokens, self.num_heads, self.head_dim),
            k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            v.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
            rope,
            self.kv_scales,
        )  # [num_tokens, num_heads, head_dim]
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}"
        )


def get_attention_layers(model: nn.Module) -> list[Attention]:
    """The model's ``Attention`` layers in layer order."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_cache(
    model: nn.Module, kv_caches: Sequence[torch.Tensor], backend: AttentionBackend,
    kv_scales: Sequence[torch.Tensor] | None = None,
) -> None:
    """Give attention layer ``i`` the cache ``kv_caches[i]`` (with an fp8 or int8
    cache, its scales ``kv_scales[i]``) and the step's backend.

    Each cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """
    layers = get_attention_layers(model)
    if len(layers) != len(kv_caches) or len(layers) != len(kv_scales or kv_caches):
        raise ValueError(
            f"bind_kv_cache: model has {len(layers)} attention layers but got "
            f"{len(kv_caches)} KV caches and {len(kv_scales or kv_caches)} scales"
        )
    for i, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
        expected = (2, layer.num_kv_heads, layer.head_dim)
        if cache.dim() != 5 or (cache.shape[0], cache.shape[3], cache.shape[4]) != expected:
            raise ValueError(
                f"bind_kv_cache: layer {i} cache has shape {tuple(cache.shape)}; expected "
                f"[2, num_blocks, block_size, {layer.num_kv_heads}, {layer.head_dim}]"
            )
        layer.kv_cache = cache
        layer.kv_scales = None if kv_scales is None else kv_scales[i]
        layer.backend = backend
