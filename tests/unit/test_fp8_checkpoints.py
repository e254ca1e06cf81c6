"""FP8 W8A8 checkpoints written by llm-compressor (``tests/fixtures/quant/
llmc-fp8-*``, ``scripts/make_quant_fixtures.py llmcompressor-fp8``): the
e4m3 weights and their per-channel (``FP8_DYNAMIC``) or per-tensor (``FP8``,
static input scales) scales load exactly as the producer dequantises them;
the engine serves them as the fake-quant HF model (its logprobs exactly with
kvserve's per-token activation quantisation switched off, since the
fake-quant model keeps 16-bit activations; near it with it on); the same tensors under
HF's ``quant_method: fp8`` load alike; bad configs and tensors are refused
naming the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.models.loader import iter_safetensors
from kvserve.quant import fp8
from kvserve.quant.formats.parse import parse_quantization_config
from kvserve.quant.formats.stream import quantized_stream

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quant"
NAMES = ["llmc-fp8-dynamic", "llmc-fp8-static"]
# first-token logprobs against the fake-quant model (float32 on the CPU), with
# kvserve's activation quantisation switched off (the fake-quant model's
# activations stay 16-bit; with e4m3 activations this tiny random model's
# logprobs move by up to ~0.6, enough to swap near-tied first tokens)
LOGPROB_ATOL = 1e-4


def linear_names(path: Path) -> set[str]:
    return {k.rpartition(".")[0] for k in load_file(path / "model.safetensors")
            if ".layers." in k and k.endswith("_proj.weight")}


@pytest.mark.parametrize("name", NAMES)
def test_weights_load_as_the_producer_dequantises_them(name: str) -> None:
    path = FIXTURES / name
    config = parse_quantization_config(json.loads((path / "config.json").read_text()))
    assert config is not None and config.name == "fp8"
    assert config.checkpoint_format == "compressed-tensors"
    linears = linear_names(path)
    tensors = dict(quantized_stream(config, iter_safetensors([path / "model.safetensors"]),
                                    linears.__contains__, torch.bfloat16))
    expected = load_file(path / "reference.safetensors")
    reference = json.loads((path / "reference.json").read_text())
    for module in reference["reference_modules"]:
        qweight, scales = tensors[f"{module}.qweight"], tensors[f"{module}.scales"]
        assert qweight.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert scales.shape == (qweight.shape[0], 1)
        dequantized = qweight.float() * scales
        assert torch.equal(dequantized[:16], expected[f"dequantized.{module}"])
    assert not any(k.endswith("input_scale") for k in tensors)


def first_logprobs(path: Path) -> list[dict[int, float]]:
    reference = json.loads((path / "reference.json").read_text())
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    outputs = llm.generate(reference["prompts"], params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in (o.outputs[0].logprobs or [{}])[0].items()}
            for o in outputs]


@pytest.mark.parametrize("name", NAMES)
def test_engine_serves_the_checkpoint_like_the_fake_quant_model(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = FIXTURES / name
    expected = load_file(path / "reference.safetensors")
    oracles = [torch.log_softmax(expected[f"logits.{i}"][-1].double(), dim=-1)
               for i in range(len(json.loads((path / "reference.json").read_text())["prompts"]))]
    for logprobs, oracle in zip(first_logprobs(path), oracles, strict=True):
        # e4m3 activations: the engine's first token is the oracle's or a near-tie of it
        assert float(oracle[max(logprobs, key=logprobs.__getitem__)]) > float(oracle.max()) - 0.5
    monkeypatch.setattr(fp8, "quantize_per_token", lambda x: (x.float(), torch.ones(len(x), 1)))
    for logprobs, oracle in zip(first_logprobs(path), oracles, strict=True):
        for token, logprob in logprobs.items():
            assert logprob == pytest.approx(float(oracle[token]), abs=LOGPROB_ATOL)


def test_hf_fp8_config_loads_the_same_tensors(tmp_path: Path) -> None:
    source = FIXTURES / "llmc-fp8-dynamic"
    target = tmp_path / "hf-fp8"
    shutil.copytree(source, target)
    hf_config = json.loads((source / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "modules_to_not_convert": None}
    (target / "config.json").write_text(json.dumps(hf_config))
    assert first_logprobs(target) == first_logprobs(source)
    assert LLM(model=str(target), quantization="fp8", num_kv_blocks=16).engine.config \
        .model_config.quantization.checkpoint_format == "fp8"  # type: ignore[union-attr]


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     r"quantization_config\.weight_block_size=\[128, 128\] is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "per-head"},
     r"quantization_config\.activation_scheme='per-head' is not supported"),
])
def test_bad_hf_fp8_configs_name_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config({"quantization_config": change})


def test_bad_tensors_name_the_tensor(tmp_path: Path) -> None:
    source = FIXTURES / "llmc-fp8-dynamic"
    tensors = load_file(source / "model.safetensors")
    module = "model.layers.1.mlp.down_proj"
    for name, edit, message in [
        ("16-bit", {f"{module}.weight": tensors[f"{module}.weight"].bfloat16()},
         rf"checkpoint tensor '{module}\.weight' is torch\.bfloat16"),
        ("scale-shape", {f"{module}.weight_scale": torch.ones(3)},
         rf"'{module}\.weight_scale': shape \(3,\)"),
        ("scale-nan", {f"{module}.weight_scale": torch.full_like(
            tensors[f"{module}.weight_scale"], float("nan"))},
         rf"'{module}\.weight_scale': scales must be finite"),
    ]:
        target = tmp_path / name
        shutil.copytree(source, target)
        save_file({**tensors, **edit}, str(target / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(model=str(target), num_kv_blocks=16)
