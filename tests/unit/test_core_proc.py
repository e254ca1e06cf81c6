"""The engine core in its own process (``MPCoreClient``) against the same
core in-process: identical outputs (greedy and seeded sampling, n > 1,
logprobs, prompt logprobs, stop strings, structured output), a request the
core refuses fails alone (bad input: ValueError; an undecodable message:
RuntimeError), and a core killed with SIGKILL fails every request in flight
with ``EngineDeadError`` and leaves no socket behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.core.structured_output import StructuredOutputParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import EngineDeadError, ThreadedEngineClient
from kvserve.engine.core_proc import ADD, MPCoreClient
from kvserve.engine.input_processor import Prompt
from kvserve.engine.llm_engine import LLMEngine, load_engine_tokenizer
from kvserve.engine.outputs import RequestOutput

pytestmark = pytest.mark.slow

PROMPTS: list[Prompt] = ["hello world", [5, 6, 7, 8, 9, 10], "the cat sat"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                   prompt_logprobs=1),
    SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=["e"]),
    SamplingParams(temperature=0.0, max_tokens=8,
                   structured_output=StructuredOutputParams(regex="[a-c]+")),
]


def _args(model: Path) -> EngineArgs:
    return EngineArgs(model=str(model), block_size=4, num_kv_blocks=30, max_num_seqs=4)


def _proc_client(model: Path) -> ThreadedEngineClient:
    config = _args(model).create_engine_config()
    engine = LLMEngine(config, load_engine_tokenizer(config), MPCoreClient(config))
    return ThreadedEngineClient(engine)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", with_tokenizer=True)


@pytest.fixture(scope="module")
def client(model: Path) -> Iterator[ThreadedEngineClient]:
    client = _proc_client(model)
    yield client
    client.shutdown()


async def _final(client: ThreadedEngineClient, prompt: Prompt,
                 params: SamplingParams) -> RequestOutput:
    last = None
    async for output in client.generate(client.processor.process(prompt, params,
                                                                  uuid.uuid4().hex)):
        last = output
    assert last is not None and last.finished
    return last


def _summary(output: RequestOutput) -> list[object]:
    prompt_logprobs = [sorted(e) if e else None for e in output.prompt_logprobs or []]
    return [prompt_logprobs, *[(c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                [sorted(e) for e in c.logprobs or []])
                               for c in output.outputs]]


def test_outputs_equal_the_in_process_core(client: ThreadedEngineClient, model: Path) -> None:
    async def run_all() -> list[RequestOutput]:
        return await asyncio.gather(*[_final(client, prompt, params)
                                      for prompt in PROMPTS for params in PARAMS])

    remote = asyncio.run(run_all())
    local = LLMEngine.from_engine_args(_args(model))
    ids = [local.add_request(prompt, params) for prompt in PROMPTS for params in PARAMS]
    finished: dict[str, RequestOutput] = {}
    while local.has_unfinished_requests():
        finished.update((o.request_id, o) for o in local.step() if o.finished)
    for request_id, output in zip(ids, remote):
        assert _summary(output) == _summary(finished[request_id])
    constrained = remote[len(PARAMS) - 1].outputs[0].text
    assert re.fullmatch("[a-c]+", constrained), constrained
    assert client.stats()["num_steps"] > 0 and client.health().alive


def test_a_refused_request_fails_alone(client: ThreadedEngineClient) -> None:
    # 30 blocks of 4 tokens: the core refuses what the pool can never hold
    too_big = SamplingParams(max_tokens=120, ignore_eos=True)
    with pytest.raises(ValueError, match="KV blocks"):
        asyncio.run(_final(client, "hello", too_big))
    core = client.engine.core
    assert isinstance(core, MPCoreClient)
    core._send(ADD, "garbled", b"\xc1 not msgpack")  # a message it cannot decode
    client.engine.core.wake()
    ok = asyncio.run(_final(client, "hello", SamplingParams(max_tokens=3)))
    assert len(ok.outputs[0].token_ids) == 3 and client.health().alive


def _unix_sockets() -> str:
    return Path("/proc/net/unix").read_text()


def test_a_killed_core_fails_requests_in_flight(model: Path) -> None:
    client = _proc_client(model)
    core = client.engine.core
    assert isinstance(core, MPCoreClient)
    pid = core.process.pid
    assert pid is not None
    names = [address.removeprefix("ipc://") for address in core.addresses]
    assert all(name in _unix_sockets() for name in names)
    long = SamplingParams(max_tokens=50, ignore_eos=True)

    async def kill_midway() -> list[BaseException | RequestOutput]:
        started = asyncio.Event()

        async def stream() -> RequestOutput:
            last = None
            async for output in client.generate(client.processor.process(
                    "hello", long, uuid.uuid4().hex)):
                last = output
                started.set()
            assert last is not None
            return last

        tasks = [asyncio.create_task(stream()) for _ in range(2)]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)

    results = asyncio.run(kill_midway())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    health = client.health()
    assert not health.alive and "exited with code -9" in (health.error or "")
    client.shutdown()
    assert core.process.exitcode == -signal.SIGKILL
    assert not any(name in _unix_sockets() for name in names)
