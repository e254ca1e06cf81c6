"""The host KV tier on the CPU (a second pool in ordinary memory): the
copies move bytes of any dtype in the order listed (a block evicted and
refilled in one step keeps both contents right); the whole engine gives the
same greedy tokens with the tier on and off across eviction and return, with
a host pool too small for the working set, with swap preemption and with
async scheduling; the copied-in KV is really what the model reads; a tier
larger than the host's memory is refused at start-up with the numbers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker import kv_offload
from kvserve.worker.kv_offload import KVOffloader

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# four 33-token prefixes, each asked three times, cycling: with a device pool
# of one or two requests, each prefix comes back after it was evicted
PREFIXES = [list(range(100 + 40 * i, 133 + 40 * i)) for i in range(4)]
PROMPTS = [[*prefix, 7, 8, 9 + turn] for turn in range(3) for prefix in PREFIXES]
TINY_POOL = {"block_size": 4, "num_kv_blocks": 12, "max_num_seqs": 1}


def test_copies_move_any_dtype_and_a_refilled_block_keeps_both_contents() -> None:
    keys = torch.randn(2, 6, 4, 2, 8).to(torch.bfloat16)
    scales = torch.randn(2, 6, 3).to(torch.float8_e4m3fn)  # per-block scales of a quantised KV
    codes = torch.randint(0, 255, (6, 5), dtype=torch.uint8)  # blocks on dim 0
    before = [t.clone() for t in (keys, scales, codes)]
    offloader = KVOffloader([(keys, 1), (scales, 1), (codes, 0)], 6, torch.device("cpu"),
                            max_step_blocks=2)  # 2 staging blocks: 3 copies take two rounds
    offloader.transfer([(3, 1), (5, 2), (1, 0)], [], False)
    # one step: block 2 goes out to host 3 while host 1 (block 3's) comes into it
    offloader.transfer([(2, 3)], [(1, 2), (0, 4)], False)
    offloader.transfer([], [(3, 5)], False)
    for now, old in zip((keys, scales, codes), before):
        dim = 0 if now is codes else 1
        for device_block, source in ((2, 3), (4, 1), (5, 2)):
            assert torch.equal(now.select(dim, device_block).view(torch.uint8),
                               old.select(dim, source).view(torch.uint8))
    stats = offloader.stats()
    assert stats["kv_host_bytes_to_host"] == 4 * offloader.block_bytes
    assert stats["kv_host_bytes_to_device"] == 3 * offloader.block_bytes


def generate_each(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One request at a time, so every prefix has left the device before it returns."""
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Callable[[str], Path]) -> list[list[int]]:
    llm = LLM(model=str(tiny_checkpoint("llama")), enable_prefix_caching=False)
    return generate_each(llm, PROMPTS)


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True},
                                     {"num_kv_blocks": 24, "max_num_seqs": 2},
                                     {"max_num_batched_tokens": 8}])
def test_greedy_identical_with_the_tier_across_eviction_and_return(
    options: dict[str, Any], tiny_checkpoint: Callable[[str], Path],
    reference: list[list[int]],
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), kv_offload_gb=0.001,
              **{**TINY_POOL, **options})
    assert generate_each(llm, PROMPTS) == reference
    stats = llm.stats()
    assert stats["kv_host_cache_hits"] >= 2 * 4 * 32  # turns 2 and 3 of each prefix
    assert stats["kv_host_bytes_to_device"] > 0 and stats["kv_host_bytes_to_host"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantised_kv_and_its_scales_come_back_from_the_tier(
        kv_cache_dtype: str, tiny_checkpoint: Callable[[str], Path]) -> None:
    path = str(tiny_checkpoint("llama"))
    expected = generate_each(LLM(model=path, enable_prefix_caching=False,
                                 kv_cache_dtype=kv_cache_dtype), PROMPTS)
    llm = LLM(model=path, kv_offload_gb=0.001, kv_cache_dtype=kv_cache_dtype, **TINY_POOL)
    assert generate_each(llm, PROMPTS) == expected
    assert llm.stats()["kv_host_bytes_to_device"] > 0


def test_the_model_reads_the_copied_in_kv(tiny_checkpoint: Callable[[str], Path],
                                          reference: list[list[int]]) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), kv_offload_gb=0.001, **TINY_POOL)
    assert generate_each(llm, PROMPTS[:4]) == reference[:4]
    offloader = llm.engine.core.executor.kv_offloader  # type: ignore[attr-defined]
    offloader.host.fill_(0)  # every host copy now says zero
    assert generate_each(llm, PROMPTS[4:8]) != reference[4:8]


def test_a_full_host_pool_evicts_and_never_fails(tiny_checkpoint: Callable[[str], Path],
                                                 reference: list[list[int]]) -> None:
    # 10 host blocks of 2 KB: room for one prefix of the four
    llm = LLM(model=str(tiny_checkpoint("llama")), kv_offload_gb=20480 / 1e9, **TINY_POOL)
    assert generate_each(llm, PROMPTS) == reference
    stats = llm.stats()
    assert stats["kv_host_blocks_total"] == 10 == stats["kv_host_blocks_used"]
    assert stats["kv_host_offloaded_blocks"] > 10  # stored over and over: LRU evicted


@pytest.mark.parametrize(("mode", "async_scheduling"),
                         [("recompute", False), ("swap", False), ("swap", True)])
def test_preemption_modes_give_identical_output(
    mode: str, async_scheduling: bool, tiny_checkpoint: Callable[[str], Path],
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), block_size=4, num_kv_blocks=20,
              kv_offload_gb=0.001, preemption_mode=mode, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [p[:20 + 3 * i] for i, p in enumerate(PREFIXES)]
    roomy = LLM(model=str(tiny_checkpoint("llama")), enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["kv_host_swapped_blocks"] > 0) == (mode == "swap")


def test_a_tier_larger_than_host_memory_is_refused(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_offload, "available_memory_bytes", lambda: 10**9)
    with pytest.raises(ValueError, match=r"kv_offload_gb=5.0 needs 5.00 GB of host memory.*"
                                         r"1.00 GB available"):
        LLM(model=str(tiny_checkpoint("llama")), kv_offload_gb=5.0, block_size=4)
    kv_offload.check_host_memory(0.9, 90, 10**7)  # 0.9 GB of 1 GB: fine
    with pytest.raises(ValueError, match=r"1.80 GB of host memory .* on each of 2 ranks"):
        kv_offload.check_host_memory(1.8, 90, 10**7, num_ranks=2)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(model=str(tiny_checkpoint("llama")), kv_offload_gb=1e-9, block_size=4)
