"""``kvserve quantize`` end to end on a tiny random checkpoint, each method.

The written directory is read back from its safetensors (``read_back`` of
``test_quant_calibrate``), its dequantised linears and its other tensors
(AWQ's folded norms included) loaded into Hugging Face's model, whose logits
must stay close to the 16-bit model's; bad input exits 2 naming the problem
and leaves nothing on disk, and so does a failure while writing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvserve.cli import main
from tests.unit.test_quant_calibrate import read_back

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TEXT = ("def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n"
        "        self.items.append(x)\n")


@pytest.fixture
def calib(tmp_path: Path) -> Path:
    path = tmp_path / "calib.jsonl"
    lines = [json.dumps({"text": TEXT * (i + 1)}) for i in range(6)]
    path.write_text("\n".join(lines) + "\n")
    return path


def dequantised_state(output: Path, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """The written checkpoint as a 16-bit HF state dict (linears dequantised)."""
    tensors = load_file(output / "model.safetensors")
    state = {}
    modules = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_packed")}
    for module in modules:
        parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items()
                 if k.rsplit(".", 1)[0] == module}
        from kvserve.quant.packing import dequantize

        state[f"{module}.weight"] = dequantize(read_back(parts, bits, group_size))
    state |= {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in modules}
    return state


def logits_error(source: Path, state: dict[str, torch.Tensor]) -> float:
    """Relative error of the logits on text like the calibration text."""
    import transformers

    tokens = transformers.AutoTokenizer.from_pretrained(source)(TEXT * 3)["input_ids"][:48]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([tokens])).logits
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in name for name in missing)
        quantised = model(torch.tensor([tokens])).logits
    return float((quantised - reference).norm() / reference.norm())


def check_written(output: Path, source: Path, bits: int, symmetric: bool) -> None:
    assert sorted(p.name for p in output.parent.iterdir()) == [output.name]  # no staging left
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in output.iterdir()}
    config = json.loads((output / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"]) == (bits, symmetric)
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    assert config["hidden_size"] == json.loads((source / "config.json").read_text())[
        "hidden_size"]
    tensors = load_file(output / "model.safetensors")
    for layer in range(2):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            assert f"{name}.weight" not in tensors and f"{name}.weight_packed" in tensors
            assert (f"{name}.weight_zero_point" in tensors) == (not symmetric)
    assert "lm_head.weight" in tensors  # untied in this checkpoint, and left 16-bit


@pytest.mark.parametrize(("flags", "bits", "group_size", "symmetric"), [
    (["--method", "gptq", "--group-size", "32"], 4, 32, True),
    (["--method", "gptq", "--group-size", "32", "--act-order"], 4, 32, True),
    (["--method", "awq", "--group-size", "64"], 4, 64, False),
])
def test_calibrated_checkpoint_beats_round_to_nearest(
    flags: list[str], bits: int, group_size: int, symmetric: bool,
    tiny_checkpoint: Callable[..., Path], calib: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tiny_checkpoint("llama", with_tokenizer=True)
    output = tmp_path / "out" / "calibrated"
    assert main(["quantize", str(source), *flags, "--output", str(output), "--calib", str(calib),
                 "--num-samples", "4", "--seq-len", "32", "--batch-size", "3"]) == 0
    assert f"wrote {output}" in capsys.readouterr().err
    check_written(output, source, bits, symmetric)
    rtn = tmp_path / "rtn" / "out"
    symmetry = "--sym" if symmetric else "--asym"
    assert main(["quantize", str(source), "--method", "rtn", "--group-size", str(group_size),
                 symmetry, "--output", str(rtn)]) == 0
    calibrated_error = logits_error(source, dequantised_state(output, bits, group_size))
    rtn_error = logits_error(source, dequantised_state(rtn, bits, group_size))
    assert calibrated_error < 0.9 * rtn_error < 0.5


def test_int8_per_channel_checkpoint(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path,
) -> None:
    source = tiny_checkpoint("llama", with_tokenizer=True)
    output = tmp_path / "out" / "int8"
    assert main(["quantize", str(source), "--method", "rtn", "--bits", "8", "--group-size",
                 "-1", "--output", str(output)]) == 0
    check_written(output, source, 8, True)
    assert logits_error(source, dequantised_state(output, 8, -1)) < 0.03


def test_bad_input_exits_2_and_writes_nothing(
    tiny_checkpoint: Callable[..., Path], calib: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tiny_checkpoint("llama", with_tokenizer=True)
    output = tmp_path / "out"
    cases = [
        (["--method", "gptq", "--group-size", "32", "--calib", str(calib), "--num-samples",
          "64", "--seq-len", "64"], "calibration tokens, fewer than --num-samples 64"),
        (["--method", "rtn", "--group-size", "128"], "--group-size 128 does not divide"),
        (["--method", "awq", "--group-size", "32"], "--method awq needs calibration text"),
        (["--method", "rtn", "--act-order", "--group-size", "32"], "--act-order applies"),
    ]
    for flags, message in cases:
        assert main(["quantize", str(source), *flags, "--output", str(output)]) == 2
        assert message in capsys.readouterr().err
    (output / "keep").mkdir(parents=True)
    assert main(["quantize", str(source), "--method", "rtn", "--group-size", "32",
                 "--output", str(output)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "out"]
    assert [p.name for p in output.iterdir()] == ["keep"]


def test_a_failed_write_leaves_nothing(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvserve.quantize import writer

    def failing_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(writer, "save_file", failing_save)
    source = tiny_checkpoint("llama", with_tokenizer=True)
    (tmp_path / "empty").mkdir()  # an existing empty output stays as it was
    status = main(["quantize", str(source), "--method", "rtn", "--group-size", "32",
                   "--output", str(tmp_path / "empty")])
    assert status == 1 and "disk full" in capsys.readouterr().err  # one line, no traceback
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]
    assert not any((tmp_path / "empty").iterdir())
