"""Llama-family decoder (Llama 2/3/3.1, Mistral) and the weight loading all
our decoders share.

Owns the module tree whose parameter names mirror Hugging Face's
(``model.layers.N.self_attn.qkv_proj`` packs HF's ``q_proj/k_proj/v_proj``,
``mlp.gate_up_proj`` packs ``gate_proj/up_proj``), and ``load_weights``,
which routes HF tensor names to those parameters. Variants that only differ
by config (q/k/v bias, sliding windows) need no code here; a variant that
changes the math subclasses ``LlamaAttention`` (see ``qwen.py``).
Attention itself is the backend's job; this file never reads the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.layers.activation import get_act_and_mul
from kvserve.layers.attention import Attention
from kvserve.layers.embedding import LMHead, VocabEmbedding
from kvserve.layers.linear import (
    Linear,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    ShardId,
    get_weight_loader,
)
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.registry import CausalLM


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = bool(config.hf_config.get("mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size], bias=bias)
        self.act_fn = get_act_and_mul(str(config.hf_config.get("hidden_act", "silu")))
        self.down_proj = RowLinear(size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if isinstance(self.down_proj, Linear):  # not when a LoRA wrapper replaced it
            return self.down_proj.forward_gated(gate_up, self.act_fn)
        return self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """Self-attention block: packed qkv, rope, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
            bias=config.qkv_bias,
        )
        self.o_proj = RowLinear(
            self.num_heads * self.head_dim, config.hidden_size,
            bias=bool(config.hf_config.get("attention_bias", False)),
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5,
            sliding_window=config.sliding_windows[layer_idx],
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for variants that normalise q and k per head before rope; Llama does not."""
        return q, k

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        qkv = self.qkv_proj(hidden_states)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        # rope runs inside the attention layer, where a backend may fuse it with its KV write
        out = self.attn(q, k, v, metadata, positions, self.rotary_emb)  # [num_tokens, q_size]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; carries the residual separately so norms can fuse the add."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor,
        residual: torch.Tensor | None, metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # one rotary module (one cos/sin cache) shared by every layer
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_parameters
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, attention_cls)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, metadata)
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    """A Llama decoder with its LM head; the interface every model class offers."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # our packed parameter -> the HF tensors it holds, with their shard ids
    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, ShardId], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }
    # checkpoint tensors that are recomputed here, not loaded
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.num_experts:
            raise ValueError(
                f"config.json: {config.architecture} with num_experts={config.num_experts} "
                "(mixture of experts) is not supported"
            )
        self.model = LlamaModel(config, self.attention_cls)
        tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied_to)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], final norm applied
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> ``[num_rows, vocab_size]`` float32 logits."""
        return self.lm_head(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _route(self, name: str) -> tuple[str, ShardId, tuple[str, ...]]:
        """HF tensor name -> (our parameter name, shard id, HF names that parameter holds)."""
        for packed, shards in self.packed_modules_mapping.items():
            for hf_part, shard_id in shards:
                if f".{hf_part}." in name:
                    return name.replace(f".{hf_part}.", f".{packed}."), shard_id, (name,)
            if f".{packed}." in name:
                # a checkpoint that already stores the packed tensor
                parts = tuple(name.replace(f".{packed}.", f".{hf}.") for hf, _ in shards)
                return name, None, parts
        return name, None, (name,)

    def _expected_names(self, param_name: str) -> list[str]:
        """The HF tensor names that must be loaded to fill ``param_name``."""
        for packed, shards in self.packed_modules_mapping.items():
            if f".{packed}." in param_name:
                return [param_name.replace(f".{packed}.", f".{hf}.") for hf, _ in shards]
        return [param_name]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters, casting dtype.

        Raises ValueError naming the tensor for an unknown name or a shape
        mismatch, and naming the first missing tensors if any parameter is
        left unfilled.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(self.ignored_suffixes):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head reuses model.embed_tokens.weight
            param_name, shard_id, hf_names = self._route(name)
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor '{name}' has no matching parameter in "
                    f"{self.config.architecture} (unexpected name; wrong architecture?)"
                )
            param = params[param_name]
            try:
                get_weight_loader(self, param_name)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor '{name}': {e}") from e
            loaded.update(hf_names)
        missing = [n for p in params for n in self._expected_names(p) if n not in loaded]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(missing[:5]) + more
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer (``config.sliding_windows``)."""
