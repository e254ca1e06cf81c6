"""``kvserve quantize``'s pieces (``quantize``): the compressed-tensors
writer's tensors read back into the same ``QuantizedWeight``, GPTQ against
round-to-nearest, AWQ's folding and search on a real decoder layer, the
calibration windows and the checks made before any work.

The read-back here is written from the format's description (compressed-
tensors' own decompression is checked by ``scripts/check_quantize_output.py``,
outside CI): unsigned values packed ``32 // bits`` per int32 word, first in
the lowest bits; zero points packed the same way along the output dimension.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvserve.quant.packing import QuantizedWeight, dequantize, pack_int4
from kvserve.quantize import awq
from kvserve.quantize.data import calibration_windows, read_calibration_texts
from kvserve.quantize.gptq import HessianAccumulator, gptq_quantize, inverse_cholesky
from kvserve.quantize.layer_runner import LayerRunner
from kvserve.quantize.options import (
    QuantizeOptions,
    check_against_model,
    check_output,
    read_model_config,
)
from kvserve.quantize.rtn import WeightScheme, rtn_quantize
from kvserve.quantize.writer import compressed_tensors, pack_int32, quantization_config

# ------------------------------------------------------------------ the writer's format


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 ``[R, W]`` -> uint8 ``[R, count]``."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    values = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & (2**bits - 1)
    return values.flatten(-2)[:, :count].to(torch.uint8)


def read_back(tensors: dict[str, torch.Tensor], bits: int, group_size: int) -> QuantizedWeight:
    """A compressed-tensors linear -> kvserve's layout (the inverse of the writer)."""
    n, k = tensors["weight_shape"].tolist()
    q = unpack_int32(tensors["weight_packed"], bits, k)
    zeros = None
    if "weight_zero_point" in tensors:
        packed = tensors["weight_zero_point"]
        zeros = unpack_int32(packed.T.contiguous(), bits, n).T.to(tensors["weight_scale"].dtype)
    return QuantizedWeight(pack_int4(q) if bits == 4 else q, tensors["weight_scale"], zeros,
                           bits, k if group_size == -1 else group_size)


def test_int4_words_hold_the_first_column_in_the_lowest_bits() -> None:
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 15]], dtype=torch.uint8)
    words = pack_int32(q, 4)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() == 0x87654321 - 2**32  # the top nibble 8 sets the sign bit
    assert words[0, 1].item() == 15  # padded with zeros
    assert pack_int32(torch.tensor([[1, 2, 3, 255]], dtype=torch.uint8), 8)[0, 0].item() == (
        0xFF030201 - 2**32)


@pytest.mark.parametrize(("bits", "group_size", "symmetric"), [
    (4, 32, True), (4, 64, False), (4, -1, False), (8, -1, True), (8, 32, False)])
def test_written_tensors_read_back_into_the_same_weight(
    bits: int, group_size: int, symmetric: bool
) -> None:
    # 20 rows: the zero points' packing along the output dimension is padded
    weight = torch.randn(20, 128, generator=torch.Generator().manual_seed(bits + group_size))
    qw = quantize_rtn_bf16(weight, bits, group_size, symmetric)
    tensors = compressed_tensors(qw)
    n, k = 20, 128
    per_word = 32 // bits
    assert tensors["weight_packed"].shape == (n, k // per_word)
    assert tensors["weight_shape"].tolist() == [n, k]
    assert tensors["weight_shape"].dtype == torch.int64
    assert tensors["weight_scale"].dtype == torch.bfloat16
    assert ("weight_zero_point" in tensors) == (not symmetric)
    if not symmetric:
        assert tensors["weight_zero_point"].shape == (-(-n // per_word), qw.scales.shape[1])
    back = read_back(tensors, bits, group_size)
    assert torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.scales, qw.scales)
    assert (back.zeros is None) == (qw.zeros is None)
    if qw.zeros is not None and back.zeros is not None:
        assert torch.equal(back.zeros, qw.zeros)
    assert back.group_size == qw.group_size
    assert torch.equal(dequantize(back), dequantize(qw))


def quantize_rtn_bf16(weight: torch.Tensor, bits: int, group: int, sym: bool) -> QuantizedWeight:
    return rtn_quantize(weight, WeightScheme(bits, group, sym, torch.bfloat16))


def test_quantization_config_is_llm_compressors() -> None:
    sym = quantization_config(QuantizeOptions(
        Path("m"), Path("o"), "rtn", bits=4, group_size=128).quant_config, act_order=False)
    weights = sym["config_groups"]["group_0"]["weights"]
    assert sym["format"] == "pack-quantized" and sym["quant_method"] == "compressed-tensors"
    assert sym["quantization_status"] == "compressed" and sym["ignore"] == ["lm_head"]
    assert sym["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert weights | {"observer": None} == {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": 128,
        "num_bits": 4, "observer": None, "observer_kwargs": {}, "scale_dtype": None,
        "strategy": "group", "symmetric": True, "type": "int", "zp_dtype": None}
    int8 = quantization_config(QuantizeOptions(
        Path("m"), Path("o"), "gptq", bits=8, group_size=-1, calib=Path("c")).quant_config,
        act_order=True)["config_groups"]["group_0"]["weights"]
    assert (int8["strategy"], int8["group_size"], int8["actorder"]) == ("channel", None, "static")
    asym = quantization_config(QuantizeOptions(
        Path("m"), Path("o"), "awq", calib=Path("c")).quant_config, act_order=False)
    assert asym["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert asym["config_groups"]["group_0"]["weights"]["zp_dtype"] == "torch.int8"


def test_act_order_permutation_is_refused_by_the_writer() -> None:
    qw = quantize_rtn_bf16(torch.randn(8, 64), 4, 32, True)
    qw.perm = torch.randperm(64)
    with pytest.raises(ValueError, match="act-order permutation"):
        compressed_tensors(qw)


# ------------------------------------------------------------------ GPTQ


def correlated_inputs(num_rows: int, size: int, seed: int) -> torch.Tensor:
    """Rows whose channels are mixed (correlated) and of unequal scale."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(size, size, generator=generator) / size**0.5 + torch.eye(size)
    return torch.randn(num_rows, size, generator=generator) @ mix * torch.linspace(0.2, 3, size)


def output_error(x: torch.Tensor, weight: torch.Tensor, qw: QuantizedWeight) -> float:
    return float((x @ dequantize(qw, original_order=True).T - x @ weight.T).pow(2).mean())


@pytest.mark.parametrize(("group_size", "symmetric", "act_order"), [
    (32, True, False), (128, False, False), (-1, True, False), (64, True, True),
    (-1, False, True)])
def test_gptq_beats_rtn_on_correlated_inputs(
    group_size: int, symmetric: bool, act_order: bool
) -> None:
    x = correlated_inputs(2048, 256, seed=0)
    weight = 0.05 * torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    accumulator = HessianAccumulator(256, "cpu")
    for chunk in x.split(500):  # several batches, as the pipeline adds them
        accumulator.add(chunk)
    scheme = WeightScheme(4, group_size, symmetric, torch.bfloat16)
    gptq, damp = gptq_quantize(weight, accumulator.hessian(), scheme, act_order=act_order)
    rtn = rtn_quantize(weight, scheme)
    assert damp == 0.01
    assert gptq.perm is None and gptq.scales.dtype == torch.bfloat16
    assert gptq.group_size == (256 if group_size == -1 else group_size)
    assert output_error(x, weight, gptq) < 0.85 * output_error(x, weight, rtn)


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest() -> None:
    """``H`` a multiple of ``I``: no error is spread, so GPTQ rounds exactly as RTN."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    scheme = WeightScheme(4, 32, False, torch.float32)
    gptq, _ = gptq_quantize(weight, 3.0 * torch.eye(128, dtype=torch.float64), scheme)
    rtn = rtn_quantize(weight, scheme)
    assert torch.equal(gptq.qweight, rtn.qweight) and torch.equal(gptq.scales, rtn.scales)


def test_gptq_dead_columns_are_zero() -> None:
    x = correlated_inputs(512, 64, seed=3)
    x[:, 5] = 0.0
    accumulator = HessianAccumulator(64, "cpu")
    accumulator.add(x)
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    gptq, _ = gptq_quantize(weight, accumulator.hessian(), WeightScheme(8, -1, True, torch.float32))
    dense = dequantize(gptq)
    assert torch.isfinite(dense).all() and (dense[:, 5] == 0).all()


def test_inverse_cholesky_retries_with_more_dampening() -> None:
    indefinite = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)  # eigenvalues 3, -1
    upper, damp = inverse_cholesky(indefinite, 0.015)  # fails at 0.015 and 0.15
    assert damp == pytest.approx(1.5)
    damped = indefinite + damp * torch.eye(2, dtype=torch.float64)
    torch.testing.assert_close(upper.double().T @ upper.double(), torch.linalg.inv(damped),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not positive definite"):
        inverse_cholesky(-torch.eye(2, dtype=torch.float64), 0.01)


# ------------------------------------------------------------------ AWQ on a real layer


@pytest.fixture(scope="module")
def hf_layer_runner(
    tiny_checkpoint: Callable[..., Path],
) -> Callable[[str], LayerRunner]:
    """variant -> a float32 HF decoder layer (GQA for llama) with calibration inputs
    caught from its model, an input channel made an outlier."""
    import transformers

    from kvserve.quantize.pipeline import _catch_layer_inputs

    def make(variant: str) -> LayerRunner:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint(variant), dtype=torch.float32, attn_implementation="sdpa").eval()
        tokens = torch.randint(3, 384, (4, 32), generator=torch.Generator().manual_seed(5))
        inputs, kwargs = _catch_layer_inputs(model, tokens, 2, torch.device("cpu"))
        for x in inputs:
            x[..., 7] *= 20.0  # an activation outlier, as trained models have
        return LayerRunner(model.model.layers[0], inputs, kwargs)

    return make


def layer_outputs(runner: LayerRunner) -> torch.Tensor:
    return torch.cat(runner.forward())


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_awq_folding_keeps_the_unquantised_layer(
    variant: str, hf_layer_runner: Callable[[str], LayerRunner]
) -> None:
    runner = hf_layer_runner(variant)
    before = layer_outputs(runner)
    attention = runner.layer.self_attn
    sharing = awq.HeadSharing(attention.config.num_attention_heads,
                              attention.config.num_key_value_heads, attention.head_dim)
    generator = torch.Generator().manual_seed(6)
    for mapping in awq.MAPPINGS:
        shared = sharing if mapping.prev == "self_attn.v_proj" else None
        size = runner.weight(mapping.prev).shape[0]
        scales = torch.rand(size, generator=generator) * 4 + 0.25
        awq.fold_scales(runner.layer, mapping, scales, shared)
    assert runner.weight("input_layernorm").std() > 0.3  # the scales really moved the weights
    torch.testing.assert_close(layer_outputs(runner), before, rtol=1e-4, atol=1e-4)


def test_awq_beats_rtn_on_a_layer_with_outliers(
    hf_layer_runner: Callable[[str], LayerRunner],
) -> None:
    scheme = WeightScheme(4, 32, False, torch.float32)
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]

    def quantized_error(runner: LayerRunner, reference: torch.Tensor) -> float:
        for name in linears:
            weight = runner.weight(name)
            weight.data.copy_(dequantize(rtn_quantize(weight.detach(), scheme)))
        return float((layer_outputs(runner) - reference).pow(2).mean())

    rtn_runner = hf_layer_runner("llama")
    reference = layer_outputs(rtn_runner)
    rtn_error = quantized_error(rtn_runner, reference)
    runner = hf_layer_runner("llama")
    sharing = awq.HeadSharing(4, 2, 16)
    for mapping in awq.MAPPINGS:
        shared = sharing if mapping.prev == "self_attn.v_proj" else None
        awq.fold_scales(runner.layer, mapping, awq.search_scales(runner, mapping, scheme, shared),
                        shared)
    torch.testing.assert_close(layer_outputs(runner), reference, rtol=1e-4, atol=1e-4)
    awq.apply_clip(runner, linears, scheme)
    assert quantized_error(runner, reference) < 0.7 * rtn_error


def test_head_sharing_maps_query_heads_onto_their_kv_head() -> None:
    sharing = awq.HeadSharing(num_heads=4, num_kv_heads=2, head_dim=3)
    per_row = torch.arange(6.0)  # [kv 0: 0 1 2, kv 1: 3 4 5]
    assert sharing.expand(per_row).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    torch.testing.assert_close(sharing.reduce(sharing.expand(per_row)), per_row)


# ------------------------------------------------------------------ data and checks


def test_calibration_texts_from_jsonl_directory_and_file(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n\n{"text": "b", "id": 2}\n')
    assert read_calibration_texts(tmp_path / "data.jsonl") == ["a", "b"]
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "b.py").write_text("x = 1\n")
    (corpus / "pkg" / "a.txt").write_text("hello\n")
    (corpus / "skip.md").write_text("not read\n")
    assert read_calibration_texts(corpus) == ["x = 1\n", "hello\n"]
    (tmp_path / "one.txt").write_text("text")
    assert read_calibration_texts(tmp_path / "one.txt") == ["text"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match="line 2 has no string field 'text'"):
        read_calibration_texts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="no such file"):
        read_calibration_texts(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no calibration text"):
        read_calibration_texts(tmp_path / "empty")


class CharTokenizer:
    """One id per character, BOS 1 before and EOS 2 after (what ``data`` needs)."""

    eos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool, verbose: bool) -> dict:
        return {"input_ids": [1, *(ord(c) for c in text)]}


def test_calibration_windows_are_seeded_distinct_slices() -> None:
    texts = [f"document {i} " * 20 for i in range(10)]
    windows = calibration_windows(texts, CharTokenizer(), num_samples=6, seq_len=16, seed=0)
    assert windows.shape == (6, 16) and windows.dtype == torch.int64
    assert torch.equal(windows, calibration_windows(texts, CharTokenizer(), 6, 16, seed=0))
    assert not torch.equal(windows, calibration_windows(texts, CharTokenizer(), 6, 16, seed=1))
    assert len({tuple(w.tolist()) for w in windows}) == 6
    with pytest.raises(ValueError, match="fewer than --num-samples 100 x --seq-len 64"):
        calibration_windows(texts, CharTokenizer(), num_samples=100, seq_len=64, seed=0)


def test_options_reject_bad_combinations() -> None:
    with pytest.raises(ValueError, match="--act-order applies to --method gptq only"):
        QuantizeOptions(Path("m"), Path("o"), "awq", act_order=True, calib=Path("c"))
    with pytest.raises(ValueError, match="--method gptq needs calibration text"):
        QuantizeOptions(Path("m"), Path("o"), "gptq")
    with pytest.raises(ValueError, match="--group-size 48 is not supported"):
        QuantizeOptions(Path("m"), Path("o"), "rtn", group_size=48)
    with pytest.raises(ValueError, match="--method 'smooth' is not supported"):
        QuantizeOptions(Path("m"), Path("o"), "smooth")
    assert QuantizeOptions(Path("m"), Path("o"), "awq", calib=Path("c")).is_symmetric is False
    assert QuantizeOptions(Path("m"), Path("o"), "rtn").is_symmetric is True


def edited_checkpoint(source: Path, path: Path, **config_changes: object) -> Path:
    path.mkdir()
    for item in source.iterdir():
        (path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps({**config, **config_changes}))
    return path


def test_model_checks(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = tiny_checkpoint("llama")
    _, config = read_model_config(source)
    check_against_model(QuantizeOptions(source, tmp_path / "o", "rtn", group_size=64), config)
    with pytest.raises(ValueError, match="--group-size 128 does not divide the input size 64"):
        check_against_model(QuantizeOptions(source, tmp_path / "o", "rtn"), config)
    with pytest.raises(ValueError, match="--seq-len 512 exceeds the model's"):
        check_against_model(QuantizeOptions(source, tmp_path / "o", "gptq", group_size=32,
                                            calib=Path("c")), config)
    quantized = edited_checkpoint(source, tmp_path / "quantized", quantization_config={
        "quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"already quantised .* quant_method 'gptq'"):
        read_model_config(quantized)
    gpt2 = edited_checkpoint(source, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        read_model_config(gpt2)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        read_model_config(tmp_path / "nothing")


def test_output_must_be_new_or_empty(tmp_path: Path) -> None:
    check_output(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        check_output(tmp_path / "full")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        check_output(tmp_path / "file")
