"""Speculative decoding in the core, on CPU with a fake model and a fake
proposer: a decode of ``1 + k`` tokens, rollback of rejected proposals
(whole blocks freed), lookahead slots for proposers that write KV, only
accepted tokens in the prefix cache, ``max_tokens`` and stop tokens landing
mid-proposal, per-request k, preemption, chunked prefill and async
scheduling (planning ahead of the step in flight, for proposers on the
device); and randomised add / abort / step runs that check the pool's
invariants after every step. The fake proposer is right about the fake
model's next tokens only part of the time, so every path through the
verification is taken; outputs must equal the plain greedy reference."""

from __future__ import annotations

import random

import pytest

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.core.outputs import CARRIED_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from kvserve.core.prefix_cache import update_block_hashes
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.scheduler import Scheduler
from kvserve.engine.engine_core import EngineCore
from tests.unit.test_core_scheduler import (
    EOS,
    VOCAB,
    check_pool,
    fake_token,
    finish_and_check,
    make_request,
    reference_output,
    run_core_to_completion,
)


def fake_proposals(request_id: str, token_ids: list[int], num: int, hit_rate: float) -> list[int]:
    """The fake model's next ``num`` tokens, each wrong with probability 1 - hit_rate
    (decided by a generator keyed on the request and its length)."""
    rng = random.Random(f"{request_id}:{len(token_ids)}")
    tokens = list(token_ids)
    proposals = []
    for _ in range(num):
        token = fake_token(tokens)
        tokens.append(token)
        proposals.append(token if rng.random() < hit_rate else 3 + (token - 2) % (VOCAB - 3))
    return proposals


class FakeSpecStep:
    """A step of the fake model: verifies each request's proposals greedily
    (the longest prefix the model agrees with, then the model's own token)
    and proposes for the next step; computed when read (steps are read in
    order, so a request's tokens are then those of the steps before). A
    ``CARRIED_TOKEN_ID`` proposal is one the previous step made."""

    def __init__(self, sampling: list[Request], out: SchedulerOutput, hit_rate: float,
                 made: dict[str, list[int]]) -> None:
        self.sampling, self.out, self.hit_rate = sampling, out, hit_rate
        self.made = made  # request id -> the proposals its last step made

    def get(self) -> ModelRunnerOutput:
        result = ModelRunnerOutput(device_s=1e-3)
        for request in self.sampling:
            request_id = request.request_id
            tokens = list(request.all_token_ids)
            accepted = []
            verified = self.out.scheduled_spec_token_ids.get(request_id, [])
            if verified and verified[0] == CARRIED_TOKEN_ID:
                assert len(self.made[request_id]) >= len(verified)
                verified = self.made[request_id][:len(verified)]
            for proposal in verified:
                if fake_token(tokens) != proposal:
                    break
                accepted.append(proposal)
                tokens.append(proposal)
            bonus = fake_token(tokens)
            result.sampled_token_ids[request_id] = [*accepted, bonus]
            num_draft = self.out.num_draft_tokens.get(request_id, 0)
            if num_draft:
                result.spec_token_ids[request_id] = self.made[request_id] = fake_proposals(
                    request_id, [*tokens, bonus], num_draft, self.hit_rate)
        return result


class FakeSpecExecutor:
    """Checks the invariants of every step, then runs it with the fake model."""

    def __init__(self, hit_rate: float, num_kv_blocks: int) -> None:
        self.hit_rate = hit_rate
        self.num_kv_blocks = num_kv_blocks
        self.scheduler: Scheduler | None = None
        self.num_spec_scheduled = 0
        self.made: dict[str, list[int]] = {}

    def execute_model(self, out: SchedulerOutput) -> FakeSpecStep:
        assert self.scheduler is not None
        check_spec_invariants(self.scheduler, out)
        self.num_spec_scheduled += sum(map(len, out.scheduled_spec_token_ids.values()))
        sampling = []
        for request_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[request_id]
            num_spec = len(out.scheduled_spec_token_ids.get(request_id, []))
            placeholders = request.num_output_placeholders
            # planning ahead, the placeholders count the verified proposals too
            if self.scheduler.plans_ahead:
                num_spec = 0
            if placeholders and (request.num_computed_tokens
                                 == request.num_tokens + placeholders - 1 + num_spec):
                sampling.append(request)
        return FakeSpecStep(sampling, out, self.hit_rate, self.made)

    def add_lora(self, lora_request: object) -> None:
        raise AssertionError("no adapters here")


def check_spec_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The pool's invariants, with each request's blocks covering exactly its
    computed tokens plus, in a step where it proposes, its lookahead slots
    (planning ahead: those of the proposals in flight); every registered
    block full of the owner's accepted tokens."""
    kv = scheduler.kv_manager
    pool = kv.pool
    check_pool(scheduler)
    cfg = scheduler.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(scheduler.running) <= cfg.max_num_seqs
    lookahead = out.num_draft_tokens if scheduler._uses_lookahead else {}
    for request in scheduler.running:
        request_id = request.request_id
        blocks = kv.req_to_blocks.get(request_id, [])
        num_slots = request.num_computed_tokens + lookahead.get(request_id, 0)
        if scheduler.plans_ahead:  # the step in flight may still write its own lookahead
            max_slots = request.num_computed_tokens + scheduler.spec_policy.max_k
            assert (-(-num_slots // scheduler.block_size) <= len(blocks)
                    <= -(-min(max_slots, request.max_num_tokens) // scheduler.block_size))
        else:
            assert len(blocks) == -(-num_slots // scheduler.block_size), request_id
        assert num_slots <= request.max_num_tokens
        spec = out.scheduled_spec_token_ids.get(request_id, [])
        assert len(spec) <= request.max_spec_tokens
        assert request.num_computed_tokens <= (request.num_tokens
                                               + request.num_output_placeholders + len(spec))
        hashes = update_block_hashes(request, scheduler.block_size)
        for i, block in enumerate(blocks):
            if block.block_hash is not None and pool.get_cached_block(block.block_hash) is block:
                assert block.block_hash == hashes[i], f"{request_id}: block {i} not accepted"


def make_spec_core(async_scheduling: bool, *, num_blocks: int = 64, block_size: int = 4,
                   k: int = 3, method: str = "ngram", hit_rate: float = 0.7,
                   **kwargs: object) -> tuple[EngineCore, FakeSpecExecutor]:
    sched_kwargs = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 128,
                    "async_scheduling": async_scheduling}
    sched_kwargs.update(kwargs)  # type: ignore[arg-type]
    model_config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB,
                               hidden_size=8, intermediate_size=16, num_layers=1, num_heads=1,
                               num_kv_heads=1, head_dim=8, max_position_embeddings=128,
                               sliding_windows=(None,))
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k,
                             model="fake" if method in ("draft_model", "eagle") else None,
                             auto_disable=False)
    config = EngineConfig(
        model="fake", model_config=model_config, cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(**sched_kwargs),  # type: ignore[arg-type]
        model_path=None, tokenizer_path=None, load_format="dummy", dtype="float32",
        device="cpu", seed=0, attention_backend="torch", speculative_config=spec,
    )
    executor = FakeSpecExecutor(hit_rate, num_kv_blocks=num_blocks - 1)
    core = EngineCore(config, executor)
    executor.scheduler = core.scheduler
    return core, executor


def assert_pool_idle(core: EngineCore) -> None:
    pool = core.scheduler.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_of_one_plus_k_tokens_and_rollback(method: str) -> None:
    core, executor = make_spec_core(False, method=method, k=3, hit_rate=0.0)
    scheduler = core.scheduler
    scheduler.add_request(make_request("a", list(range(3, 11)), max_tokens=30))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 8} and out.num_draft_tokens == {"a": 3}
    # the draft model writes KV for its 3 proposals past the 8 prompt tokens
    assert len(scheduler.kv_manager.req_to_blocks["a"]) == (3 if method == "draft_model" else 2)
    scheduler.update_from_output(out, executor.execute_model(out).get())
    request = scheduler.requests["a"]
    proposals = list(request.spec_token_ids)
    assert request.num_computed_tokens == 8 and len(proposals) == 3
    assert len(scheduler.kv_manager.req_to_blocks["a"]) == 2  # lookahead blocks freed
    out = scheduler.schedule()
    # the last token and 3 proposals; 4 more lookahead slots for the draft model
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_token_ids == {"a": proposals}
    assert len(scheduler.kv_manager.req_to_blocks["a"]) == (4 if method == "draft_model" else 3)
    scheduler.update_from_output(out, executor.execute_model(out).get())
    # every proposal rejected (hit rate 0): one token more, 3 slots rolled back
    assert request.num_computed_tokens == 9 and request.num_output_tokens == 2
    assert len(scheduler.kv_manager.req_to_blocks["a"]) == 3
    stats = scheduler.stats()
    assert stats["spec_decode_num_draft_tokens"] == 3
    assert stats["spec_decode_num_accepted_tokens"] == 0
    assert stats["spec_decode_num_drafted_tokens_per_pos"] == [1, 1, 1]
    assert run_core_to_completion(core)["a"] == reference_output(list(range(3, 11)), 30)[2:]
    assert_pool_idle(core)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("hit_rate", [0.0, 0.5, 1.0])
def test_outputs_equal_plain_greedy(async_scheduling: bool, hit_rate: float) -> None:
    prompts = {f"r{i}": [3 + (i * 7 + j) % 40 for j in range(5 + 3 * i)] for i in range(6)}
    core, _ = make_spec_core(async_scheduling, hit_rate=hit_rate, k=4)
    for request_id, prompt in prompts.items():
        core.add_request(make_request(request_id, prompt, max_tokens=13))
    outputs = run_core_to_completion(core)
    assert outputs == {r: reference_output(p, 13) for r, p in prompts.items()}
    stats = core.scheduler.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if hit_rate == 1.0:  # every proposal accepted: each verification adds k + 1 tokens or ends
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    if hit_rate == 0.0:
        assert stats["spec_decode_num_accepted_tokens"] == 0
    assert_pool_idle(core)


def test_max_tokens_mid_proposal_never_overshoots() -> None:
    core, executor = make_spec_core(False, hit_rate=1.0, k=4)
    prompt = list(range(3, 8))
    core.add_request(make_request("a", prompt, max_tokens=7))
    steps = []
    while core.has_unfinished_requests():
        out = core.scheduler.schedule()
        steps.append((dict(out.num_scheduled_tokens), dict(out.num_draft_tokens)))
        core.scheduler.update_from_output(out, executor.execute_model(out).get())
    # the prefill proposes 4; the next step verifies them (all right: 5 tokens, 6 outputs
    # so far) and proposes only 2 (KV room to max_tokens), which the last step cannot use
    assert steps == [({"a": 5}, {"a": 4}), ({"a": 5}, {"a": 2}), ({"a": 1}, {})]
    assert_pool_idle(core)


def test_stop_token_mid_proposal() -> None:
    prompt = list(range(3, 10))
    expected = reference_output(prompt, 20)
    core, _ = make_spec_core(False, hit_rate=1.0, k=4)
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[expected[5]])
    core.add_request(Request("a", prompt, params, eos_token_ids=(EOS,)))
    outputs = run_core_to_completion(core)
    assert outputs["a"] == expected[: expected.index(expected[5]) + 1]
    assert_pool_idle(core)


def test_only_accepted_tokens_enter_the_prefix_cache() -> None:
    core, _ = make_spec_core(False, hit_rate=0.5, k=3, block_size=4)
    prompt = list(range(3, 14))
    core.add_request(make_request("a", prompt, max_tokens=20))
    first = run_core_to_completion(core)["a"]
    # a second request whose prompt is a's prompt and output hits every full block
    core.add_request(make_request("b", [*prompt, *first, 40], max_tokens=3))
    outputs = {out.request_id: out.new_token_ids for out in core.step()}
    assert core.scheduler.requests["b"].num_cached_tokens == (len(prompt) + len(first)) // 4 * 4
    outputs["b"] += run_core_to_completion(core)["b"]
    assert outputs["b"] == reference_output([*prompt, *first, 40], 3)
    assert_pool_idle(core)


def test_logprobs_requests_do_not_speculate() -> None:
    core, executor = make_spec_core(False, k=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    core.add_request(Request("a", [3, 4, 5], params, eos_token_ids=(EOS,)))
    run_core_to_completion(core)
    assert executor.num_spec_scheduled == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_preemption_with_speculation_gives_identical_outputs(async_scheduling: bool,
                                                             method: str) -> None:
    prompts = {f"r{i}": [3 + (i * 5 + j) % 41 for j in range(9 + i)] for i in range(5)}
    roomy, _ = make_spec_core(async_scheduling, num_blocks=200, method=method)
    tight, _ = make_spec_core(async_scheduling, num_blocks=14, method=method)
    for core in (roomy, tight):
        for request_id, prompt in prompts.items():
            core.add_request(make_request(request_id, prompt, max_tokens=20))
    outputs = run_core_to_completion(roomy)
    assert outputs == run_core_to_completion(tight)
    assert outputs == {r: reference_output(p, 20) for r, p in prompts.items()}
    assert tight.scheduler.num_preemptions > 0
    assert_pool_idle(tight)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_randomised_spec_runs_keep_invariants(seed: int, async_scheduling: bool) -> None:
    rng = random.Random(seed)
    core, _ = make_spec_core(
        async_scheduling,
        num_blocks=rng.choice([12, 20, 40]),
        block_size=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([4, 16, 64]),
        max_num_seqs=rng.choice([1, 3, 8]),
        max_model_len=64,
        policy=rng.choice(["fcfs", "priority"]),
        k=rng.choice([1, 2, 5]),
        method=rng.choice(["ngram", "draft_model"]),
        hit_rate=rng.choice([0.3, 0.8]),
    )
    prefixes = [[3 + rng.randrange(40) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for step_index in range(250):
        action = rng.random()
        if action < 0.15:
            prompt = rng.choice(prefixes) + [3 + rng.randrange(40)
                                             for _ in range(rng.randrange(1, 8))]
            max_tokens = rng.randrange(1, 16)
            request = make_request(f"q{step_index}", prompt, max_tokens,
                                   priority=rng.randrange(3))
            if rng.random() < 0.2:  # a stop token that may land mid-proposal
                reference = reference_output(prompt, max_tokens)
                request.stop_token_set = frozenset({reference[rng.randrange(max_tokens)]})
                cut = next(i for i, t in enumerate(reference) if t in request.stop_token_set)
                expected_tokens = reference[:cut + 1]
            else:
                expected_tokens = reference_output(prompt, max_tokens)
            try:
                core.add_request(request)
            except ValueError:
                continue
            expected[request.request_id] = expected_tokens
        elif action < 0.2 and core.scheduler.requests:
            victim = rng.choice(sorted(core.scheduler.requests))
            core.abort_requests([victim])
            aborted.add(victim)
        for core_out in core.step():
            got.setdefault(core_out.request_id, []).extend(core_out.new_token_ids)
    finish_and_check(core, got, expected, aborted)
    assert_pool_idle(core)
