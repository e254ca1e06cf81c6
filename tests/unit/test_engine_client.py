"""``ThreadedEngineClient``: streaming from the background engine thread,
validation before queuing, abort on early exit, and a dead engine reported
to every in-flight request — with async scheduling off and on."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import EngineDeadError, ThreadedEngineClient
from kvserve.engine.input_processor import EngineRequest, Prompt
from kvserve.engine.llm_engine import LLMEngine

PROMPT = [5, 17, 99, 3, 250, 7, 42]


def _request(client: ThreadedEngineClient, prompt: Prompt, params: SamplingParams
             ) -> EngineRequest:
    return client.processor.process(prompt, params, uuid.uuid4().hex)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def client(tiny_checkpoint: Callable[[str], Path],
           request: pytest.FixtureRequest) -> ThreadedEngineClient:
    """The background engine, stepping one step at a time or with one in flight."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_checkpoint("llama")),
                                                   block_size=4, async_scheduling=request.param))
    client = ThreadedEngineClient(engine)
    yield client
    client.shutdown()


def test_streams_the_same_tokens_as_the_offline_engine(
    client: ThreadedEngineClient, tiny_checkpoint: Callable[[str], Path]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def collect() -> tuple[list[int], int]:
        streamed: list[int] = []
        chunks = 0
        async for output in client.generate(_request(client, PROMPT, params)):
            streamed.extend(output.outputs[0].delta_token_ids)
            chunks += 1
        return streamed, chunks

    streamed, chunks = asyncio.run(collect())
    offline = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_checkpoint("llama"))))
    offline.add_request(PROMPT, params, request_id="x")
    final = None
    while offline.has_unfinished_requests():
        for output in offline.step():
            final = output
    assert final is not None and streamed == final.outputs[0].token_ids
    assert chunks == 12


def test_invalid_request_fails_before_queuing(client: ThreadedEngineClient) -> None:
    async def bad() -> None:
        async for _ in client.generate(_request(client, [], SamplingParams())):
            pass

    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(bad())
    assert client.stats()["num_requests_waiting"] == 0


def test_leaving_early_aborts_and_frees_blocks(client: ThreadedEngineClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def leave_after_two() -> None:
        seen = 0
        async for _ in client.generate(_request(client, PROMPT, params)):
            seen += 1
            if seen == 2:
                break

    asyncio.run(leave_after_two())

    async def wait_until_idle() -> dict[str, float]:
        for _ in range(200):
            stats = client.stats()
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError("the request was not aborted")

    stats = asyncio.run(wait_until_idle())
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert client.health().alive


def test_a_failing_step_reaches_every_request(client: ThreadedEngineClient) -> None:
    executor = client.engine.core.executor
    original = executor.execute_model
    calls = {"n": 0}

    def failing(scheduler_output):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return original(scheduler_output)

    executor.execute_model = failing  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def one() -> None:
        async for _ in client.generate(_request(client, PROMPT, params)):
            pass

    async def both() -> list[BaseException | None]:
        return await asyncio.gather(one(), one(), return_exceptions=True)

    results = asyncio.run(both())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    health = client.health()
    assert not health.alive and health.error is not None and "injected" in health.error
