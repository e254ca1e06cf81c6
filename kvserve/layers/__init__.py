"""Model building blocks: linear layers with weight loaders, norms, rotary
embedding, activations, embeddings and the paged attention layer.

Layers hold weights and do math; they know nothing of a particular model
architecture and never touch the scheduler or the KV cache allocation.
"""

from __future__ import annotations

from kvserve.layers.activation import SiluAndMul, get_act_and_mul
from kvserve.layers.attention import Attention, bind_kv_cache, get_attention_layers
from kvserve.layers.embedding import LMHead, VocabEmbedding
from kvserve.layers.linear import (
    ColumnLinear,
    Linear,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    default_weight_loader,
    get_weight_loader,
)
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, compute_inv_freq

__all__ = [
    "Attention",
    "ColumnLinear",
    "LMHead",
    "Linear",
    "MergedColumnLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowLinear",
    "SiluAndMul",
    "VocabEmbedding",
    "bind_kv_cache",
    "compute_inv_freq",
    "default_weight_loader",
    "get_act_and_mul",
    "get_attention_layers",
    "get_weight_loader",
]
