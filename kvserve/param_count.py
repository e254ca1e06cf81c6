"""Parameter counts of a model from its architecture, role by role.

Pure arithmetic on a ``ModelConfig`` (no torch, no I/O). It lives outside
both ``worker/`` and ``plan/`` because both need it: the worker's start-up
check refuses weights that cannot fit, and the planner turns the counts into
bytes and FLOPs. Neither imports the other (DESIGN.md section 1). One
tensor-parallel rank's share is counted with the engine's own split
(``distributed/sharding.py``: heads, KV heads and vocabulary rows), so the
planner's per-GPU figures are what a rank's layers really hold; ``plan/``
checks a TP size by the engine's rule through the names re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.distributed.sharding import shardable_tp as shardable_tp  # re-exported for plan/
from kvserve.distributed.sharding import split_heads, vocab_shard
from kvserve.distributed.sharding import tp_problems as tp_problems  # re-exported for plan/


@dataclass(frozen=True)
class ParamCount:
    """Parameters by role; ``linear*`` are the decoder-layer projections.

    With ``tp`` > 1 they are what one of ``tp`` tensor-parallel ranks holds.
    """

    total: int
    embedding: int  # vocab x hidden, a gather (no matmul) when untied
    lm_head: int  # 0 when tied to the embedding
    linear: int  # q, k, v, o, gate, up, down over all layers and experts
    linear_active: int  # the same with only the routed experts of an MoE token
    vocab_matmul: int  # vocab x hidden: the logits matmul, tied or not
    tp: int = 1  # the tensor-parallel size these are one rank's share of


def _experts(model: ModelConfig) -> tuple[int, int]:
    """(experts whose weights are stored, experts each token runs)."""
    if model.num_experts <= 0:
        return 1, 1
    active = model.hf_config.get("num_experts_per_tok")
    return model.num_experts, int(active) if active else model.num_experts


def count_params(model: ModelConfig, tp: int = 1) -> ParamCount:
    """Count parameters from the architecture, role by role: the whole model,
    or with ``tp`` > 1 what each tensor-parallel rank holds.

    A rank holds its query heads (q rows, o columns), its KV heads (k and v
    rows: ``num_kv_heads / tp``, or one replicated head when there are fewer
    KV heads than ranks), ``1 / tp`` of the MLP, its rows of the embedding and
    LM head (the vocabulary padded to a multiple of ``tp``) and every norm
    and router whole. ValueError when the engine could not split the model
    over ``tp`` ranks (``sharding.tp_problems``).
    """
    problems = tp_problems(model, tp) if tp >= 1 else ["a size must be >= 1"]
    if problems:
        raise ValueError(f"tp={tp} does not split this model: {'; '.join(problems)}")
    heads = split_heads(model.num_heads, model.num_kv_heads, tp, 0)
    hidden = model.hidden_size
    q_dim, kv_dim = heads.num_heads * model.head_dim, heads.num_kv_heads * model.head_dim
    num_experts, num_active = _experts(model)
    expert_size = int(model.hf_config.get("moe_intermediate_size") or model.intermediate_size)
    mlp_size = (expert_size if model.num_experts > 0 else model.intermediate_size) // tp
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    mlp = 3 * hidden * mlp_size
    small = 2 * hidden  # input and post-attention RMSNorm
    small += (q_dim + 2 * kv_dim) if model.qkv_bias else 0
    small += 2 * model.head_dim if model.qk_norm else 0
    small += hidden * num_experts if model.num_experts > 0 else 0  # router
    embedding = vocab_shard(model.vocab_size, tp, 0)[1] * hidden
    lm_head = 0 if model.tie_word_embeddings else embedding
    linear = model.num_layers * (attn + mlp * num_experts)
    total = embedding + lm_head + linear + model.num_layers * small + hidden
    return ParamCount(
        total=total,
        embedding=embedding,
        lm_head=lm_head,
        linear=linear,
        linear_active=model.num_layers * (attn + mlp * num_active),
        vocab_matmul=embedding,
        tp=tp,
    )
