"""Prompt logprobs against their oracle: the log-softmax of one plain
full-sequence forward (HF transformers, float32) at every prompt position,
with chunked prefill of several sizes, a warm prefix cache (the prompt is
computed again, not read), preemption, and n > 1; plus the scheduler's
bookkeeping (chunks in order, duplicates after preemption dropped)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.outputs import Logprobs, PromptLogprobs
from kvserve.core.request import Request
from kvserve.engine.outputs import RequestOutput
from tests.unit.test_engine import PROMPTS, hf_model

NUM_TOP = 3


def oracle(path: Path, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt), vocab]`` log-softmax of a full forward over the prompt."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(path: Path, output: RequestOutput) -> None:
    prompt = output.prompt_token_ids
    expected = oracle(path, prompt)
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        entry = got[j]
        assert entry is not None
        row = expected[j - 1]
        token = prompt[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4), j
        assert entry[token].rank == int((row >= row[token]).sum())
        top_values, top_ids = row.topk(NUM_TOP)
        for rank, (token_id, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), 1):
            if token_id != token:
                assert entry[token_id].rank == rank
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
        assert len(entry) in (NUM_TOP, NUM_TOP + 1)


PARAMS = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=NUM_TOP, ignore_eos=True)


@pytest.mark.parametrize(("budget", "async_scheduling"), [(3, False), (8, True), (512, False)])
def test_prompt_logprobs_equal_a_full_forward(
    budget: int, async_scheduling: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint("llama")
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=budget,
              async_scheduling=async_scheduling)
    for output in llm.generate(PROMPTS, PARAMS, use_tqdm=False):
        check(path, output)


def test_warm_prefix_cache_preemption_and_n(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama")
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=8)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = llm.generate(PROMPTS, plain, use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in first)
    warm = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for output, cold in zip(warm, first):
        check(path, output)
        assert output.num_cached_tokens == 0  # computed again, not read
        assert output.outputs[0].token_ids == cold.outputs[0].token_ids
    # a plain request still hits the cache the prompt-logprob ones refilled
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate(PROMPTS, plain, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > hits

    tight = LLM(model=str(path), block_size=4, num_kv_blocks=20, max_num_batched_tokens=8)
    long_params = SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=NUM_TOP,
                                 ignore_eos=True)
    for output in tight.generate(PROMPTS * 2, long_params, use_tqdm=False):
        check(path, output)
    assert tight.stats()["num_preemptions"] > 0

    [output] = llm.generate([PROMPTS[1]], SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=NUM_TOP), use_tqdm=False)
    check(path, output)


def test_one_token_prompt_and_validation(tiny_checkpoint: Callable[[str], Path]) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")))
    [output] = llm.generate([[7]], PARAMS, use_tqdm=False)
    assert output.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 is invalid.*at most 20"):
        llm.generate([[7]], SamplingParams(max_tokens=1, prompt_logprobs=21), use_tqdm=False)


def _entries(first: int, count: int) -> PromptLogprobs:
    return PromptLogprobs(first, [Logprobs([first + k], [-1.0], 1) for k in range(count)])


def test_request_keeps_chunks_in_order_and_drops_repeats() -> None:
    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=0))
    assert request.awaits_prompt_logprobs
    request.add_prompt_logprobs(_entries(1, 4))
    request.add_prompt_logprobs(_entries(1, 6))  # the prompt again, after preemption
    request.add_prompt_logprobs(_entries(7, 3))
    assert request.prompt_logprobs is not None
    assert [e.token_ids[0] for e in request.prompt_logprobs] == list(range(1, 10))
    assert not request.awaits_prompt_logprobs
    with pytest.raises(RuntimeError, match="arrived"):
        Request("s", list(range(10)), SamplingParams(prompt_logprobs=0)).add_prompt_logprobs(
            _entries(3, 2))
