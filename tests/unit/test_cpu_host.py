"""An engine on the CPU and its host: the torch thread rule, the memory and
core readings, the KV pool sized for the model, and the up-front refusal of
a model that cannot fit in memory (with the numbers)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.assets import default_model_path
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.models.source import resolve_model_config
from kvserve.worker import cpu_host, kv_cache
from kvserve.worker.cpu_host import choose_num_threads
from kvserve.worker.kv_cache import (
    CPU_KV_MEMORY_SHARE,
    KVCacheSpec,
    check_weights_fit,
    cpu_kv_budget_bytes,
    weights_bytes,
)

GB = 10**9


def spec_of(model: ModelConfig) -> KVCacheSpec:
    return KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim)


def budget_of(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig,
              dtype: torch.dtype) -> int:
    return cpu_kv_budget_bytes(weights_bytes(model, dtype), spec_of(model), cache, sched, dtype)


@pytest.mark.parametrize(("requested", "env", "usable", "idle", "expected"), [
    (3, 2, 8, 0.0, 3),  # the flag wins
    (None, 2, 8, 0.0, 2),  # then OMP_NUM_THREADS
    (None, None, 8, 8.0, 8),  # an idle machine: every usable core
    (None, None, 2, 0.1, 1),  # a busy one: at least one thread
    (None, None, 8, 3.8, 4),  # 3.8 idle cores count as 4
    (None, None, 8, 3.6, 3),
    (None, None, 4, 16.0, 4),  # never above the usable cores (quota, affinity)
    (None, None, 6, None, 6),  # no /proc/stat: the usable cores
])
def test_thread_rule(requested: int | None, env: int | None, usable: int, idle: float | None,
                     expected: int) -> None:
    choice = choose_num_threads(requested, env, usable, idle)
    assert choice.num_threads == expected and choice.reason


def test_host_readings_are_plausible() -> None:
    usable = cpu_host.usable_cores()
    assert 1 <= usable <= (torch.multiprocessing.cpu_count() or 1)
    idle = cpu_host.idle_cores(sample_s=0.05)
    if idle is not None:  # Linux
        assert 0.0 <= idle <= usable + 0.5
    available, total = cpu_host.available_memory_bytes(), cpu_host.total_memory_bytes()
    if available is not None and total is not None:
        assert 0 < available <= total


def test_configure_sets_torch_threads_once_per_request(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_host, "_chosen", {})
    try:
        with caplog.at_level(logging.INFO, logger=cpu_host.__name__):
            assert cpu_host.configure_cpu_threads(1).reason == "--num-cpu-threads"
            assert cpu_host.configure_cpu_threads(1).num_threads == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    # logged once, and the flag that chose it is not offered as the way to change it
    assert caplog.messages == ["CPU: torch uses 1 thread (--num-cpu-threads)"]


def test_cpu_kv_pool_is_sized_for_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 16 * GB)
    model, _ = resolve_model_config(str(default_model_path()))
    cache, sched = CacheConfig(), SchedulerConfig(max_model_len=2048, max_num_seqs=256)
    budget = budget_of(model, cache, sched, torch.float32)
    request_bytes = 2048 // 16 * spec_of(model).bytes_per_block(16, torch.float32)
    # the bundled model: its weights' size, which holds more than 4 requests of 2,048
    assert budget == weights_bytes(model, torch.float32) > 4 * request_bytes
    assert budget < 0.1 * GB  # not the fixed gigabyte of before
    # a short max_model_len: still the weights' size
    small = budget_of(model, cache, SchedulerConfig(max_model_len=256),
                                torch.float32)
    assert small == budget
    # little memory left: at most half of it
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 40 * 10**6)
    assert budget_of(model, cache, sched, torch.float32) == int(
        40 * 10**6 * CPU_KV_MEMORY_SHARE)
    # an explicit budget wins
    explicit = CacheConfig(cpu_kv_cache_bytes=12345678)
    assert budget_of(model, explicit, sched, torch.float32) == 12345678


def test_a_long_context_takes_at_least_four_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 1000 * GB)
    model, _ = resolve_model_config("qwen2.5-0.5b")
    sched = SchedulerConfig(max_model_len=32768, max_num_seqs=256)
    budget = budget_of(model, CacheConfig(), sched, torch.bfloat16)
    request_bytes = 32768 // 16 * spec_of(model).bytes_per_block(16, torch.bfloat16)
    assert budget == 4 * request_bytes > weights_bytes(model, torch.bfloat16)
    one_seq = SchedulerConfig(max_model_len=32768, max_num_seqs=1)
    assert budget_of(model, CacheConfig(), one_seq, torch.bfloat16) == max(
        request_bytes, weights_bytes(model, torch.bfloat16))


def test_weights_that_cannot_fit_in_memory_are_refused_with_the_numbers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 20 * GB)
    monkeypatch.setattr(kv_cache, "total_memory_bytes", lambda: 24 * GB)
    model, _ = resolve_model_config("llama-3-8b")
    with pytest.raises(ValueError) as info:
        check_weights_fit(model, torch.float32, torch.device("cpu"), 0.9, max_model_len=8192)
    message = str(info.value)
    # one request of 8,192 tokens: 2 (K, V) x 32 layers x 8 KV heads x 128 x 4 bytes each
    assert "weights need 32.12 GB in torch.float32 plus 2.15 GB of KV cache" in message
    assert "20.00 GB of memory available (24.0 GB in all)" in message
    assert "--dtype bfloat16 (16.06 GB of weights)" in message
    # in bfloat16 it fits
    check_weights_fit(model, torch.bfloat16, torch.device("cpu"), 0.9, max_model_len=8192)
