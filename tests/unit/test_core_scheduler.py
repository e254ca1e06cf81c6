"""Scheduler, KV manager and block pool on CPU with a fake executor: the
token-budget rule, prefix caching (keyed by LoRA adapter too), the
``max_loras`` cap, preemption, rejection, and randomised add / abort / step
runs checking the pool's invariants after every step. The stepped runs go
through ``EngineCore`` with async scheduling off and on: the fake model's
token depends on every earlier token, so an output placeholder swapped in
wrong or a step planned on stale state changes the outputs."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from kvserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler
from kvserve.engine.engine_core import EngineCore

VOCAB = 50
EOS = 2


def fake_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids)) % (VOCAB - 3)) + 3


class FakeStep:
    """A step of the fake model; its tokens are computed when read, as a step
    in flight on a device is known only once it is done."""

    def __init__(self, sampling: list[Request]) -> None:
        self.sampling = sampling

    def get(self) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for request in self.sampling:
            # also for a request that finished while the step was in flight
            result.sampled_token_ids[request.request_id] = [fake_token(request.all_token_ids)]
        return result


class FakeExecutor:
    """Samples for every scheduled request whose computed tokens caught up
    (its placeholder added this step); checks the invariants of each step."""

    def __init__(self, scheduler: Scheduler | None = None, num_kv_blocks: int = 0) -> None:
        self.scheduler = scheduler
        self.num_kv_blocks = num_kv_blocks

    def execute_model(self, out: SchedulerOutput) -> FakeStep:
        assert self.scheduler is not None
        check_invariants(self.scheduler, out)
        sampling = []
        for request_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[request_id]
            placeholders = request.num_output_placeholders
            if placeholders and (request.num_computed_tokens
                                 == request.num_tokens + placeholders - 1):
                sampling.append(request)
        return FakeStep(sampling)

    def add_lora(self, lora_request: object) -> None:
        raise AssertionError("no adapters here")


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One synchronous step: schedule, run the fake model, apply its output."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, FakeExecutor(scheduler).execute_model(out).get())
    return out


def make_core(async_scheduling: bool, num_blocks: int = 64, block_size: int = 4,
              step_token_sizes: tuple[int, ...] = (), **kwargs: object) -> EngineCore:
    """An ``EngineCore`` over the fake model (its scheduler has ``num_blocks``)."""
    sched_kwargs = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 128,
                    "async_scheduling": async_scheduling}
    sched_kwargs.update(kwargs)  # type: ignore[arg-type]
    model_config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB,
                               hidden_size=8, intermediate_size=16, num_layers=1, num_heads=1,
                               num_kv_heads=1, head_dim=8, max_position_embeddings=128,
                               sliding_windows=(None,))
    config = EngineConfig(
        model="fake", model_config=model_config, cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(**sched_kwargs),  # type: ignore[arg-type]
        model_path=None, tokenizer_path=None, load_format="dummy", dtype="float32",
        device="cpu", seed=0, attention_backend="torch", cuda_graph_token_sizes=step_token_sizes,
    )
    executor = FakeExecutor(num_kv_blocks=num_blocks - 1)
    core = EngineCore(config, executor)
    executor.scheduler = core.scheduler
    return core


def run_core_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for core_out in core.step():
            outputs.setdefault(core_out.request_id, []).extend(core_out.new_token_ids)
    assert not core.has_unfinished_requests(), "engine core did not finish (deadlock?)"
    return outputs


def finish_and_check(core: EngineCore, got: dict[str, list[int]],
                     expected: dict[str, list[int]], aborted: set[str]) -> None:
    """Run ``core`` dry; each request got its expected tokens (an aborted one
    a prefix of them)."""
    for request_id, tokens in run_core_to_completion(core).items():
        got.setdefault(request_id, []).extend(tokens)
    for request_id, tokens in expected.items():
        if request_id not in aborted:
            assert got[request_id] == tokens, request_id
        else:
            assert got.get(request_id, []) == tokens[:len(got.get(request_id, []))]


def make_scheduler(num_blocks: int = 64, block_size: int = 4,
                   lora_config: LoRAConfig | None = None,
                   step_token_sizes: tuple[int, ...] = (), **kwargs: object) -> Scheduler:
    sched_kwargs = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 128}
    sched_kwargs.update(kwargs)  # type: ignore[arg-type]
    return Scheduler(
        SchedulerConfig(**sched_kwargs),  # type: ignore[arg-type]
        CacheConfig(block_size=block_size),
        num_blocks,
        lora_config,
        step_token_sizes,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 8,
                 priority: int = 0, lora_int_id: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id, prompt, params, eos_token_ids=(EOS,), priority=priority,
                   lora_int_id=lora_int_id)


def check_pool(scheduler: Scheduler) -> None:
    """Every block's reference count is its owners' count; free iff unowned."""
    pool = scheduler.kv_manager.pool
    owners: dict[int, int] = {}
    for blocks in scheduler.kv_manager.req_to_blocks.values():
        for block in blocks:
            owners[block.block_id] = owners.get(block.block_id, 0) + 1
    for block in pool.blocks:
        expected = owners.get(block.block_id, 0) + (block.block_id == NULL_BLOCK_ID)
        assert block.ref_cnt == expected, f"block {block.block_id} ref_cnt mismatch"
        assert not (pool.is_free(block) and block.ref_cnt > 0), "block both free and owned"
        if block.ref_cnt == 0 and block.block_id != NULL_BLOCK_ID:
            assert pool.is_free(block), f"unowned block {block.block_id} not in free queue"


def check_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    check_pool(scheduler)
    cfg = scheduler.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs
    for request in scheduler.running:
        held = len(scheduler.kv_manager.req_to_blocks.get(request.request_id, []))
        assert held == -(-request.num_computed_tokens // scheduler.block_size)
        # one placeholder per step not reported yet: at most this one and the one in flight
        assert request.num_output_placeholders <= 2
        assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    executor = FakeExecutor(scheduler)
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            break
        out = scheduler.schedule()
        for core_out in scheduler.update_from_output(out, executor.execute_model(out).get()):
            outputs.setdefault(core_out.request_id, []).extend(core_out.new_token_ids)
    assert not scheduler.has_unfinished_requests, "scheduler did not finish (deadlock?)"
    return outputs


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt):]


def test_core_imports_no_torch() -> None:
    code = "import sys, kvserve.core.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decodes_first_then_prefill_chunks_fill_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(3, 9)), max_tokens=4))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 6}
    scheduler.update_from_output(out, FakeExecutor(scheduler).execute_model(out).get())
    scheduler.add_request(make_request("b", list(range(3, 23)), max_tokens=4))
    out = scheduler.schedule()
    # a's decode first (1 token), then a 9-token chunk of b's 20-token prompt
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_last_prompt_chunk_is_trimmed_to_end_on_a_step_size() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, step_token_sizes=(8, 16, 24, 64))
    for i in range(3):
        scheduler.add_request(make_request(f"d{i}", [3 + i, 4, 5], max_tokens=8))
    assert sum(step(scheduler).num_scheduled_tokens.values()) == 8  # 9 tokens: 3 + 3 + 2
    assert step(scheduler).num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1}  # d2's last
    scheduler.add_request(make_request("long", list(range(3, 33)), max_tokens=4))
    scheduler.add_request(make_request("short", [7, 8], max_tokens=4))
    out = step(scheduler)
    # 3 decodes + 30 + 2 prompt tokens = 35: the last admitted ("short") cannot be
    # cut to 24 (its chunk would be empty), so the step is padded by the runner
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 30, "short": 2}
    scheduler.add_request(make_request("next", list(range(40, 60)), max_tokens=4))
    out = step(scheduler)
    # 5 decodes + 20 = 25 tokens: "next" gets 19, ending the step on 24
    assert out.num_scheduled_tokens["next"] == 19 and sum(out.num_scheduled_tokens.values()) == 24
    outputs = run_to_completion(scheduler)
    assert outputs["next"] == reference_output(list(range(40, 60)), 4)


def test_chunked_prefill_off_waits_for_whole_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=128, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", list(range(3, 103)), max_tokens=2))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 100}


def test_outputs_match_reference_with_any_budget() -> None:
    prompts = {f"r{i}": [3 + (i * 7 + j) % 40 for j in range(5 + 3 * i)] for i in range(6)}
    for budget in (1, 3, 7, 32, 128):
        scheduler = make_scheduler(max_num_batched_tokens=budget)
        for request_id, prompt in prompts.items():
            scheduler.add_request(make_request(request_id, prompt, max_tokens=6))
        outputs = run_to_completion(scheduler)
        for request_id, prompt in prompts.items():
            assert outputs[request_id] == reference_output(prompt, 6), (budget, request_id)


def test_prefix_cache_hit_on_shared_prompt_and_second_turn() -> None:
    scheduler = make_scheduler(block_size=4)
    system = list(range(3, 19))  # 16 tokens = 4 full blocks
    scheduler.add_request(make_request("a", [*system, 30, 31], max_tokens=3))
    first = run_to_completion(scheduler)
    scheduler.add_request(make_request("b", [*system, 40, 41, 42], max_tokens=3))
    step(scheduler)
    assert scheduler.requests["b"].num_cached_tokens == 16
    run_to_completion(scheduler)
    # second turn: prompt of turn 1 + its answer + a new message
    turn2 = [*system, 30, 31, *first["a"], 50, 51, 52, 53]
    scheduler.add_request(make_request("c", turn2, max_tokens=2))
    step(scheduler)
    assert scheduler.requests["c"].num_cached_tokens == 20
    stats = scheduler.stats()
    assert stats["prefix_cache_hits"] == 36
    run_to_completion(scheduler)
    assert scheduler.kv_manager.pool.num_free_blocks == scheduler.kv_manager.pool.num_usable_blocks


def test_prefix_cache_is_keyed_by_lora_adapter() -> None:
    scheduler = make_scheduler(block_size=4, lora_config=LoRAConfig(max_loras=2))
    prompt = list(range(3, 19))  # 16 tokens = 4 full blocks
    scheduler.add_request(make_request("base", prompt, max_tokens=2))
    run_to_completion(scheduler)
    for request_id, lora_int_id, num_cached in (("lora", 1, 0), ("lora-again", 1, 12),
                                                ("other-lora", 2, 0), ("base-again", 0, 12)):
        scheduler.add_request(make_request(request_id, prompt, 2, lora_int_id=lora_int_id))
        step(scheduler)
        assert scheduler.requests[request_id].num_cached_tokens == num_cached, request_id
        run_to_completion(scheduler)


def test_max_loras_caps_the_adapters_running_at_once() -> None:
    scheduler = make_scheduler(lora_config=LoRAConfig(max_loras=2), max_num_batched_tokens=64)
    adapters = {"a": 1, "b": 2, "c": 3, "d": 1, "e": 0, "f": 3}
    prompts = {r: [3 + i, 10, 11, 12 + i] for i, r in enumerate(adapters)}
    for request_id, lora_int_id in adapters.items():
        scheduler.add_request(make_request(request_id, prompts[request_id], max_tokens=4,
                                           lora_int_id=lora_int_id))
    out = scheduler.schedule()
    # adapter 3 waits (c and f); d (adapter 1, resident) and e (no adapter) go past it
    assert list(out.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert [r.lora_int_id for r in out.new_requests] == [1, 2, 1, 0]
    executor = FakeExecutor(scheduler)
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests:
        for core_out in scheduler.update_from_output(out, executor.execute_model(out).get()):
            outputs.setdefault(core_out.request_id, []).extend(core_out.new_token_ids)
        out = scheduler.schedule()
        assert len({r.lora_int_id for r in scheduler.running} - {0}) <= 2
    assert outputs == {r: reference_output(p, 4) for r, p in prompts.items()}


def test_full_prompt_hit_still_computes_last_token() -> None:
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(3, 11))  # exactly 2 blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    out = scheduler.schedule()
    assert scheduler.requests["b"].num_cached_tokens == 4
    assert out.num_scheduled_tokens == {"b": 4}


def test_shared_blocks_are_one_copy() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    system = list(range(3, 19))
    scheduler.add_request(make_request("a", [*system, 30], max_tokens=8))
    out = scheduler.schedule()
    scheduler.update_from_output(out, FakeExecutor(scheduler).execute_model(out).get())
    scheduler.add_request(make_request("b", [*system, 31], max_tokens=8))
    scheduler.schedule()
    blocks_a = scheduler.kv_manager.get_block_ids("a")
    blocks_b = scheduler.kv_manager.get_block_ids("b")
    assert blocks_a[:4] == blocks_b[:4]
    assert blocks_a[4] != blocks_b[4]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_gives_identical_outputs(async_scheduling: bool) -> None:
    prompts = {f"r{i}": [3 + (i * 5 + j) % 41 for j in range(9 + i)] for i in range(5)}
    roomy = make_core(async_scheduling, num_blocks=200)
    tight = make_core(async_scheduling, num_blocks=12)
    for core in (roomy, tight):
        for request_id, prompt in prompts.items():
            core.add_request(make_request(request_id, prompt, max_tokens=20))
    outputs = run_core_to_completion(roomy)
    assert outputs == run_core_to_completion(tight)
    assert outputs == {r: reference_output(p, 20) for r, p in prompts.items()}
    assert tight.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_reporting_first_and_last_only_get_the_same_tokens(
        async_scheduling: bool) -> None:
    prompts = {f"r{i}": [3 + (i * 7 + j) % 41 for j in range(5 + 2 * i)] for i in range(5)}
    # tight: preempted requests resume and still report every token once
    core = make_core(async_scheduling, num_blocks=12)
    for i, (request_id, prompt) in enumerate(prompts.items()):
        request = make_request(request_id, prompt, max_tokens=1 if i == 0 else 20)
        request.report_every_step = i % 2 == 1  # r0 (one token), r2, r4: first and last only
        core.add_request(request)
    reports: dict[str, list[list[int]]] = {}
    while core.has_unfinished_requests():
        for core_out in core.step():
            reports.setdefault(core_out.request_id, []).append(core_out.new_token_ids)
    assert core.scheduler.num_preemptions > 0
    for i, (request_id, prompt) in enumerate(prompts.items()):
        max_tokens = 1 if i == 0 else 20
        tokens = [t for report in reports[request_id] for t in report]
        assert tokens == reference_output(prompt, max_tokens)
        if i % 2 == 0:  # the first token alone, then all the rest at the end
            assert [len(r) for r in reports[request_id]] == [1, max_tokens - 1][:max_tokens]
        else:
            assert len(reports[request_id]) == max_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_policy_preempts_least_important(async_scheduling: bool) -> None:
    core = make_core(async_scheduling, num_blocks=9, policy="priority",
                     max_num_batched_tokens=64)
    core.add_request(make_request("low", list(range(3, 15)), max_tokens=12, priority=5))
    core.add_request(make_request("high", list(range(20, 32)), max_tokens=12, priority=0))
    outputs = run_core_to_completion(core)
    assert outputs["high"] == reference_output(list(range(20, 32)), 12)
    assert outputs["low"] == reference_output(list(range(3, 15)), 12)
    assert core.scheduler.num_preemptions > 0


def test_async_scheduling_keeps_one_step_in_flight() -> None:
    core = make_core(True)
    prompt = list(range(3, 9))
    core.add_request(make_request("a", prompt, max_tokens=3))
    assert core.step() == []  # the prefill is queued, not reported yet
    request = core.scheduler.requests["a"]
    # the decode of the token being sampled is planned before it is known
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 6
    [first] = core.step()
    assert first.new_token_ids == reference_output(prompt, 1)
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 7
    [second] = core.step()
    # the third token is the last (max_tokens): nothing more is scheduled
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 8
    [third] = core.step()
    assert third.finish_reason == "length" and not core.has_unfinished_requests()
    assert [*first.new_token_ids, *second.new_token_ids, *third.new_token_ids] == (
        reference_output(prompt, 3))
    assert core.num_steps == 3


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "needle"),
    [(120, 20, "max_model_len"), (0, 4, "prompt"), (60, 60, "KV blocks")],
)
def test_requests_that_can_never_fit_are_rejected(
    prompt_len: int, max_tokens: int, needle: str
) -> None:
    scheduler = make_scheduler(num_blocks=20, block_size=4)
    with pytest.raises(ValueError, match=needle):
        scheduler.add_request(make_request("x", list(range(prompt_len)), max_tokens=max_tokens))
    assert not scheduler.has_unfinished_requests


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks_and_others_finish(async_scheduling: bool) -> None:
    core = make_core(async_scheduling)
    core.add_request(make_request("a", list(range(3, 20)), max_tokens=10))
    core.add_request(make_request("b", list(range(5, 9)), max_tokens=10))
    outputs: dict[str, list[int]] = {}
    for core_out in core.step() + core.step():
        outputs.setdefault(core_out.request_id, []).extend(core_out.new_token_ids)
    core.abort_requests(["a"])  # with async scheduling a's next step is in flight
    for request_id, tokens in run_core_to_completion(core).items():
        outputs.setdefault(request_id, []).extend(tokens)
    assert outputs["b"] == reference_output(list(range(5, 9)), 10)
    # two steps report two tokens each, or one with the second still in flight
    assert outputs["a"] == reference_output(list(range(3, 20)), 1 if async_scheduling else 2)
    pool = core.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_token_and_eos(async_scheduling: bool) -> None:
    core = make_core(async_scheduling)
    prompt = list(range(3, 10))
    expected = reference_output(prompt, 10)
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[expected[3]])
    core.add_request(Request("a", prompt, params, eos_token_ids=(EOS,)))
    core.add_request(make_request("b", prompt, max_tokens=10))
    outputs = run_core_to_completion(core)
    assert outputs["a"] == expected[: expected.index(expected[3]) + 1]
    assert outputs["b"] == expected
    pool = core.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_block_pool_lru_eviction_keeps_recent_prefixes() -> None:
    pool = BlockPool(num_blocks=4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, b"a")
    pool.cache_full_block(b, b"b")
    pool.free_blocks([a])
    pool.free_blocks([b])
    assert pool.get_cached_block(b"a") is a
    pool.free_blocks([c])
    [first] = pool.get_new_blocks(1)  # evicts the least recently freed: a
    assert first is a and pool.get_cached_block(b"a") is None
    assert pool.get_cached_block(b"b") is b


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_randomised_add_abort_step_keeps_invariants(seed: int, async_scheduling: bool) -> None:
    rng = random.Random(seed)
    core = make_core(
        async_scheduling,
        num_blocks=rng.choice([10, 16, 40]),
        block_size=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([4, 16, 64]),
        max_num_seqs=rng.choice([1, 3, 8]),
        max_model_len=64,
        policy=rng.choice(["fcfs", "priority"]),
        step_token_sizes=rng.choice([(), (2, 4, 8, 16, 64), (3, 5)]),
    )
    prefixes = [[3 + rng.randrange(40) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for step_index in range(300):
        action = rng.random()
        if action < 0.15:
            suffix = [3 + rng.randrange(40) for _ in range(rng.randrange(1, 8))]
            prompt = rng.choice(prefixes) + suffix
            max_tokens = rng.randrange(1, 12)
            request = make_request(f"q{step_index}", prompt, max_tokens,
                                   priority=rng.randrange(3))
            try:
                core.add_request(request)
            except ValueError:
                continue
            expected[request.request_id] = reference_output(prompt, max_tokens)
        elif action < 0.2 and core.scheduler.requests:
            victim = rng.choice(sorted(core.scheduler.requests))
            core.abort_requests([victim])
            aborted.add(victim)
        for core_out in core.step():
            got.setdefault(core_out.request_id, []).extend(core_out.new_token_ids)
    finish_and_check(core, got, expected, aborted)
    pool = core.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    for block in pool.blocks[1:]:
        assert block.ref_cnt == 0
