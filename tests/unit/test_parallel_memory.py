"""Per-rank memory arithmetic of a parallel split (``distributed/sharding.py``)
and the start-up refusal that names the smallest sizes that would fit.

The figures are checked against the planner's parameter count (one process
holds exactly the whole model; a TP rank exactly the parameters its layers
are built with, KV heads replicated past TP = KV heads included), and the
refusal is driven with a stand-in for ``torch.cuda.mem_get_info`` (no GPU
needed: it never allocates).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.config import ModelConfig, ParallelConfig
from kvserve.distributed.communicator import Communicator
from kvserve.distributed.parallel_state import ParallelState, building
from kvserve.distributed.sharding import (
    RankLayout,
    check_split,
    layer_range,
    max_rank_bytes,
    rank_bytes,
    smallest_fitting_sizes,
    split_heads,
    vocab_shard,
)
from kvserve.models.registry import get_model_class
from kvserve.models.source import resolve_model_config
from kvserve.plan.counts import Hardware, PlanInputs
from kvserve.plan.gpus import get_gpu
from kvserve.plan.planner import compute_plan, count_params
from kvserve.worker import kv_cache


def test_splits_of_heads_vocab_and_layers() -> None:
    assert [split_heads(32, 8, 4, r).kv_head_start for r in range(4)] == [0, 2, 4, 6]
    # 2 KV heads over 8 ranks: each held by the 4 ranks whose query heads use it
    assert [split_heads(32, 2, 8, r).kv_head_start for r in range(8)] == [0] * 4 + [1] * 4
    assert {split_heads(32, 2, 8, r).num_kv_heads for r in range(8)} == {1}
    assert [vocab_shard(37, 4, r) for r in range(4)] == [(0, 10), (10, 10), (20, 10), (30, 10)]
    assert [layer_range(7, 3, s) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("preset", ["llama-3-8b", "llama-3-70b", "qwen2.5-0.5b"])
def test_rank_bytes_add_up_to_the_model(preset: str) -> None:
    config, _ = resolve_model_config(preset)
    whole = count_params(config).total * 2
    assert max_rank_bytes(config, 2, 1, 1, 0) == whole
    # the stages of a pipeline hold the model between them (a tied head is copied)
    copies = config.hidden_size * config.vocab_size * 2 if config.tie_word_embeddings else 0
    assert sum(rank_bytes(config, 2, 1, 4, s).weights for s in range(4)) == whole + copies
    # 8-way TP: each rank about an eighth (norms are replicated)
    assert whole / 8 <= max_rank_bytes(config, 2, 8, 1, 0) < whole / 8 * 1.01


def test_a_model_that_does_not_fit_names_the_smallest_sizes_that_would(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = resolve_model_config("llama-3-70b")  # 141 GB in bf16
    fits = smallest_fitting_sizes(config, 2, 72e9, 8192)
    assert [(tp, pp) for tp, pp, _ in fits] == [(2, 1), (1, 2)]
    gb = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 * gb, 80 * gb))
    cuda = torch.device("cuda", 0)
    # 0.5 of 85.9 GB, 1.07 GB in use: 41.9 GB a device; 4 ranks need 35.95 GB each
    with pytest.raises(ValueError, match=r"weights need 141\.11 GB in torch\.bfloat16 .*"
                                         r"would fit at tensor_parallel_size=4 \(35\.95 GB per "
                                         r"rank\) or "):
        kv_cache.check_weights_fit(config, torch.bfloat16, cuda, 0.5, ParallelConfig(), 8192)
    two = ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"70\.56 GB per rank at tensor_parallel_size=2 x "
                                         r"pipeline_parallel_size=1"):
        kv_cache.check_weights_fit(config, torch.bfloat16, cuda, 0.5, two, 8192)
    kv_cache.check_weights_fit(config, torch.bfloat16, cuda, 0.9,
                               ParallelConfig(tensor_parallel_size=4), 8192)


# torch.cuda.mem_get_info's totals on the lent cards
H100_BYTES = 85_029_158_912  # NVIDIA H100 80GB HBM3
H200_BYTES = 150_754_820_096  # NVIDIA H200


def test_llama_3_70b_splits_four_eight_and_sixteen_ways() -> None:
    """64 query heads, 8 KV heads: one KV head a rank at TP=8; at TP=16 each
    KV head is held by the two ranks whose query heads use it."""
    config, _ = resolve_model_config("llama-3-70b")
    for tp, pp in ((4, 1), (8, 1), (16, 1), (4, 2), (8, 2)):
        check_split(config, tp, pp)
    eight = [split_heads(64, 8, 8, r) for r in range(8)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in eight] == [
        (8, 1, r) for r in range(8)]
    sixteen = [split_heads(64, 8, 16, r) for r in range(16)]
    assert [s.kv_head_start for s in sixteen] == [r // 2 for r in range(16)]
    assert [s.head_start for s in sixteen] == [4 * r for r in range(16)]
    # replicated KV heads: a rank's KV per token stops shrinking past TP=8
    kv = [rank_bytes(config, 2, tp, 1, 0).kv_per_token for tp in (4, 8, 16)]
    assert kv == [2 * 80 * 2 * 128 * 2, 2 * 80 * 128 * 2, 2 * 80 * 128 * 2]


@pytest.mark.parametrize("tp", [4, 8, 16])
def test_llama_3_70b_rank_bytes_match_the_planner(tp: int) -> None:
    """``kvserve plan --tp`` and the engine's start-up check agree on a rank's
    weights and KV per token (at TP=16 each KV head is held by two ranks)."""
    config, _ = resolve_model_config("llama-3-70b")
    plan = compute_plan(config, Hardware.from_gpu(get_gpu("h100-sxm"), "bf16"),
                        PlanInputs(tp=tp))
    ours = rank_bytes(config, 2, tp, 1, 0)
    assert ours.kv_per_token == plan.kv_bytes_per_token
    assert plan.weight_bytes == ours.weights


def _rank_param_bytes(config: ModelConfig, tp: int, rank: int) -> int:
    """Bytes of the bf16 parameters one TP rank's model is built with (on the
    meta device: nothing allocated, no process group)."""
    state = ParallelState(layout=RankLayout(tp_size=tp, rank=rank),
                          tp=Communicator(None, tp, rank))
    with building(state), torch.device("meta"):
        model = get_model_class(config.architecture)(config).to(torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_plan_weight_bytes_are_what_a_rank_holds_with_replicated_kv_heads(
    architecture: str
) -> None:
    """2 KV heads at TP=4: each rank holds one whole KV head's k and v rows
    (shared with the neighbouring rank), not half of one; the vocabulary of
    250 rows pads to 63 a rank. Qwen2 adds q/k/v biases and a tied head."""
    config = ModelConfig.from_hf_config({
        "architectures": [architecture], "vocab_size": 250, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": architecture == "Qwen2ForCausalLM"})
    hardware = Hardware.from_gpu(get_gpu("h100-sxm"), "bf16")
    for tp in (1, 2, 4):
        plan = compute_plan(config, hardware, PlanInputs(tp=tp))
        held = {_rank_param_bytes(config, tp, rank) for rank in range(tp)}
        assert held == {plan.weight_bytes}, f"tp={tp}"
        assert rank_bytes(config, 2, tp, 1, 0).weights == plan.weight_bytes, f"tp={tp}"


@pytest.mark.parametrize(("total", "tp", "pp"), [
    (H100_BYTES, 4, 1), (H100_BYTES, 8, 1), (H100_BYTES, 4, 2), (H100_BYTES, 2, 2),
    (H200_BYTES, 2, 1), (H200_BYTES, 4, 1), (H200_BYTES, 8, 1),
])
def test_llama_3_70b_fits_the_multi_gpu_runs(
    total: int, tp: int, pp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The splits ``benchmarks/multi_gpu.py`` runs start on the lent cards at
    the default gpu_memory_utilization (0.9), with 1 GiB already in use."""
    config, _ = resolve_model_config("llama-3-70b")
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (total - (1 << 30), total))
    kv_cache.check_weights_fit(config, torch.bfloat16, torch.device("cuda", 0), 0.9,
                               ParallelConfig(tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp), 8192)


def test_llama_3_70b_on_one_h100_names_the_two_way_splits(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = resolve_model_config("llama-3-70b")
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (H100_BYTES - (1 << 30), H100_BYTES))
    # 0.9 of 85.0 GB less 1.07 GB: 75.45 GB; TP=2 needs 70.56 GB of weights and
    # 1.34 GB of KV for 8,192 tokens
    with pytest.raises(ValueError, match=r"141\.11 GB in torch\.bfloat16 .* would fit at "
                                         r"tensor_parallel_size=2 \(71\.90 GB per rank\) or "
                                         r"pipeline_parallel_size=2"):
        kv_cache.check_weights_fit(config, torch.bfloat16, torch.device("cuda", 0), 0.9,
                                   ParallelConfig(), 8192)
