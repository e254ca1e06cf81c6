"""The engine core in its own process on a CUDA device (skipped without one):
with CUDA graphs and async scheduling, greedy outputs, logprobs, prompt
logprobs and JSON-schema outputs equal those of the same core in-process
(float32), and SIGKILL of the core fails the requests in flight."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.core.structured_output import StructuredOutputParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import EngineDeadError, ThreadedEngineClient
from kvserve.engine.core_proc import MPCoreClient
from kvserve.engine.llm_engine import LLMEngine, load_engine_tokenizer
from kvserve.engine.outputs import RequestOutput
from kvserve.envs import FaultInjection
from kvserve.server.faults import inject_faults

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3,
                   prompt_logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=32,
                   structured_output=StructuredOutputParams(json=SCHEMA)),
]


def _summary(output: RequestOutput) -> list[object]:
    return [[sorted(e) if e else None for e in output.prompt_logprobs or []],
            *[(c.text, c.token_ids, [sorted(e) for e in c.logprobs or []])
              for c in output.outputs]]


def test_core_process_equals_in_process(tiny_checkpoint: Callable[..., Path]) -> None:
    args = EngineArgs(model=str(tiny_checkpoint("llama", with_tokenizer=True)),
                      dtype="float32", device="cuda", max_num_seqs=16,
                      gpu_memory_utilization=0.3)
    prompts = ["the quick", "hello world", "a paged kv cache", "brown fox"] * 2
    local = LLMEngine.from_engine_args(args)
    ids = [local.add_request(p, params) for p in prompts for params in PARAMS]
    want: dict[str, RequestOutput] = {}
    while local.has_unfinished_requests():
        want.update((o.request_id, o) for o in local.step() if o.finished)
    local.core.shutdown()
    del local
    gc.collect()
    torch.cuda.empty_cache()
    config = args.create_engine_config()
    got = asyncio.run(_run(config, None, lambda c: [
        _final(c, p, params) for p in prompts for params in PARAMS]))
    assert [_summary(o) for o in got] == [_summary(want[i]) for i in ids]
    # forwards slowed so the requests are still running when the core dies
    slow = functools.partial(inject_faults, faults=FaultInjection(step_delay_s=0.05))
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    results = asyncio.run(_run(config, slow, lambda c: [
        _final(c, "hello", long) for _ in range(4)], kill_after_s=1.0))
    assert all(isinstance(r, EngineDeadError) for r in results), results


async def _final(client: ThreadedEngineClient, prompt: str,
                 params: SamplingParams) -> RequestOutput:
    last = None
    async for output in client.generate(client.processor.process(prompt, params,
                                                                  uuid.uuid4().hex)):
        last = output
    assert last is not None
    return last


async def _run(config: Any, setup: Any, make: Callable[[ThreadedEngineClient], list[Any]],
               kill_after_s: float | None = None) -> list[Any]:
    """Run ``make(client)``'s requests on a fresh core process (SIGKILLed
    after ``kill_after_s`` if given); their outputs or errors."""
    core = MPCoreClient(config, setup)
    client = ThreadedEngineClient(LLMEngine(config, load_engine_tokenizer(config), core))
    try:
        tasks = [asyncio.create_task(coro) for coro in make(client)]
        if kill_after_s is not None:
            await asyncio.sleep(kill_after_s)
            assert core.process.pid is not None
            os.kill(core.process.pid, signal.SIGKILL)
        return await asyncio.gather(*tasks, return_exceptions=kill_after_s is not None)
    finally:
        client.shutdown()
