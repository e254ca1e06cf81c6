"""Prompt logprobs on a CUDA device (skipped without one): with the Triton
kernels, token graphs, async scheduling and chunked prefill they equal the
torch reference backend's eager ones (float32), and a batch that mixes
prompt-logprob requests with plain decodes keeps its greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _values(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[float]]:
    values = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
        values.append([entry[token].logprob for token, entry in
                       zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])
                       if entry is not None])
    return values


def test_prompt_logprobs_fast_path_equals_reference(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = str(tiny_checkpoint("llama"))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 90))] for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=5, ignore_eos=True)
    common = dict(model=path, dtype="float32", device="cuda", max_num_seqs=8,
                  max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    reference = LLM(**common, attention_backend="torch", enforce_eager=True,
                    async_scheduling=False)
    fast = LLM(**common)
    expected = _values(reference, prompts, params)
    got = _values(fast, prompts, params)
    for want, have in zip(expected, got):
        assert have == pytest.approx(want, abs=2e-3)
    # prompt-logprob requests beside plain ones: the plain greedy tokens do not change
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in fast.generate(prompts, plain, use_tqdm=False)]
    engine = fast.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, plain if i % 2 else params, request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    for i in range(1, len(prompts), 2):
        assert finished[str(i)] == alone[i]
