"""How a model splits over tensor- and pipeline-parallel ranks: arithmetic only, no torch.

Owns the rank layout (``rank = pp_rank * tp_size + tp_rank``: a stage's TP
ranks are consecutive, so on one node they share the fastest links), how
attention heads, KV heads, the vocabulary and the decoder layers are
divided, the check that a model splits at the requested sizes (a
ValueError naming the shape and the sizes that would work), and each
rank's weight and KV bytes, from which start-up refuses a model that cannot
fit and names the smallest sizes that would. The engine imports it before
any process starts; the layers read it as they are built.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig

# the sizes listed in "would work" / "would fit" messages
MAX_SUGGESTED_SIZE = 64


@dataclass(frozen=True)
class RankLayout:
    """One rank's place in the ``tp_size x pp_size`` grid."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The global ranks of stage ``pp_rank`` (its TP group), in TP order."""
        return [pp_rank * self.tp_size + i for i in range(self.tp_size)]

    @property
    def prev_stage_rank(self) -> int:
        """The rank this one receives hidden states from (same TP rank, stage before)."""
        return self.rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        """The rank this one sends hidden states to (same TP rank, next stage)."""
        return self.rank + self.tp_size

    @property
    def output_rank(self) -> int:
        """The rank that reports sampled tokens: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one TP rank holds."""

    num_heads: int  # query heads
    num_kv_heads: int  # KV heads (one, replicated, when the model has fewer than ranks)
    head_start: int  # the checkpoint's index of the first query head
    kv_head_start: int  # the checkpoint's index of the first KV head


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
    """Query heads ``num_heads / tp`` per rank; KV heads ``num_kv_heads / tp``, or
    when there are fewer KV heads than ranks, one each, shared by the
    ``tp / num_kv_heads`` consecutive ranks whose query heads use it."""
    heads = num_heads // tp_size
    if num_kv_heads >= tp_size:
        kv_heads = num_kv_heads // tp_size
        kv_start = tp_rank * kv_heads
    else:
        kv_heads = 1
        kv_start = tp_rank // (tp_size // num_kv_heads)
    return HeadSplit(heads, kv_heads, tp_rank * heads, kv_start)


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first row, rows)`` of the rank's slice of the embedding / LM head: the
    vocabulary padded up to a multiple of ``tp_size``; rows past the
    vocabulary are padding (zero weights, logits cut off after the gather)."""
    rows = -(-vocab_size // tp_size)
    return tp_rank * rows, rows


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers of stage ``pp_rank``: contiguous and
    as even as possible, the earlier stages taking one more (the last stage
    also computes logits and samples)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def tp_problems(config: ModelConfig, tp: int) -> list[str]:
    """What stops ``config`` from splitting over ``tp`` TP ranks (empty: nothing)."""
    problems = []
    if config.num_heads % tp:
        problems.append(f"num_attention_heads={config.num_heads} is not divisible by it")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} neither divides it nor is divisible by it")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size={config.intermediate_size} is not divisible by it")
    quant = config.quantization
    if quant is not None and tp > 1:
        # the row-parallel linears split their input: whole groups (and bytes) per rank
        inputs = {"o_proj": config.num_heads * config.head_dim,
                  "down_proj": config.intermediate_size}
        for name, size in inputs.items():
            if size % tp:
                continue  # reported above
            per_rank = size // tp
            if quant.group_size != -1 and per_rank % quant.group_size:
                problems.append(
                    f"{name}'s input of {size} columns gives each rank {per_rank}, which "
                    f"splits a group of {quant.group_size} ({quant.name} weights)")
            elif quant.bits == 4 and per_rank % 2:
                problems.append(
                    f"{name}'s input of {size} columns gives each rank {per_rank}, which "
                    "splits a byte of two 4-bit weights")
    return problems


def shardable_tp(config: ModelConfig, limit: int = MAX_SUGGESTED_SIZE) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that ``config`` splits over."""
    return [tp for tp in range(1, limit + 1) if not tp_problems(config, tp)]


def check_split(config: ModelConfig, tp: int, pp: int) -> None:
    """ValueError naming what does not divide, and the sizes that would, when
    ``config`` cannot run at ``tensor_parallel_size=tp`` x ``pipeline_parallel_size=pp``."""
    problems = tp_problems(config, tp)
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp} does not split this model: {'; '.join(problems)}. "
            f"Sizes that do: {', '.join(map(str, shardable_tp(config)))}")
    if pp > config.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is invalid: the model has {config.num_layers} "
            f"decoder layers, so at most {config.num_layers} stages")


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds: weight bytes, and KV bytes per token of context."""

    weights: float
    kv_per_token: float


def rank_bytes(config: ModelConfig, element_bytes: int, tp: int, pp: int,
               pp_rank: int) -> RankBytes:
    """Weights and KV per token of one rank of stage ``pp_rank`` (every TP rank
    of a stage holds as much). Quantised linears count their packed bytes."""
    heads = split_heads(config.num_heads, config.num_kv_heads, tp, 0)
    hidden, head_dim = config.hidden_size, config.head_dim
    inter = config.intermediate_size // tp
    q, kv = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
    # (input size on this rank, output size on this rank) of each linear of a layer
    linears = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]
    quant = config.quantization

    def linear_bytes(in_size: int, out_size: int, quantized: bool) -> float:
        if not quantized or quant is None:
            return in_size * out_size * element_bytes
        return in_size * out_size * quant.bytes_per_weight(in_size, element_bytes)

    per_layer = sum(linear_bytes(i, o, True) for i, o in linears)
    per_layer += (2 * hidden + (2 * head_dim if config.qk_norm else 0)) * element_bytes
    per_layer += ((q + 2 * kv) * element_bytes) if config.qkv_bias else 0
    start, end = layer_range(config.num_layers, pp, pp_rank)
    weights = (end - start) * per_layer
    _, vocab_rows = vocab_shard(config.vocab_size, tp, 0)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        weights += vocab_rows * hidden * element_bytes
    if last:
        weights += hidden * element_bytes  # the final norm
        if not (config.tie_word_embeddings and first):  # an untied head, or a tied one elsewhere
            head_quantized = quant is not None and quant.quantizes("lm_head")
            weights += linear_bytes(hidden, vocab_rows, head_quantized)
    kv_per_token = 2 * (end - start) * kv * element_bytes
    return RankBytes(weights, kv_per_token)


def max_rank_bytes(config: ModelConfig, element_bytes: int, tp: int, pp: int,
                   num_tokens: int) -> float:
    """The most any rank needs: its weights plus the KV of ``num_tokens`` tokens."""
    return max(b.weights + b.kv_per_token * num_tokens
               for b in (rank_bytes(config, element_bytes, tp, pp, s) for s in range(pp)))


def smallest_fitting_sizes(config: ModelConfig, element_bytes: int, budget_bytes: float,
                           num_tokens: int) -> list[tuple[int, int, float]]:
    """``(tp, pp, bytes per rank)`` of every split with the fewest processes
    whose ranks each fit in ``budget_bytes`` with ``num_tokens`` of KV (empty
    if none up to ``MAX_SUGGESTED_SIZE`` processes does)."""
    for world in range(1, MAX_SUGGESTED_SIZE + 1):
        fits = []
        for tp in (t for t in range(1, world + 1) if world % t == 0):
            pp = world // tp
            if tp_problems(config, tp) or pp > config.num_layers:
                continue
            need = max_rank_bytes(config, element_bytes, tp, pp, num_tokens)
            if need <= budget_bytes:
                fits.append((tp, pp, need))
        if fits:
            return sorted(fits, key=lambda fit: fit[1])  # tensor parallelism first
    return []


def describe_sizes(sizes: list[tuple[int, int, float]]) -> str:
    """``tensor_parallel_size=2 (35.1 GB per rank) or ...`` for a refusal message."""
    parts = []
    for tp, pp, need in sizes:
        names = []
        if tp > 1:
            names.append(f"tensor_parallel_size={tp}")
        if pp > 1:
            names.append(f"pipeline_parallel_size={pp}")
        parts.append(f"{' x '.join(names) or 'one process'} ({need / 1e9:.2f} GB per rank)")
    return " or ".join(parts)
