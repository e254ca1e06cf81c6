"""Qwen2 and Qwen3 decoders, built from the Llama blocks.

Qwen2 differs from Llama only by config (bias on q/k/v, none on o_proj,
optional sliding-window layers), all of which ``ModelConfig`` carries.
Qwen3 adds a per-head RMSNorm on q and k (weights of size ``head_dim``)
before rope, and its ``head_dim`` need not be ``hidden_size / num_heads``.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with q/k/v bias (from the config)."""


class Qwen3Attention(LlamaAttention):
    """Llama attention with RMSNorm over each head of q and k before rope."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return q, k  # [num_tokens, heads, head_dim]; rope and Attention accept either shape


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): per-head q/k norm, explicit head_dim."""

    attention_cls = Qwen3Attention
