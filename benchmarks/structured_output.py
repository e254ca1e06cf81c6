"""Structured output's cost on the offline engine, one JSON object out:

- ``throughput``: ``batch`` requests of ``max_tokens`` output tokens each
  (``ignore_eos``), unconstrained, then each with a JSON schema whose
  output is longer than ``max_tokens`` (so both runs emit the same tokens);
  output tokens/s of each and their ratio (issue 23's target: >= 0.95);
- ``first_schema_ttft``: time to first token of one request with a schema
  never seen before (compiled as it is added, as the server compiles before
  queueing) minus that of the same request with no schema, median over
  ``trials`` (target: <= 50 ms).

Each throughput run is done once to warm up (CUDA graphs, Triton, the
grammar cache) and timed on the second. Run on the GPU, e.g.:

    PYTHONPATH=. python benchmarks/structured_output.py --model llama-3-8b \\
        --load-format dummy --dtype bfloat16 > structured_output.json

(a preset with dummy weights uses the byte tokenizer; a real model directory
uses its own tokenizer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kvserve import LLM, SamplingParams
from kvserve.core.structured_output import StructuredOutputParams

PROMPT = "Write a JSON object listing words:"


def long_schema(name: str) -> dict[str, Any]:
    """A schema whose shortest output is hundreds of tokens; ``name`` makes it new."""
    return {"type": "object", "properties": {name: {
        "type": "array", "minItems": 64, "maxItems": 64,
        "items": {"type": "string", "minLength": 4, "maxLength": 12}}},
        "required": [name], "additionalProperties": False}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def output_tokens_per_s(llm: LLM, batch: int, params: SamplingParams) -> float:
    prompts = [f"{PROMPT} {i}" for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed


def ttft_s(llm: LLM, params: SamplingParams, request_id: str) -> float:
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(PROMPT, params, request_id=request_id)
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter() - start
    assert first is not None
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
              max_num_seqs=max(args.batch, 8))
    base = dict(temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = output_tokens_per_s(llm, args.batch, SamplingParams(**base))
    constrained = output_tokens_per_s(llm, args.batch, SamplingParams(
        **base, structured_output=StructuredOutputParams(json=long_schema("words"))))
    short = dict(temperature=0.0, max_tokens=4)
    ttft_plain, ttft_new = [], []
    for trial in range(args.trials + 1):  # the first of each is a warm-up
        ttft_plain.append(ttft_s(llm, SamplingParams(**short), f"plain-{trial}"))
        schema = StructuredOutputParams(json=long_schema(f"key{trial}_{time.time_ns()}"))
        ttft_new.append(ttft_s(llm, SamplingParams(**short, structured_output=schema),
                               f"schema-{trial}"))
    added_ms = statistics.median(
        (new - old) * 1e3 for new, old in zip(ttft_new[1:], ttft_plain[1:]))
    print(json.dumps({
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model, "batch": args.batch, "max_tokens": args.max_tokens,
        "throughput": {"unconstrained_tok_s": round(plain, 1),
                       "json_schema_tok_s": round(constrained, 1),
                       "ratio": round(constrained / plain, 4), "target_ratio": 0.95},
        "first_schema_ttft": {"plain_ms": round(statistics.median(ttft_plain[1:]) * 1e3, 2),
                              "new_schema_ms": round(statistics.median(ttft_new[1:]) * 1e3, 2),
                              "added_ms": round(added_ms, 2), "target_added_ms": 50},
    }, indent=2))


if __name__ == "__main__":
    main()
