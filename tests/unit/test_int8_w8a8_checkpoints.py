"""An INT8 W8A8 checkpoint written by llm-compressor (``tests/fixtures/quant/
llmc-w8a8-int8-smoothquant``, ``scripts/make_quant_fixtures.py
llmcompressor-w8a8``: SmoothQuant 0.5 then GPTQ, scheme ``W8A8``, format
``int-quantized``): its int8 weights and per-channel scales load exactly as
the producer dequantises them, and the engine serves it like the fake-quant
HF model whose linears take their inputs rounded per token to int8 (greedy
tokens equal wherever the first token is no near-tie, first-token logprobs
within tolerance); bad tensors are refused naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.models.loader import iter_safetensors
from kvserve.quant.formats.parse import parse_quantization_config
from kvserve.quant.formats.stream import quantized_stream

FIXTURE = Path(__file__).parent.parent / "fixtures" / "quant" / "llmc-w8a8-int8-smoothquant"
# first-token logprobs against the fake-quant model (float32 on the CPU): the
# engine runs float32 too, so they agree to ~1e-5 unless an activation lies on
# a rounding tie (x / scale within 4e-6 of k + 0.5 in layer 0 of the third
# prompt): float32 noise in the norm then flips it, which moves that prompt's
# logprobs by ~0.02 and swaps its top two first tokens (0.012 apart)
LOGPROB_ATOL = 0.05


def reference() -> dict[str, object]:
    return json.loads((FIXTURE / "reference.json").read_text())


def test_weights_load_as_the_producer_dequantises_them() -> None:
    config = parse_quantization_config(json.loads((FIXTURE / "config.json").read_text()))
    assert config is not None and config.name == "w8a8-int8"
    linears = {k.rpartition(".")[0] for k in load_file(FIXTURE / "model.safetensors")
               if ".layers." in k and k.endswith("_proj.weight")}
    tensors = dict(quantized_stream(config, iter_safetensors([FIXTURE / "model.safetensors"]),
                                    linears.__contains__, torch.float32))
    expected = load_file(FIXTURE / "reference.safetensors")
    for module in reference()["reference_modules"]:  # type: ignore[attr-defined]
        qweight, scales = tensors[f"{module}.qweight"], tensors[f"{module}.scales"]
        assert qweight.dtype == torch.int8 and scales.dtype == torch.float32
        assert scales.shape == (qweight.shape[0], 1)
        assert torch.equal((qweight.float() * scales)[:16], expected[f"dequantized.{module}"])


def test_engine_serves_the_checkpoint_like_the_fake_quant_model() -> None:
    ref = reference()
    prompts: list[list[int]] = ref["prompts"]  # type: ignore[assignment]
    llm = LLM(model=str(FIXTURE), dtype="float32", block_size=4, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=len(ref["greedy"][0]),  # type: ignore[index]
                            ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    logits = load_file(FIXTURE / "reference.safetensors")
    num_clear = 0
    for i, output in enumerate(outputs):
        oracle = torch.log_softmax(logits[f"logits.{i}"][-1].double(), dim=-1)
        first = (output.outputs[0].logprobs or [{}])[0]
        for token, logprob in first.items():
            assert logprob.logprob == pytest.approx(float(oracle[token]), abs=LOGPROB_ATOL)
        best, second = oracle.topk(2).values.tolist()
        if best - second > LOGPROB_ATOL:
            assert output.outputs[0].token_ids == ref["greedy"][i]  # type: ignore[index]
            num_clear += 1
    assert num_clear == 2


def test_bad_tensors_name_the_tensor(tmp_path: Path) -> None:
    tensors = load_file(FIXTURE / "model.safetensors")
    module = "model.layers.1.mlp.down_proj"
    for name, edit, message in [
        ("16-bit", {f"{module}.weight": tensors[f"{module}.weight"].bfloat16()},
         rf"checkpoint tensor '{module}\.weight' is torch\.bfloat16.*expected int8"),
        ("scale-nan", {f"{module}.weight_scale": torch.full_like(
            tensors[f"{module}.weight_scale"], float("nan"))},
         rf"'{module}\.weight_scale': scales must be finite"),
    ]:
        target = tmp_path / name
        shutil.copytree(FIXTURE, target)
        save_file({**tensors, **edit}, str(target / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(model=str(target), num_kv_blocks=16)
    missing = tmp_path / "missing"
    shutil.copytree(FIXTURE, missing)
    save_file({k: v for k, v in tensors.items() if k != f"{module}.weight_scale"},
              str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"lacks parts of 1 w8a8-int8 linear.*{module} "
                                         r"\(missing weight_scale\)"):
        LLM(model=str(missing), num_kv_blocks=16)
