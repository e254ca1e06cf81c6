"""The host KV tier's books in the core: the host pool's LRU and its
protection of blocks read by the step's copies, the copies the KV manager
lists (out on eviction, in on a host hit, swap-out of a preempted request
with its partial block), LoRA adapters in the key, and the scheduler running
a landing request one step later."""

from __future__ import annotations

import pytest

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.host_pool import HostBlockPool
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler

BLOCK = 4


def make_request(request_id: str, tokens: list[int], lora_int_id: int = 0,
                 max_tokens: int = 4) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   lora_int_id=lora_int_id)


def test_host_pool_lru_eviction_and_protection() -> None:
    pool = HostBlockPool(2)
    assert pool.store(b"a") == 0 and pool.store(b"b") == 1
    assert pool.store(b"a") is None  # already there: made most recent
    assert pool.store(b"c") == 1  # b was least recently used
    assert pool.lookup(b"b") is None and pool.lookup(b"c") == 1 and pool.num_evictions == 1
    assert pool.lookup(b"a") == 0  # a and c are read by this step's copies now
    assert pool.store(b"d") is None  # nothing may be evicted: not kept, no error
    pool.end_step()
    assert pool.store(b"d") == 1  # c (looked up before a) goes first
    assert pool.num_used_blocks == 2
    with pytest.raises(ValueError, match="num_host_blocks=0"):
        HostBlockPool(0)


def fill(kv: KVCacheManager, request: Request) -> None:
    """Admit a request whole (its blocks registered), then finish it."""
    blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.free(request)


def test_eviction_copies_out_and_a_host_hit_copies_in() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK, num_host_blocks=8)  # 4 usable
    first = make_request("a", list(range(13)))  # 3 full blocks + 1 token
    fill(kv, first)
    assert kv.take_transfers() == ([], [], False)
    fill(kv, make_request("b", list(range(100, 113))))  # evicts a's blocks
    first_out, onloads, _ = kv.take_transfers()
    assert len(first_out) == 3 and not onloads  # a's 3 full blocks out
    kv.begin_step()
    again = make_request("c", [*range(13), 50])
    computed, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 0  # nothing of a left on the device
    assert kv.start_onload(again, computed, max_landing=4)
    offloads, onloads, reads_landing = kv.take_transfers()
    assert sorted(host for host, _ in onloads) == sorted(host for _, host in first_out)
    # b's two full blocks evicted to make room for them (its partial one is not kept)
    assert len(offloads) == 2 and not reads_landing
    assert kv.landing["c"] == 12 and kv.host_cache_hits == 12
    assert kv.req_to_blocks["c"] and [b.block_id for b in kv.req_to_blocks["c"]] == [
        device for _, device in onloads]
    # a request reading c's blocks in the same step makes that step wait for them
    same = make_request("d", [*range(13), 60])
    assert kv.get_computed_blocks(same)[1] == 12
    assert kv.take_transfers()[2]


def test_same_step_eviction_is_listed_before_the_copy_in_that_reuses_the_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_host_blocks=8)  # 3 usable
    fill(kv, make_request("a", list(range(9))))  # 2 full blocks
    fill(kv, make_request("b", list(range(100, 109))))  # evicts them
    kv.take_transfers()
    kv.begin_step()
    # a again: its 2 blocks come from the host into blocks b's evicted ones free up
    again = make_request("c", list(range(9)))
    computed, _ = kv.get_computed_blocks(again)
    assert kv.start_onload(again, computed, max_landing=4)
    offloads, onloads, _ = kv.take_transfers()
    refilled = {device for _, device in onloads}
    assert refilled & {device for device, _ in offloads}  # the same blocks: out, then in


def test_lora_adapter_is_part_of_the_host_key() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_host_blocks=8)
    fill(kv, make_request("a", list(range(9)), lora_int_id=1))
    fill(kv, make_request("b", list(range(100, 109))))
    kv.take_transfers()
    other = make_request("c", list(range(9)), lora_int_id=2)
    computed, _ = kv.get_computed_blocks(other)
    assert not kv.start_onload(other, computed, max_landing=4)
    same = make_request("d", list(range(9)), lora_int_id=1)
    computed, _ = kv.get_computed_blocks(same)
    assert kv.start_onload(same, computed, max_landing=4)


def test_swap_out_keeps_the_partial_block_and_the_request_finds_it_again() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, num_host_blocks=8)
    request = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(request, 10) is not None
    request.num_computed_tokens = 10
    request.append_output_token(77)  # its next token, not computed yet
    kv.swap_out(request, 10)
    kv.free(request)
    offloads, _, _ = kv.take_transfers()
    assert len(offloads) == 3 and kv.num_swapped_blocks == 3
    fill(kv, make_request("b", list(range(100, 117))))  # evicts a's full blocks (on host)
    assert kv.take_transfers()[0] == []  # already on the host: nothing copied again
    kv.begin_step()
    request.num_computed_tokens = 0
    computed, _ = kv.get_computed_blocks(request)
    assert kv.start_onload(request, computed, max_landing=4)
    assert kv.landing["a"] == 10  # 2 full blocks and the 2 tokens of the partial one
    assert len(kv.take_transfers()[1]) == 3


def test_scheduler_runs_a_landing_request_one_step_later() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                          CacheConfig(block_size=BLOCK, kv_offload_gb=1.0), num_kv_blocks=6,
                          num_host_kv_blocks=8)
    kv = scheduler.kv_manager
    fill(kv, make_request("a", list(range(13))))
    fill(kv, make_request("b", list(range(100, 113))))
    kv.take_transfers()
    scheduler.add_request(make_request("c", [*range(13), 1, 2]))
    first = scheduler.schedule()
    # a's first block is still on the device, the other two come in; c waits for them
    assert first.is_empty and len(first.kv_onloads) == 2
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"c": 3} and not second.kv_onloads
    [new] = second.new_requests
    assert new.num_computed_tokens == 12 and len(new.block_ids) == 4
    stats = scheduler.stats()
    assert stats["kv_host_cache_hits"] == 8 and stats["prefix_cache_hits"] == 4


def test_config_refuses_swap_without_a_host_tier_and_a_tier_without_caching() -> None:
    with pytest.raises(ValueError, match="preemption_mode='swap' needs kv_offload_gb"):
        CacheConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode='later'"):
        CacheConfig(preemption_mode="later")
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        CacheConfig(kv_offload_gb=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gb=-1"):
        CacheConfig(kv_offload_gb=-1)


def test_metrics_show_the_host_tier_only_when_it_is_on() -> None:
    from kvserve.server.metrics import ServerMetrics

    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=BLOCK, kv_offload_gb=1.0),
                          num_kv_blocks=6, num_host_kv_blocks=8)
    stats = {**scheduler.stats(), "kv_host_bytes_to_host": 4096, "kv_host_copy_to_host_s": 0.5}
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'kvserve:kv_host_blocks_total{model_name="m"} 8.0' in text
    assert 'kvserve:kv_host_bytes_to_host_total{model_name="m"} 4096.0' in text
    assert 'kvserve:kv_host_copy_to_host_seconds_total{model_name="m"} 0.5' in text
    plain = Scheduler(SchedulerConfig(), CacheConfig(block_size=BLOCK), num_kv_blocks=6).stats()
    assert "kv_host" not in ServerMetrics("m", lambda: plain).render().decode()


def test_a_host_block_written_this_step_is_not_copied_in_the_same_step() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_host_blocks=8)  # 3 usable
    fill(kv, make_request("a", list(range(9))))
    fill(kv, make_request("b", list(range(100, 109))))  # evicts a's blocks: copies out queued
    again = make_request("c", list(range(9)))
    computed, _ = kv.get_computed_blocks(again)
    assert not kv.start_onload(again, computed, max_landing=4)  # the copy out runs after
    kv.take_transfers()
    kv.begin_step()
    assert kv.start_onload(again, computed, max_landing=4)  # a step later it is there
