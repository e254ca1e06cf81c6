"""Disaggregated prefill / decode with two engines in one process (CPU,
gloo): greedy tokens equal one engine's, the decode engine really reads the
pulled KV, a decode-side prefix hit pulls fewer blocks, a failed or refused
pull falls back to recomputing, and no block stays pinned or held after a
pull or an expired offer. Also the transfer's byte moves and the role checks."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import KVTransferConfig
from kvserve.core.block_pool import KVBlock
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.distributed.kv_transfer import BlockBytes
from kvserve.engine.args import EngineArgs
from tests.unit.test_core_scheduler import make_scheduler

PROMPTS = [list(range(100 + 7 * i, 137 + 7 * i)) for i in range(3)]  # 37 tokens each
POOL = {"block_size": 4, "num_kv_blocks": 64}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def greedy(max_tokens: int = 8, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[[str], Path]) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(path: str) -> list[list[int]]:
    llm = LLM(model=path, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def pair(path: str, request: pytest.FixtureRequest) -> Iterator[tuple[LLM, LLM]]:
    """A prefill and a decode engine; async: both with async scheduling (CUDA's default)."""
    port = _free_pair()
    options = {**POOL, "async_scheduling": request.param}
    prefill = LLM(model=path, kv_role="prefill", kv_transfer_port=port,
                  kv_transfer_timeout=5.0, **options)
    decode = LLM(model=path, kv_role="decode", kv_transfer_timeout=5.0, **options)
    yield prefill, decode
    for llm in (prefill, decode):
        llm.engine.core.core.shutdown()  # type: ignore[attr-defined]


def _free_pair() -> int:
    """A port whose successor (the rendezvous store's) is free too."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


def prefill_then_decode(prefill: LLM, decode: LLM, prompt: list[int],
                        params: SamplingParams) -> tuple[list[int], dict[str, Any]]:
    first = prefill.generate([prompt], greedy(1, kv_transfer_params={"do_remote_decode": True}),
                             use_tqdm=False)[0]
    assert first.kv_transfer_params is not None
    answer = first.kv_transfer_params
    params.kv_transfer_params = answer
    out = decode.generate([prompt], params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, answer


def core(llm: LLM) -> Any:
    return llm.engine.core.core  # type: ignore[attr-defined]


def wait_unpinned(llm: LLM, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while core(llm).scheduler.kv_pinned and time.monotonic() < deadline:
        core(llm).housekeep()
        time.sleep(0.01)


def all_free(llm: LLM) -> bool:
    stats = llm.stats()
    return bool(stats["kv_blocks_free"] == stats["kv_blocks_total"])


def test_block_bytes_round_trip_any_dtype() -> None:
    keys = torch.randn(2, 6, 4, 2, 8).to(torch.bfloat16)
    codes = torch.randint(0, 255, (6, 5), dtype=torch.uint8)
    source = BlockBytes([(keys, 1), (codes, 0)])
    target_keys, target_codes = torch.zeros_like(keys), torch.zeros_like(codes)
    target = BlockBytes([(target_keys, 1), (target_codes, 0)])
    target.scatter([5, 0], source.gather([1, 3]))
    assert torch.equal(target_keys[:, 5], keys[:, 1]) and torch.equal(target_keys[:, 0], keys[:, 3])
    assert torch.equal(target_codes[5], codes[1]) and target_codes[2].sum() == 0


@pytest.mark.slow
def test_greedy_equal_to_one_engine_and_nothing_left_pinned(
        pair: tuple[LLM, LLM], reference: list[list[int]]) -> None:
    prefill, decode = pair
    for prompt, expected in zip(PROMPTS, reference):
        tokens, answer = prefill_then_decode(prefill, decode, prompt, greedy())
        assert tokens == expected
        assert len(answer["remote_block_ids"]) == -(-len(prompt) // POOL["block_size"])
    stats = decode.stats()
    assert stats["kv_transfer_pulled_requests"] == 3
    assert stats["kv_transfer_recomputed_requests"] == 0
    # 36 of 37 prompt tokens travel: 9 blocks of 4 each
    block_bytes = core(decode).kv_connector.receiver.blocks.block_bytes
    assert stats["kv_transfer_bytes_received"] == 3 * 9 * block_bytes
    wait_unpinned(prefill)
    assert all_free(prefill) and all_free(decode)


@pytest.mark.slow
def test_decode_reads_the_pulled_kv_and_a_local_prefix_hit_pulls_less(
        pair: tuple[LLM, LLM], reference: list[list[int]]) -> None:
    prefill, decode = pair
    sender = core(prefill).kv_connector.sender
    gather = sender.blocks.gather
    sender.blocks.gather = lambda ids: torch.zeros_like(gather(ids))  # sends zeros
    tokens, _ = prefill_then_decode(prefill, decode, PROMPTS[0], greedy())
    assert tokens != reference[0]
    sender.blocks.gather = gather
    wait_unpinned(prefill)
    # same prompt again: the decode engine's prefix cache has its 9 full blocks
    received = decode.stats()["kv_transfer_bytes_received"]
    prefill_then_decode(prefill, decode, PROMPTS[0], greedy())
    assert decode.stats()["kv_transfer_bytes_received"] == received
    # a prompt sharing 8 blocks with it pulls the rest only
    longer = [*PROMPTS[0][:32], 1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefill_then_decode(prefill, decode, longer, greedy())
    block_bytes = sender.blocks.block_bytes
    assert decode.stats()["kv_transfer_bytes_received"] == received + 2 * block_bytes


@pytest.mark.slow
def test_a_refused_pull_recomputes_and_an_unpulled_offer_expires(
        pair: tuple[LLM, LLM], reference: list[list[int]]) -> None:
    prefill, decode = pair
    first = prefill.generate([PROMPTS[1]], greedy(1, kv_transfer_params={"do_remote_decode": True}),
                             use_tqdm=False)[0]
    answer = dict(first.kv_transfer_params or {})
    assert core(prefill).scheduler.kv_pinned and not all_free(prefill)
    wait_unpinned(prefill)  # nobody pulls: freed after the 5 s timeout
    assert not core(prefill).scheduler.kv_pinned and all_free(prefill)
    out = decode.generate([PROMPTS[1]], greedy(kv_transfer_params=answer), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[1]
    assert decode.stats()["kv_transfer_recomputed_requests"] == 1
    assert all_free(decode)


def test_roles_and_params_are_checked(path: str) -> None:
    with pytest.raises(ValueError, match="kv_role='middle' is invalid"):
        KVTransferConfig(kv_role="middle")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineArgs(model=path, kv_role="decode", tensor_parallel_size=2).create_engine_config()
    config = EngineArgs(model=path, kv_transfer_config=(
        '{"kv_connector": "kvserve", "kv_role": "kv_producer", "kv_port": 15000}'
    )).create_engine_config()
    assert config.kv_transfer_config.kv_role == "prefill"
    assert config.kv_transfer_config.kv_transfer_port == 15000
    with pytest.raises(ValueError, match="n=2 is invalid"):
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
    llm = LLM(model=path, **POOL)
    with pytest.raises(ValueError, match="--kv-role prefill"):
        llm.generate([PROMPTS[0]], greedy(kv_transfer_params={"do_remote_decode": True}),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="--kv-role decode"):
        llm.generate([PROMPTS[0]], greedy(kv_transfer_params={"do_remote_prefill": True}),
                     use_tqdm=False)


def _request(request_id: str, params: dict[str, Any]) -> Request:
    sampling = SamplingParams(temperature=0.0, max_tokens=4, kv_transfer_params=params)
    return Request(request_id, list(range(1, 12)), sampling, ())


def test_scheduler_holds_receiving_and_pinned_blocks_until_released() -> None:
    scheduler = make_scheduler(num_blocks=16)
    pool = scheduler.kv_manager.pool
    free = pool.num_free_blocks
    # decode side: 10 of 11 tokens received into 3 blocks of 4, not scheduled meanwhile
    scheduler.add_request(_request("d", {"do_remote_prefill": True}))
    started = scheduler.start_kv_receive("d", 10)
    assert started is not None and len(started[0]) == 3 and started[1] == 0
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.finish_kv_receive("d", True)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"d": 1}  # only the last prompt token
    assert out.new_requests[0].block_ids == started[0]
    # aborted while receiving: its blocks stay held until the pull ends
    scheduler.add_request(_request("e", {"do_remote_prefill": True}))
    blocks = scheduler.start_kv_receive("e", 10)
    assert blocks is not None
    scheduler.finish_requests(["e"], RequestStatus.FINISHED_ABORTED)
    assert all(not pool.is_free(b) for b in pool_blocks(scheduler, blocks[0]))
    scheduler.finish_kv_receive("e", True)
    assert all(pool.is_free(b) for b in pool_blocks(scheduler, blocks[0]))
    scheduler.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert pool.num_free_blocks == free
    # prefill side: a finished request keeps its blocks until released; an aborted one not
    scheduler.add_request(_request("p", {"do_remote_decode": True}))
    scheduler.add_request(_request("q", {"do_remote_decode": True}))
    scheduler.schedule()
    scheduler.finish_requests(["p"], RequestStatus.FINISHED_STOPPED)
    scheduler.finish_requests(["q"], RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.kv_pinned) == ["p"] and pool.num_free_blocks == free - 3
    scheduler.release_kv("p")
    assert not scheduler.kv_pinned and pool.num_free_blocks == free


def pool_blocks(scheduler: Scheduler, block_ids: list[int]) -> list[KVBlock]:
    return [scheduler.kv_manager.pool.blocks[i] for i in block_ids]


@pytest.mark.slow
def test_a_pull_that_times_out_recomputes(path: str, reference: list[list[int]]) -> None:
    port = _free_pair()
    prefill = LLM(model=path, kv_role="prefill", kv_transfer_port=port, kv_transfer_timeout=2.0,
                  **POOL)
    decode = LLM(model=path, kv_role="decode", kv_transfer_timeout=1.0, **POOL)
    try:
        core(prefill).kv_connector.sender.send_delay_s = 3.0  # KVSERVE_FAULT_INJECT's hook
        tokens, _ = prefill_then_decode(prefill, decode, PROMPTS[2], greedy())
        assert tokens == reference[2]
        assert decode.stats()["kv_transfer_recomputed_requests"] == 1
        assert all_free(decode)
        wait_unpinned(prefill)
        assert all_free(prefill)
    finally:
        for llm in (prefill, decode):
            core(llm).shutdown()


def test_two_decode_engines_take_turns_on_one_sender() -> None:
    from kvserve.distributed.kv_transfer import KVReceiver, KVSender, PullJob

    source = torch.randn(2, 8, 4, 2, 8)
    port = _free_pair()
    sender = KVSender([(source, 1)], "127.0.0.1", port, 5.0)
    targets = [torch.zeros_like(source) for _ in range(2)]
    receivers = [KVReceiver([(t, 1)], 5.0) for t in targets]
    try:
        for turn, (request_id, block) in enumerate([("a", 1), ("b", 2), ("c", 3)]):
            receiver = receivers[turn % 2]  # alternate: each pull after the first reconnects
            sender.offer(request_id, [block])
            receiver.pull(PullJob(request_id, "127.0.0.1", port, request_id, [block], [5]))
            assert receiver.done.wait(30)
            assert receiver.take_finished() == [(request_id, True)]
            assert torch.equal(targets[turn % 2][:, 5], source[:, block])
        deadline = time.monotonic() + 5
        released: list[str] = []
        while len(released) < 3 and time.monotonic() < deadline:
            released += sender.take_released()
            time.sleep(0.01)
        assert sorted(released) == ["a", "b", "c"]
    finally:
        for receiver in receivers:
            receiver.close()
        sender.close()
