"""Producers' quantised checkpoints served by kvserve's model: logits equal
the fake-quant HF forward, greedy tokens identical.

Every committed fixture (``tests/fixtures/quant``, made by llm-compressor,
GPTQModel and AutoAWQ with ``scripts/make_quant_fixtures.py``) is read the
way the loader reads a checkpoint (its config resolved with
``resolve_quantization``, its tensors streamed through ``quantized_stream``
into the model's quantised layers) and run in float32 on the torch
reference path. The oracle stored with each fixture is a float32
transformers Llama holding the producer's own dequantised weights: our
logits must match it to ``RTOL`` (relative L2; the dequantised weights are
equal, so only float32 summation order differs: 0.7e-6 to 1.5e-6 measured)
and our greedy continuation must be its stored tokens exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvserve.config import ModelConfig
from kvserve.models.loader import iter_safetensors
from kvserve.models.registry import CausalLM, get_model_class
from kvserve.models.source import resolve_model_config
from kvserve.quant.formats import read_quantize_config, resolve_quantization
from kvserve.quant.formats.stream import quantized_stream
from kvserve.quant.methods import LinearMethod
from tests.unit.test_models import PagedRunner, rel_err

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quant"
# weight-only fixtures (W8A8 ones quantise activations too: test_fp8_checkpoints.py,
# test_int8_w8a8_checkpoints.py)
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir()
                       if (p / "reference.json").is_file()
                       and not p.name.startswith(("llmc-fp8", "llmc-w8a8")))
RTOL = 1e-5


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_quantised(path: Path) -> tuple[CausalLM, ModelConfig]:
    """The fixture's model, built and filled as the loader does for a quantised checkpoint."""
    config, model_path = resolve_model_config(str(path))
    assert model_path is not None
    quantization = resolve_quantization(config.hf_config, None, str(path / "config.json"),
                                        read_quantize_config(path))
    assert quantization is not None
    config = dataclasses.replace(config, quantization=quantization)
    with torch.device("cpu"), default_dtype(torch.float32):
        model = get_model_class(config.architecture)(config)
    weights = iter_safetensors([path / "model.safetensors"])
    model.load_weights(quantized_stream(quantization, weights,
                                        model.linear_module_names().__contains__, torch.float32))
    for module in model.modules():
        method: LinearMethod | None = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval(), config


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_quantised_checkpoint_matches_fake_quant_hf(name: str) -> None:
    path = FIXTURES / name
    reference = json.loads((path / "reference.json").read_text())
    expected = load_file(path / "reference.safetensors")
    model, config = load_quantised(path)
    quantised = [m for m in model.modules()
                 if getattr(getattr(m, "quant_method", None), "quantized", False)]
    assert len(quantised) == 2 * 4  # qkv, o, gate_up, down per layer; the head stays 16-bit
    for i, (prompt, greedy) in enumerate(zip(reference["prompts"], reference["greedy"],
                                             strict=True)):
        runner = PagedRunner(model, config)
        logits = runner.step({0: prompt})[0]
        assert rel_err(logits, expected[f"logits.{i}"]) < RTOL, f"prompt {i}"
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < len(greedy):
            tokens.append(int(runner.step({0: [tokens[-1]]})[0][-1].argmax()))
        assert tokens == greedy, f"prompt {i}"


def test_a_fixture_loads_differently_without_its_config(tmp_path: Path) -> None:
    """The logits check can fail: the same packed values read as another format do not match."""
    path = FIXTURES / "gptqmodel-w4-g32-asym-v2"
    for file in ("model.safetensors", "quantize_config.json"):
        (tmp_path / file).write_bytes((path / file).read_bytes())
    hf_config = json.loads((path / "config.json").read_text())
    hf_config["quantization_config"]["checkpoint_format"] = "gptq"  # zeros read as v1: off by 1
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    model, config = load_quantised(tmp_path)
    reference = json.loads((path / "reference.json").read_text())
    logits = PagedRunner(model, config).step({0: reference["prompts"][0]})[0]
    expected = load_file(path / "reference.safetensors")["logits.0"]
    assert rel_err(logits, expected) > 100 * RTOL
