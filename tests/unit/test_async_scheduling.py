"""Async scheduling on CPU with tiny random checkpoints: every output (token
ids, text, logprobs, finish reasons) is identical with it on and off, across
early stops, stop strings, seeded sampling, penalties, ``min_tokens``,
``n > 1``, preemption, chunked prefill, prefix caching, LoRA and aborts; and
the async runs really carry tokens of the step in flight on the device
rather than waiting for them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvserve import LLM, SamplingParams
from kvserve.engine.outputs import RequestOutput
from kvserve.lora import LoRARequest
from kvserve.worker.input_batch import HostStep
from tests.conftest import make_lora_adapter, make_tiny_checkpoint

PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    [300, 12, 8, 8, 8, 19, 77, 1, 64, 120, 33, 9, 18, 200, 11, 4, 90, 91, 92, 93, 5],
    [11, 12],
    list(range(20, 57)),
]


def make_llm(path: Path, async_scheduling: bool, **kwargs: Any) -> LLM:
    """An engine whose runner counts the tokens it carried on the device."""
    llm = LLM(model=str(path), block_size=4, async_scheduling=async_scheduling, **kwargs)
    runner: Any = llm.engine.core.executor
    runner.num_carried = 0
    fill = runner.buffers.fill

    def counting_fill(*args: Any, **fill_kwargs: Any) -> HostStep:
        host: HostStep = fill(*args, **fill_kwargs)
        runner.num_carried += host.num_carried
        return host

    runner.buffers.fill = counting_fill
    return llm


def summary(outputs: list[RequestOutput]) -> list[list[tuple[Any, ...]]]:
    """What a user sees of each completion."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(e.items()) for e in c.logprobs])
             for c in o.outputs] for o in outputs]


def both_ways(
    path: Path, prompts: list[Any], params: SamplingParams | list[SamplingParams],
    **kwargs: Any,
) -> tuple[list[list[tuple[Any, ...]]], LLM]:
    """Outputs with async scheduling off and on (asserted equal), and the async engine."""
    sync = make_llm(path, False, **kwargs)
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    assert sync.engine.core.executor.num_carried == 0  # type: ignore[attr-defined]
    overlapped = make_llm(path, True, **kwargs)
    assert summary(overlapped.generate(prompts, params, use_tqdm=False)) == expected
    stats = overlapped.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return expected, overlapped


def num_carried(llm: LLM) -> int:
    return llm.engine.core.executor.num_carried  # type: ignore[attr-defined,no-any-return]


def test_greedy_and_early_stops(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama")
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = [o.outputs[0].token_ids
                 for o in LLM(model=str(path)).generate(PROMPTS, free, use_tqdm=False)]
    # each request stops on a token it produces at a different step
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[i]])
              for i, tokens in zip((0, 3, 9, 23), reference, strict=True)]
    params[2] = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outputs, llm = both_ways(path, PROMPTS, params)
    assert [len(o[0][0]) for o in outputs] == [
        reference[0].index(reference[0][0]) + 1, reference[1].index(reference[1][3]) + 1, 1,
        reference[3].index(reference[3][23]) + 1]
    assert num_carried(llm) > 0


def test_seeded_sampling_min_tokens_logprobs_and_n(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama")
    params = [
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3, max_tokens=20,
                       ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=20,
                       stop_token_ids=list(range(0, 384, 2))),
    ]
    outputs, llm = both_ways(path, PROMPTS, params)
    assert len(outputs[3][0][0]) >= 6  # min_tokens held off the (many) stop tokens
    assert num_carried(llm) > 0  # once past min_tokens, the steps carry


def test_penalties_read_the_step_in_flight_first(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama")
    params = [
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, presence_penalty=1.5,
                       frequency_penalty=0.5, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    _, llm = both_ways(path, PROMPTS[:2], params)
    assert num_carried(llm) == 0  # penalties count the tokens themselves: no carrying


def test_preemption_chunked_prefill_and_prefix_cache(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = PROMPTS * 3  # repeats hit the prefix cache
    _, llm = both_ways(path, prompts, params, num_kv_blocks=20, max_num_batched_tokens=12)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert num_carried(llm) > 0


def test_stop_strings(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("llama", tmp_path / "tok", with_tokenizer=True)
    free = LLM(model=str(path)).generate(
        "hello world", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    stop = free[6:9]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    outputs, _ = both_ways(path, ["hello world", "a b c"], params)
    assert outputs[0][0][2] == "stop"


def test_lora_mixed_batch(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    base = tiny_checkpoint("llama")
    adapter = LoRARequest("a", 1, str(make_lora_adapter(base, tmp_path / "a", seed=1)))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected: list[Any] = []
    for async_scheduling in (False, True):
        llm = make_llm(base, async_scheduling, enable_lora=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False,
                               lora_request=[adapter, None, adapter, None])
        expected = expected or summary(outputs)
        assert summary(outputs) == expected
    assert num_carried(llm) > 0


def test_abort_with_a_step_in_flight(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [expected] = [o.outputs[0].token_ids
                  for o in LLM(model=str(path)).generate([PROMPTS[0]], params, use_tqdm=False)]
    llm = make_llm(path, True)
    engine = llm.engine
    engine.add_request(PROMPTS[3], params, request_id="to-abort")
    engine.add_request(PROMPTS[0], params, request_id="kept")
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("to-abort")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
    assert tokens == expected
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not engine.core.has_unfinished_requests()


def test_device_time_is_counted_per_step(tiny_checkpoint: Callable[[str], Path]) -> None:
    llm = make_llm(tiny_checkpoint("llama"), True)
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_steps"] > 0
    assert 0.0 < stats["device_s"] <= stats["step_s"]
    assert np.isclose(stats["host_s"], stats["step_s"] - stats["device_s"])
