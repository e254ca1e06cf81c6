"""Structured output on a CUDA device (skipped without one): with CUDA graphs
and async scheduling, JSON-schema outputs validate and greedy ones equal
the eager, synchronous reference (float32); constrained and unconstrained
requests share batches."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.structured_output import StructuredOutputParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["a", "n"], "additionalProperties": False}


def test_graphs_and_async_match_the_reference(tiny_checkpoint: Callable[..., Path]) -> None:
    path = str(tiny_checkpoint("llama", with_tokenizer=True))
    common = dict(model=path, dtype="float32", device="cuda", max_num_seqs=16,
                  gpu_memory_utilization=0.3)
    prompts = ["the quick", "hello world", "a paged kv cache", "brown fox"] * 4
    greedy = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_output=StructuredOutputParams(json=SCHEMA))
    plain = SamplingParams(temperature=0.0, max_tokens=40)
    reference = LLM(**common, enforce_eager=True, async_scheduling=False)
    fast = LLM(**common)
    want = [o.outputs[0].text for o in reference.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].text for o in fast.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    mixed = fast.generate(prompts, [greedy, plain] * 8, use_tqdm=False)
    alone = fast.generate(prompts, plain, use_tqdm=False)
    for i in range(1, len(prompts), 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    seeded = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=40,
                            structured_output=StructuredOutputParams(json=SCHEMA))
    for output in fast.generate(prompts[:4], seeded, use_tqdm=False):
        for completion in output.outputs:
            jsonschema.validate(json.loads(completion.text), SCHEMA)
