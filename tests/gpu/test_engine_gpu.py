"""The engine on a CUDA device (skipped without one): tiny checkpoints give
HF transformers' logits and greedy tokens, and ``kvserve plan --measure``
reports predicted beside measured figures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.plan_cli import main as plan_main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 17, 99, 3, 250, 7, 42], list(range(20, 57)), [11, 12]]


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3", "llama31"])
def test_greedy_matches_transformers_on_cuda(
    variant: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    import transformers

    path = tiny_checkpoint(variant)
    llm = LLM(model=str(path), dtype="float32", device="cuda", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32,
                                do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), device="cuda",
                                                          dtype=torch.long))
        assert output.outputs[0].token_ids == hf[0, len(prompt):].tolist(), variant


def test_plan_measure_times_the_whole_batch(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: at batch 128 the old --measure timed a smaller batch (MBU 133%)."""
    rc = plan_main(["--model", "qwen2.5-0.5b", "--gpu", "h100-sxm", "--batch", "128",
                    "--context", "1024", "--prompt", "512", "--measure", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    decode, prefill = result["measured"]
    assert decode["kind"] == "decode" and prefill["kind"] == "prefill"
    timed = decode["measured"]
    assert timed["batch_timed_min"] == timed["batch_timed_max"] == 128
    assert abs(timed["mean_context_timed"] - 1024) <= 1
    assert 0 < decode["mbu"] <= 1.0, decode["mbu"]
    assert prefill["measured"]["prompt"] == 512 and prefill["measured_ms"] > 0
    assert result["run"]["card"]
