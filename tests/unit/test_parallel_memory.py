"""Per-rank memory arithmetic of a parallel split (``distributed/sharding.py``)
and the start-up refusal that names the smallest sizes that would fit.

The figures are checked against the planner's parameter count (one process
holds exactly the whole model), and the refusal is driven with a stand-in
for ``torch.cuda.mem_get_info`` (no GPU needed: it never allocates).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.config import ParallelConfig
from kvserve.distributed.sharding import (
    layer_range,
    max_rank_bytes,
    rank_bytes,
    smallest_fitting_sizes,
    split_heads,
    vocab_shard,
)
from kvserve.models.source import resolve_model_config
from kvserve.plan.planner import count_params
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
