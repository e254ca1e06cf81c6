"""The engine with weight-only quantised linears, on CPU.

The oracle of a model quantised at load is the same engine on a 16-bit
checkpoint holding the dequantised weights ("fake quant", written here):
greedy tokens identical, logprobs equal to float32 rounding, with chunked
prefill, prefix caching, preemption, batching and LoRA. Also the bundled
model, the CLI flag and the checks on ``--quantization``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.quant.config import quantize_at_load
from kvserve.quant.packing import dequantize, quantize_rtn
from tests.conftest import make_lora_adapter
from tests.unit.test_engine import PROMPTS, token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quant_checkpoint(path: Path, quantization: str, out: Path,
                          quantize_lm_head: bool = False) -> Path:
    """A copy of the checkpoint at ``path`` whose linears hold what
    ``--quantization`` rounds them to, dequantised, in float32."""
    config = quantize_at_load(quantization, quantize_lm_head)
    tensors = load_file(path / "model.safetensors")
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith((*LINEARS, "lm_head")) \
                and config.quantizes(module):
            qw = quantize_rtn(tensor, config.bits, config.group_size, config.symmetric,
                              scale_dtype=torch.float32)
            tensors[name] = dequantize(qw)
    shutil.copytree(path, out)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize(("quantization", "lm_head"),
                         [("int8", True), ("int4-g32", False), ("int4-g64", True)])
def test_quantised_engine_equals_fake_quant_checkpoint(
    quantization: str, lm_head: bool, tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = tiny_checkpoint("llama")
    fake = fake_quant_checkpoint(path, quantization, tmp_path / "fake", lm_head)
    ours = LLM(model=str(path), quantization=quantization, quantize_lm_head=lm_head,
               block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    oracle = LLM(model=str(fake), block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    got = ours.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = oracle.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(got, expected, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            for token, lp in y.items():
                assert x[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
    # preemption (a pool too small for all four) and a warm prefix cache change nothing
    again = ours.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]
    assert ours.stats()["num_preemptions"] > 0
    assert ours.stats()["prefix_cache_hits"] > 0
    unquantised = LLM(model=str(path), block_size=4, num_kv_blocks=48)
    assert token_ids(unquantised, PROMPTS, GREEDY) != token_ids(ours, PROMPTS, GREEDY)


def test_lora_over_a_quantised_base(tiny_checkpoint: Callable[[str], Path],
                                    tmp_path: Path) -> None:
    path = tiny_checkpoint("llama")
    adapter = make_lora_adapter(path, tmp_path / "adapter", rank=4, seed=3)
    fake = fake_quant_checkpoint(path, "int8", tmp_path / "fake")
    lora = LoRARequest("a", 1, str(adapter))
    runs = []
    for model, quantization in ((path, "int8"), (fake, None)):
        llm = LLM(model=str(model), quantization=quantization, enable_lora=True, max_loras=2,
                  max_lora_rank=8, num_kv_blocks=64)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                               lora_request=[lora, None, lora, None])
        runs.append([o.outputs[0].token_ids for o in outputs])
    assert runs[0] == runs[1]


def test_bundled_model_quantised_at_load() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = {}
    for quantization in (None, "int8", "int4"):
        llm = LLM(quantization=quantization, num_kv_blocks=32)
        texts[quantization] = llm.generate(["def add(a, b):"], params,
                                           use_tqdm=False)[0].outputs[0].text
        assert len(llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    assert texts["int8"] == texts[None]  # int8 per channel barely moves a 14M model's argmax


def test_quantization_flags_are_checked(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="quantize_lm_head=True needs"):
        LLM(quantize_lm_head=True)
    with pytest.raises(ValueError, match="lm_head is tied"):
        LLM(quantization="int8", quantize_lm_head=True)  # the bundled model ties its head
    with pytest.raises(ValueError, match="quantization='int3' is not supported; allowed: gptq"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        LLM(model=str(tiny_checkpoint("llama")), quantization="int4")  # hidden size 64


def test_cli_generate_quantised(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "def add(a, b):",
         "--max-tokens", "4", "--quantization", "int4-g128", "--num-kv-blocks", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "def add(a, b):" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "x",
         "--quantization", "int2"], capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode != 0 and "invalid choice: 'int2'" in bad.stderr
