"""The host KV tier on a CUDA device (skipped without one): copies on the side
stream against a step that overwrites the evicted blocks at once (the
pinned host copy keeps their old KV), copies in that the next step waits
for, and the engine's greedy tokens identical with the tier on and off
with async scheduling, CUDA graphs and swap preemption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.kv_offload import KVOffloader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PREFIXES = [list(range(100 + 40 * i, 133 + 40 * i)) for i in range(4)]
PROMPTS = [[*prefix, 7, 8, 9 + turn] for turn in range(3) for prefix in PREFIXES]


def test_an_evicted_block_overwritten_at_once_keeps_its_host_copy() -> None:
    # 64 blocks of 4 MB each per tensor: the copy out takes long enough to race
    pool = torch.randn(2, 65, 1024, 8, 128, dtype=torch.bfloat16, device="cuda")
    before = pool.clone()
    offloader = KVOffloader([(pool, 1)], 64, torch.device("cuda"), max_step_blocks=64)
    offloader.transfer([(block, block - 1) for block in range(1, 65)], [], False)
    pool.fill_(0)  # the step after: every evicted block is overwritten on the main stream
    torch.cuda.synchronize()
    host = offloader.host.view(64, 2, 1024, 8, 128 * 2)
    assert torch.equal(host, before[:, 1:].view(torch.uint8).movedim(1, 0).cpu())
    # copies in: the next step's first read waits for them
    offloader.transfer([], [(host_id, host_id + 1) for host_id in range(64)], False)
    offloader.transfer([], [], False)
    assert torch.equal(pool[:, 1:], before[:, 1:])
    stats = offloader.stats()
    torch.cuda.synchronize()
    assert stats["kv_host_bytes_to_device"] == stats["kv_host_bytes_to_host"] > 0


def generate_each(llm: LLM) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}])
def test_greedy_identical_with_the_tier_on_cuda(
    options: dict[str, bool], tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = str(tiny_checkpoint("llama"))
    common = {"dtype": "float32", "device": "cuda", "block_size": 4, "max_num_seqs": 1,
              **options}
    reference = generate_each(LLM(model=path, enable_prefix_caching=False, **common))
    llm = LLM(model=path, num_kv_blocks=12, kv_offload_gb=0.001, **common)
    assert generate_each(llm) == reference
    stats = llm.stats()
    assert stats["kv_host_cache_hits"] > 0 and stats["kv_host_copy_to_device_s"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_preemption_identical_on_cuda(mode: str,
                                           tiny_checkpoint: Callable[[str], Path]) -> None:
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [p[:20 + 3 * i] for i, p in enumerate(PREFIXES)]
    common = {"dtype": "float32", "device": "cuda", "block_size": 4}
    roomy = LLM(model=path, enable_prefix_caching=False, **common)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=path, num_kv_blocks=20, kv_offload_gb=0.001, preemption_mode=mode, **common)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected and llm.stats()["num_preemptions"] > 0
