"""``kvserve quantize --method smoothquant`` on a tiny random checkpoint.

The smoothing scales fold into the norms and the linears without changing
the float32 model; the written checkpoint is compressed-tensors
``int-quantized`` as llm-compressor writes W8A8 (the same config fields as
the committed llm-compressor fixture), kvserve serves it with int8
activations, and on a checkpoint with planted activation outliers (a few
norm channels scaled up and the following columns down: the same function)
SmoothQuant's W8A8 logits are much closer to the 16-bit model's than plain
W8A8's (int8 weights per channel, int8 activations per token, no smoothing).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.quant import int8
from kvserve.quantize import awq, smoothquant
from tests.unit.test_quantize_cli import LINEARS, TEXT, calib  # noqa: F401 (a fixture)

FIXTURE = Path(__file__).parent.parent / "fixtures" / "quant" / "llmc-w8a8-int8-smoothquant"
OUTLIER_CHANNELS = (3, 17, 40)
OUTLIER_FACTOR = 40.0


def test_scales_follow_the_formula_and_folding_keeps_the_function(
    tiny_checkpoint: Callable[..., Path]
) -> None:
    import transformers

    x_absmax = torch.tensor([4.0, 0.0, 1.0, 9.0])
    weights = [torch.tensor([[0.5, 1.0, -2.0, 0.25]]), torch.tensor([[-1.0, 0.5, 0.0, 0.5]])]
    scales = smoothquant.smoothing_scales(x_absmax, weights, 0.5)
    assert scales.tolist() == pytest.approx([2.0, 1.0, 1.0 / 2**0.5, 3.0 / 0.5**0.5])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("llama"), dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 99, 3, 250, 7, 42, 8]])
    with torch.no_grad():
        before = model(tokens).logits
        layer = model.model.layers[0]
        generator = torch.Generator().manual_seed(0)
        for mapping in smoothquant.MAPPINGS:
            size = layer.get_submodule(mapping.prev).weight.shape[0]
            awq.fold_scales(layer, mapping, torch.rand(size, generator=generator) + 0.5, None)
        after = model(tokens).logits
    assert [m.prev for m in smoothquant.MAPPINGS] == ["input_layernorm",
                                                      "post_attention_layernorm"]
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def with_outliers(source: Path, target: Path) -> Path:
    """``source`` with a few channels of every norm's output made large, the
    following linears' columns shrunk to match (the float function unchanged)."""
    shutil.copytree(source, target)
    tensors = {k: v.float() for k, v in load_file(source / "model.safetensors").items()}
    channels = list(OUTLIER_CHANNELS)
    for name in list(tensors):
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            tensors[name][channels] *= OUTLIER_FACTOR
            prefix = name.rsplit(".", 2)[0]
            group = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if \
                "input" in name else ("mlp.gate_proj", "mlp.up_proj")
            for linear in group:
                tensors[f"{prefix}.{linear}.weight"][:, channels] /= OUTLIER_FACTOR
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32",
                                                    "dtype": "float32"}))
    return target


def w8a8_logits_error(source: Path, state: dict[str, torch.Tensor]) -> float:
    """Relative logits error of HF's model with ``state``'s linears, their inputs
    rounded per token to int8 (what the engine computes), against ``source``'s."""
    import transformers

    tokens = transformers.AutoTokenizer.from_pretrained(source)(TEXT * 3)["input_ids"][:48]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()

    def round_input(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor]:
        xq, scales = int8.quantize_per_token(args[0].reshape(-1, args[0].shape[-1]))
        return ((xq.float() * scales).reshape(args[0].shape),)

    with torch.no_grad():
        reference = model(torch.tensor([tokens])).logits
        model.load_state_dict(state, strict=False)
        for layer in model.model.layers:
            for name in LINEARS:
                layer.get_submodule(name).register_forward_pre_hook(round_input)
        quantised = model(torch.tensor([tokens])).logits
    return float((quantised - reference).norm() / reference.norm())


def dequantised(path: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(path / "model.safetensors")
    state = {k: v.float() for k, v in tensors.items() if not k.endswith("weight_scale")}
    for name, weight in tensors.items():
        if weight.dtype == torch.int8:
            state[name] = weight.float() * tensors[f"{name}_scale"].float()
    return state


def test_smoothquant_checkpoint_beats_plain_w8a8_and_serves(
    tiny_checkpoint: Callable[..., Path], calib: Path, tmp_path: Path,  # noqa: F811
) -> None:
    source = with_outliers(tiny_checkpoint("llama", with_tokenizer=True), tmp_path / "outliers")
    output = tmp_path / "out" / "sq"
    assert main(["quantize", str(source), "--method", "smoothquant", "--alpha", "0.5",
                 "--output", str(output), "--calib", str(calib), "--num-samples", "4",
                 "--seq-len", "32", "--batch-size", "3"]) == 0
    qc = json.loads((output / "config.json").read_text())["quantization_config"]
    llmc = json.loads((FIXTURE / "config.json").read_text())["quantization_config"]
    assert qc.keys() == llmc.keys() and qc["format"] == "int-quantized"
    group, llmc_group = qc["config_groups"]["group_0"], llmc["config_groups"]["group_0"]
    for part in ("input_activations", "weights"):
        assert group[part].keys() == llmc_group[part].keys()
        for field in ("type", "num_bits", "strategy", "symmetric", "dynamic"):
            assert group[part][field] == llmc_group[part][field], (part, field)
    tensors = load_file(output / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q_proj}.weight"].dtype == torch.int8
    assert tensors[f"{q_proj}.weight_scale"].dtype == torch.float32
    assert tensors[f"{q_proj}.weight_scale"].shape == (tensors[f"{q_proj}.weight"].shape[0], 1)
    assert tensors["lm_head.weight"].is_floating_point()

    plain = {}
    for name, weight in load_file(source / "model.safetensors").items():
        if name.rsplit(".", 2)[-2] in {n.split(".")[-1] for n in LINEARS}:
            q, scales = int8.quantize_weight(weight)
            plain[name] = q.float() * scales
    smooth_error = w8a8_logits_error(source, dequantised(output))
    plain_error = w8a8_logits_error(source, plain)
    assert smooth_error < 0.5 * plain_error

    llm = LLM(model=str(output), dtype="float32", num_kv_blocks=64)
    assert llm.engine.config.model_config.quantization.name == "w8a8-int8"  # type: ignore[union-attr]
    out = llm.generate([[5, 17, 99, 3]], SamplingParams(temperature=0.0, max_tokens=4,
                                                         ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_smoothquant_options_exit_2(
    tiny_checkpoint: Callable[..., Path], calib: Path, tmp_path: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tiny_checkpoint("llama", with_tokenizer=True)
    for flags, message in [
        (["--method", "smoothquant", "--calib", str(calib), "--alpha", "1.5"],
         "--alpha 1.5 must lie in [0, 1]"),
        (["--method", "smoothquant", "--calib", str(calib), "--bits", "4"],
         "--method smoothquant writes INT8 W8A8"),
        (["--method", "smoothquant"], "--method smoothquant needs calibration text"),
        (["--method", "rtn", "--alpha", "0.8"], "--alpha applies to --method smoothquant"),
    ]:
        assert main(["quantize", str(source), *flags, "--output", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "o").exists()
