"""Llama-family decoder (Llama 2/3/3.1, Mistral) and the weight loading all
our decoders share.

Owns the module tree whose parameter names mirror Hugging Face's
(``model.layers.N.self_attn.qkv_proj`` packs HF's ``q_proj/k_proj/v_proj``,
``mlp.gate_up_proj`` packs ``gate_proj/up_proj``), and ``load_weights``,
which routes HF tensor names to those parameters. Variants that only differ
by config (q/k/v bias, sliding windows) need no code here; a variant that
changes the math subclasses ``LlamaAttention`` (see ``qwen.py``).
Attention itself is the backend's job; this file never reads the KV cache.

Built for a rank of a parallel split (``distributed/parallel_state.py``),
the layers hold that rank's heads and rows, and ``LlamaModel`` holds one
pipeline stage: its contiguous range of decoder layers (the others are
empty placeholders, so parameter names keep their layer index), the
embedding on the first stage, the final norm and head on the last. A stage
after the first takes the previous stage's hidden states and residual as
``intermediate``; one before the last returns its own. ``load_weights``
skips the tensors of other stages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import building_state
from kvserve.distributed.sharding import layer_range
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
    linear_method,
)
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.registry import CausalLM

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(self, config: ModelConfig, prefix: str) -> None:
        super().__init__()
        bias = bool(config.hf_config.get("mlp_bias", False))
        size = config.intermediate_size
        quant = config.quantization
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, [size, size], bias=bias,
            quant_method=linear_method(quant, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
        )
        self.act_fn = get_act_and_mul(str(config.hf_config.get("hidden_act", "silu")))
        self.down_proj = RowLinear(size, config.hidden_size, bias=bias,
                                   quant_method=linear_method(quant, [f"{prefix}.down_proj"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if isinstance(self.down_proj, Linear):  # not when a LoRA wrapper replaced it
            return self.down_proj.forward_gated(gate_up, self.act_fn)
        return self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """Self-attention block: packed qkv, rope, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        prefix, quant = f"model.layers.{layer_idx}.self_attn", config.quantization
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.qkv_bias,
            quant_method=linear_method(quant, [f"{prefix}.{p}_proj" for p in "qkv"]),
        )
        # this rank's heads (all of them in one process)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowLinear(
            config.num_heads * self.head_dim, config.hidden_size,
            bias=bool(config.hf_config.get("attention_bias", False)),
            quant_method=linear_method(quant, [f"{prefix}.o_proj"]),
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
        self.mlp = LlamaMLP(config, f"model.layers.{layer_idx}.mlp")
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
    """Embedding, decoder layers and the final norm (of this rank's pipeline stage)."""

    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        layout = building_state().layout
        self.hidden_size = config.hidden_size
        self.is_first_stage, self.is_last_stage = layout.is_first_stage, layout.is_last_stage
        self.start_layer, self.end_layer = layer_range(config.num_layers, layout.pp_size,
                                                       layout.pp_rank)
        self.embed_tokens = (VocabEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first_stage else None)
        # one rotary module (one cos/sin cache) shared by every layer
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_parameters
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, attention_cls)
            if self.start_layer <= i < self.end_layer else nn.Identity()  # another stage's
            for i in range(config.num_layers)
        )
        self.norm = (RMSNorm(config.hidden_size, config.rms_norm_eps)
                     if self.is_last_stage else None)
        # an EAGLE head's extra features (keep_aux_hidden_states): layer id -> slot in
        # aux_hidden, [max_tokens, len(ids), hidden_size], written by every forward
        self.aux_slots: dict[int, int] = {}
        self.aux_hidden: torch.Tensor | None = None

    def keep_aux_hidden_states(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        """From now on each forward writes the residual stream entering each of
        ``layer_ids`` (what transformers' ``hidden_states[i]`` holds) into
        ``aux_hidden``, a fixed buffer CUDA graphs capture writes to."""
        weight = next(self.parameters())
        self.aux_slots = {layer: slot for slot, layer in enumerate(layer_ids)}
        self.aux_hidden = torch.zeros(max_tokens, len(layer_ids), self.hidden_size,
                                      dtype=weight.dtype, device=weight.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual: torch.Tensor | None = None
        if intermediate is None:
            assert self.embed_tokens is not None, "a later pipeline stage needs intermediate"
            hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        else:  # [num_tokens, 2, hidden_size]: the previous stage's hidden states and residual
            hidden_states, residual = (t.contiguous() for t in intermediate.unbind(1))
        for i in range(self.start_layer, self.end_layer):
            if i in self.aux_slots:
                assert self.aux_hidden is not None
                stream = hidden_states if residual is None else hidden_states + residual
                self.aux_hidden[:len(stream), self.aux_slots[i]].copy_(stream)
            hidden_states, residual = self.layers[i](positions, hidden_states, residual,
                                                     metadata)
        if self.norm is None:  # the next stage goes on from here
            assert residual is not None
            return torch.stack((hidden_states, residual), dim=1)
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
        self.lm_head: LMHead | None = None
        if self.model.is_last_stage:
            # a tied head on a later stage than the embedding loads its own copy of it
            tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied_to,
                                  quant_method=linear_method(config.quantization, ["lm_head"]),
                                  tied=config.tie_word_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,  # [num_tokens, 2, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size], final norm applied (the last stage)
        return self.model(input_ids, positions, metadata, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> ``[num_rows, vocab_size]`` float32 logits."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None, "only the first pipeline stage embeds"
        return self.model.embed_tokens(input_ids)

    def keep_aux_hidden_states(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        self.model.keep_aux_hidden_states(layer_ids, max_tokens)

    def aux_hidden_states(self, num_tokens: int) -> torch.Tensor | None:
        aux = self.model.aux_hidden
        return None if aux is None else aux[:num_tokens]

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

    def linear_module_names(self) -> set[str]:
        """The HF module names of every linear (the parts of a packed one
        each), for the loader's quantised-checkpoint stream."""
        names: set[str] = set()
        for name, module in self.named_modules():
            if isinstance(module, Linear | LMHead):
                names.update(hf.rpartition(".")[0]
                             for hf in self._expected_names(f"{name}.weight"))
        return names

    def _expected_names(self, param_name: str) -> list[str]:
        """The HF tensor names that must be loaded to fill ``param_name``."""
        for packed, shards in self.packed_modules_mapping.items():
            if f".{packed}." in param_name:
                return [param_name.replace(f".{packed}.", f".{hf}.") for hf, _ in shards]
        return [param_name]

    def _on_another_stage(self, param_name: str) -> bool:
        """Whether ``param_name`` belongs to a pipeline stage other than this one."""
        match = _LAYER_RE.match(param_name)
        if match is not None:
            return not self.model.start_layer <= int(match.group(1)) < self.model.end_layer
        if param_name.startswith("model.embed_tokens."):
            return not self.model.is_first_stage
        return not self.model.is_last_stage and param_name.startswith(("model.norm.", "lm_head."))

    def _load(self, param_name: str, param: torch.nn.Parameter, tensor: torch.Tensor,
              shard_id: ShardId, name: str) -> None:
        try:
            get_weight_loader(self, param_name)(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor '{name}': {e}") from e

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters, casting dtype.

        Raises ValueError naming the tensor for an unknown name or a shape
        mismatch, and naming the first missing tensors if any parameter is
        left unfilled.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        # a tied head on a later pipeline stage than the embedding loads the table itself
        head_copies_embedding = self.lm_head is not None and self.lm_head.copies_embedding
        for name, tensor in weights:
            if name.endswith(self.ignored_suffixes):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head reuses model.embed_tokens.weight
            if head_copies_embedding and name == "model.embed_tokens.weight":
                self._load("lm_head.weight", params["lm_head.weight"], tensor, None, name)
                loaded.add("lm_head.weight")
            param_name, shard_id, hf_names = self._route(name)
            if param_name not in params and self._on_another_stage(param_name):
                continue
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor '{name}' has no matching parameter in "
                    f"{self.config.architecture} (unexpected name; wrong architecture?)"
                )
            self._load(param_name, params[param_name], tensor, shard_id, name)
            loaded.update(hf_names)
        missing = [n for p in params for n in self._expected_names(p) if n not in loaded]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(missing[:5]) + more
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer (``config.sliding_windows``)."""
