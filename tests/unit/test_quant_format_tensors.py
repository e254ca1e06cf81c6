"""Converting producers' tensors into kvserve's packed layout
(``quant/formats/{gptq,awq,compressed_tensors}.py``) and the loader's
stream (``quant/formats/stream.py``).

The oracle is each producer's own dequantisation, stored beside the
committed fixtures (``scripts/make_quant_fixtures.py``): converted and
dequantised, every reference row must equal it exactly. Edge cases the
fixtures do not reach (GPTQ v1 zero points that borrow across packed
values, act-order groups of the wrong size, wrong shapes and dtypes) use
tensors packed here in each format's documented layout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvserve.quant.config import QuantConfig
from kvserve.quant.formats import parse_quantization_config, read_quantize_config
from kvserve.quant.formats.awq import AWQ_ORDER
from kvserve.quant.formats.stream import quantized_stream
from kvserve.quant.formats.tensors import add_to_words
from kvserve.quant.packing import QuantizedWeight, dequantize, quantize_rtn

FIXTURES = Path(__file__).parent.parent / "fixtures" / "quant"
# weight-only fixtures (the W8A8 ones, llmc-fp8-* and llmc-w8a8-*: test_fp8_checkpoints.py,
# test_int8_w8a8_checkpoints.py)
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir()
                       if (p / "reference.json").is_file()
                       and not p.name.startswith(("llmc-fp8", "llmc-w8a8")))
Tensors = dict[str, torch.Tensor]


def fixture(name: str) -> tuple[QuantConfig, Tensors, dict, Tensors]:
    """(its QuantConfig, its checkpoint tensors, reference.json, reference tensors)."""
    path = FIXTURES / name
    config = parse_quantization_config(json.loads((path / "config.json").read_text()),
                                       read_quantize_config(path))
    assert config is not None
    return (config, load_file(path / "model.safetensors"),
            json.loads((path / "reference.json").read_text()),
            load_file(path / "reference.safetensors"))


def linears(reference: dict) -> set[str]:
    return set(reference["quantized_modules"]) | {"lm_head"}


def unpacked(out: Tensors, module: str, config: QuantConfig) -> QuantizedWeight:
    qweight = out[f"{module}.qweight"]
    k = qweight.shape[1] * 8 // config.bits
    return QuantizedWeight(qweight, out[f"{module}.scales"], out.get(f"{module}.zeros"),
                           config.bits, k if config.group_size == -1 else config.group_size,
                           out.get(f"{module}.perm"))


def test_every_fixture_is_committed() -> None:
    assert len(FIXTURE_NAMES) == 9


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_converted_fixture_equals_producer_dequantisation(name: str) -> None:
    config, tensors, reference, expected = fixture(name)
    out = dict(quantized_stream(config, iter(tensors.items()), linears(reference).__contains__,
                                torch.float32))
    for module in reference["reference_modules"]:
        weight = dequantize(unpacked(out, module, config), original_order=True)
        rows = expected[f"dequantized.{module}"]
        torch.testing.assert_close(weight[: rows.shape[0]], rows, rtol=0, atol=0)
    for module in reference["quantized_modules"]:
        assert out[f"{module}.qweight"].dtype == torch.uint8
        assert f"{module}.weight" not in out
        assert (f"{module}.zeros" in out) == (not config.symmetric)
        assert (f"{module}.perm" in out) == config.act_order
    assert torch.equal(out["lm_head.weight"], tensors["lm_head.weight"])


@pytest.mark.parametrize("name", ["gptqmodel-w4-g32-desc-act-asym",
                                  "llmc06-gptq-w4a16-g32-actorder-group"])
def test_act_order_fixtures_have_real_permutations(name: str) -> None:
    config, tensors, reference, _ = fixture(name)
    out = dict(quantized_stream(config, iter(tensors.items()), linears(reference).__contains__,
                                torch.float32))
    perm = out["model.layers.0.mlp.down_proj.perm"]
    assert not torch.equal(perm, torch.arange(256))
    assert torch.equal(perm.sort().values, torch.arange(256))


# --- tensors packed here, in each format's documented layout -------------------


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int ``[R, C]`` -> int32 ``[R, C * bits // 32]``, value j of a word at bits j*bits.."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (v << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def random_q(n: int, k: int, bits: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g)
    zeros[0, :] = 0  # zero points of 0 make v1's "zero - 1" borrow from the next value
    zeros[1, :] = 2**bits - 1
    scales = (torch.rand(n, groups, generator=g) * 0.01 + 0.001).half()
    return q, zeros, scales


def gptq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int,
                 v1: bool, g_idx: torch.Tensor | None = None) -> Tensors:
    """GPTQ's layout: ``q [N, K]`` (column k in group ``g_idx[k]``), zeros / scales ``[N, G]``."""
    k = q.shape[1]
    qzeros = pack_rows(zeros.T, bits)
    if v1:
        qzeros = add_to_words(qzeros, bits, -1)
    groups = scales.shape[1]
    return {"m.qweight": pack_rows(q, bits).T.contiguous(), "m.qzeros": qzeros,
            "m.scales": scales.T.contiguous(),
            "m.g_idx": (torch.arange(k) // (k // groups) if g_idx is None else g_idx).int()}


def reference_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: torch.Tensor) -> torch.Tensor:
    return (q - zeros[:, g_idx]).float() * scales[:, g_idx].float()


def convert(config: QuantConfig, tensors: Tensors, dtype: torch.dtype = torch.float32) -> Tensors:
    return dict(quantized_stream(config, iter(tensors.items()), lambda m: m == "m", dtype))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_zero_points_v1_and_v2(bits: int, checkpoint_format: str) -> None:
    q, zeros, scales = random_q(64, 128, bits, 4, seed=bits)
    config = QuantConfig(bits=bits, group_size=32, symmetric=False,
                         checkpoint_format=checkpoint_format)
    tensors = gptq_tensors(q, zeros, scales, bits, v1=checkpoint_format == "gptq")
    out = convert(config, tensors)
    assert torch.equal(out["m.zeros"], zeros.float())
    expected = reference_weight(q, zeros, scales, torch.arange(128) // 32)
    torch.testing.assert_close(dequantize(unpacked(out, "m", config)), expected, rtol=0, atol=0)


def test_gptq_v1_is_undone_per_word_not_per_value() -> None:
    # zero points (0, 5) of one word: v1 writes 0x50 - 0x11 = 0x3F, so the values read
    # back one by one are (15, 3); only the whole-word add gives (0, 5) again
    zeros = torch.zeros(1, 8, dtype=torch.int64)
    zeros[0, 1] = 5
    word = add_to_words(pack_rows(zeros, 4), 4, -1)
    assert int(word.item()) & 0xFF == 0x3F
    assert int(add_to_words(word, 4, 1).item()) == 0x50


def test_gptq_act_order_perm_from_g_idx() -> None:
    k, group_size = 128, 32
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(k, generator=g)  # GPTQ's activation order
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group_size
    q, zeros, scales = random_q(32, k, 4, k // group_size, seed=3)
    config = QuantConfig(bits=4, group_size=group_size, symmetric=False,
                         checkpoint_format="gptq_v2", act_order=True)
    out = convert(config, gptq_tensors(q, zeros, scales, 4, v1=False, g_idx=g_idx))
    qw = unpacked(out, "m", config)
    assert torch.equal(out["m.perm"], torch.argsort(g_idx, stable=True))
    expected = reference_weight(q, zeros, scales, g_idx)
    torch.testing.assert_close(dequantize(qw, original_order=True), expected, rtol=0, atol=0)
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(x @ dequantize(qw, original_order=True).T,
                               x[:, qw.perm] @ dequantize(qw).T)


def test_gptq_trivial_g_idx_with_act_order_yields_identity_perm() -> None:
    q, zeros, scales = random_q(32, 64, 4, 2, seed=4)
    config = QuantConfig(bits=4, group_size=32, symmetric=False, checkpoint_format="gptq_v2",
                         act_order=True)
    out = convert(config, gptq_tensors(q, zeros, scales, 4, v1=False))
    assert torch.equal(out["m.perm"], torch.arange(64))


def test_gptq_act_order_groups_of_the_wrong_size_are_refused() -> None:
    q, zeros, scales = random_q(32, 64, 4, 2, seed=5)
    g_idx = torch.arange(64) // 32
    g_idx[0] = 1  # group 0 now holds 31 columns, group 1 holds 33
    config = QuantConfig(bits=4, group_size=32, symmetric=False, checkpoint_format="gptq_v2",
                         act_order=True)
    with pytest.raises(ValueError, match="'m.g_idx': act-order groups must each hold exactly 32 "
                                         r"of the 64 input columns.*\[31, 33\]"):
        convert(config, gptq_tensors(q, zeros, scales, 4, v1=False, g_idx=g_idx))


def test_gptq_symmetric_zeros_are_checked_and_dropped() -> None:
    q, _, scales = random_q(16, 64, 4, 2, seed=6)
    midpoint = torch.full((16, 2), 8)
    config = QuantConfig(bits=4, group_size=32, checkpoint_format="gptq")
    out = convert(config, gptq_tensors(q, midpoint, scales, 4, v1=True))
    assert set(out) == {"m.qweight", "m.scales"}
    torch.testing.assert_close(dequantize(unpacked(out, "m", config)),
                               reference_weight(q, midpoint, scales, torch.arange(64) // 32))
    off_centre = midpoint.clone()
    off_centre[3, 1] = 7
    with pytest.raises(ValueError, match=r"'m.qzeros': quantization_config says sym=true, so "
                                         r"every zero point must be 8"):
        convert(config, gptq_tensors(q, off_centre, scales, 4, v1=True))


def test_gptq_reordered_g_idx_without_desc_act_is_refused() -> None:
    q, zeros, scales = random_q(16, 64, 4, 2, seed=8)
    g_idx = (torch.arange(64) // 32).flip(0)
    config = QuantConfig(bits=4, group_size=32, symmetric=False, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match=r"'m.g_idx' reorders the input columns"):
        convert(config, gptq_tensors(q, zeros, scales, 4, v1=False, g_idx=g_idx))


def awq_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> Tensors:
    """AutoAWQ's GEMM layout: input-major, 8 outputs per word in AWQ_ORDER."""
    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] in column order
        words = values.reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
        return pack_rows(words.reshape(values.shape[0], -1), 4)
    return {"m.qweight": pack(q.T), "m.qzeros": pack(zeros.T), "m.scales": scales.T.contiguous()}


def test_awq_interleaved_nibbles() -> None:
    q, zeros, scales = random_q(32, 128, 4, 2, seed=9)
    config = QuantConfig(bits=4, group_size=64, symmetric=False, checkpoint_format="awq")
    tensors = awq_tensors(q, zeros, scales)
    # output column 1 of input 0 sits in nibble 4 of the first word
    assert (int(tensors["m.qweight"][0, 0].item()) >> 16) & 0xF == q[1, 0].item()
    out = convert(config, tensors)
    torch.testing.assert_close(dequantize(unpacked(out, "m", config)),
                               reference_weight(q, zeros, scales, torch.arange(128) // 64),
                               rtol=0, atol=0)


def ct_tensors(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor,
               bits: int) -> Tensors:
    """compressed-tensors pack-quantized: output-major, zero points packed along N."""
    out = {"m.weight_packed": pack_rows(q, bits), "m.weight_scale": scales,
           "m.weight_shape": torch.tensor(q.shape)}
    if zeros is not None:
        out["m.weight_zero_point"] = pack_rows(zeros.T, bits).T.contiguous()
    return out


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, -1)])
def test_compressed_tensors_asymmetric(bits: int, group_size: int) -> None:
    groups = 1 if group_size == -1 else 128 // group_size
    q, zeros, scales = random_q(64, 128, bits, groups, seed=10)
    config = QuantConfig(bits=bits, group_size=group_size, symmetric=False,
                         checkpoint_format="compressed-tensors")
    out = convert(config, ct_tensors(q, zeros, scales.bfloat16(), bits), torch.bfloat16)
    assert out["m.scales"].dtype == out["m.zeros"].dtype == torch.bfloat16
    g_idx = torch.arange(128) // (128 // groups)
    torch.testing.assert_close(dequantize(unpacked(out, "m", config)),
                               reference_weight(q, zeros, scales.bfloat16(), g_idx),
                               rtol=0, atol=0)


def test_compressed_tensors_group_actorder_g_idx() -> None:
    g = torch.Generator().manual_seed(11)
    g_idx = torch.empty(128, dtype=torch.int64)
    g_idx[torch.randperm(128, generator=g)] = torch.arange(128) // 32
    q, _, scales = random_q(16, 128, 4, 4, seed=12)
    config = QuantConfig(bits=4, group_size=32, checkpoint_format="compressed-tensors",
                         act_order=True)
    tensors = {**ct_tensors(q, None, scales, 4), "m.weight_g_idx": g_idx.int()}
    qw = unpacked(convert(config, tensors), "m", config)
    expected = reference_weight(q, torch.full((16, 4), 8), scales, g_idx)
    torch.testing.assert_close(dequantize(qw, original_order=True), expected, rtol=0, atol=0)


WRONG_TENSORS = [
    ("gptq", "m.qweight", lambda t: t.long(), r"'m.qweight': int64 of shape \(16, 32\); "
                                              r"expected int32 of shape \(16, 32\)"),
    ("gptq", "m.qweight", lambda t: t[:8], r"'m.scales': float16 of shape \(4, 32\); "
                                           r"expected .* of shape \(2, 32\)"),
    ("gptq", "m.scales", lambda t: t.int(), r"'m.scales': int32 of shape \(4, 32\); "
                                            r"expected float16 or bfloat16 or float32"),
    ("gptq", "m.qzeros", lambda t: t[:, :2], r"'m.qzeros': int32 of shape \(4, 2\); "
                                             r"expected int32 of shape \(4, 4\)"),
    ("gptq", "m.scales", lambda t: t[None], r"'m.scales': float16 of shape \(1, 4, 32\); "
                                            r"expected .* of a 2-D tensor"),
    ("awq", "m.qweight", lambda t: t[:, :2], r"'m.qweight': int32 of shape \(128, 2\); "
                                             r"expected int32 of shape \(128, 4\)"),
    ("awq", "m.scales", lambda t: t[:1], r"'m.scales': shape \(1, 32\) does not fit "
                                         r"'m.qweight'.*expected \(4, 32\)"),
    ("awq", "m.qzeros", lambda t: t.half(), r"'m.qzeros': float16 of shape \(4, 4\)"),
    ("ct", "m.weight_shape", lambda t: torch.tensor([32, 256]),
     r"'m.weight_packed': int32 of shape \(32, 16\); expected int32 of shape \(32, 32\)"),
    ("ct", "m.weight_shape", lambda t: t.float(), r"'m.weight_shape': float32 of shape \(2,\)"),
    ("ct", "m.weight_scale", lambda t: t[:, :1], r"'m.weight_scale': float16 of shape "
                                                 r"\(32, 1\); expected .* of shape \(32, 4\)"),
]


def format_case(kind: str) -> tuple[QuantConfig, Tensors]:
    q, zeros, scales = random_q(32, 128, 4, 4, seed=13)
    if kind == "gptq":
        return (QuantConfig(bits=4, group_size=32, symmetric=False, checkpoint_format="gptq"),
                gptq_tensors(q, zeros, scales, 4, v1=True))
    if kind == "awq":
        return (QuantConfig(bits=4, group_size=32, symmetric=False, checkpoint_format="awq"),
                awq_tensors(q, zeros, scales))
    return (QuantConfig(bits=4, group_size=32, symmetric=False,
                        checkpoint_format="compressed-tensors"), ct_tensors(q, zeros, scales, 4))


@pytest.mark.parametrize(("kind", "name", "corrupt", "message"),
                         WRONG_TENSORS)
def test_wrong_shapes_and_dtypes_name_the_tensor(kind: str, name: str, corrupt, message: str
                                                 ) -> None:
    config, tensors = format_case(kind)
    tensors[name] = corrupt(tensors[name])
    with pytest.raises(ValueError, match=message):
        convert(config, tensors)


def test_compressed_tensors_zero_point_packed_along_n_is_checked() -> None:
    q, zeros, scales = random_q(64, 128, 4, 4, seed=14)
    config = QuantConfig(bits=4, group_size=32, symmetric=False,
                         checkpoint_format="compressed-tensors")
    tensors = ct_tensors(q, zeros, scales, 4)
    tensors["m.weight_zero_point"] = zeros.int()  # not packed along N
    with pytest.raises(ValueError, match=r"'m.weight_zero_point': int32 of shape \(64, 4\); "
                                         r"expected int32 of shape \(8, 4\)"):
        convert(config, tensors)


# --- the stream ------------------------------------------------------------------


def test_stream_is_order_independent_across_shards() -> None:
    config, tensors, reference, _ = fixture("llmc-gptq-w4a16-asym-g32-actorder")
    in_order = dict(quantized_stream(config, iter(tensors.items()),
                                     linears(reference).__contains__, torch.float32))
    items = list(tensors.items())
    shards = [items[1::3], items[2::3][::-1], items[0::3]]  # interleaved, one reversed
    shuffled = dict(quantized_stream(config, (t for shard in shards for t in shard),
                                     linears(reference).__contains__, torch.float32))
    assert in_order.keys() == shuffled.keys()
    for name, tensor in in_order.items():
        assert torch.equal(shuffled[name], tensor), name


def test_stream_holds_only_incomplete_modules() -> None:
    config, tensors, reference, _ = fixture("gptqmodel-w4-g32-asym-v2")
    consumed: list[str] = []

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in sorted(tensors.items()):
            consumed.append(name)
            yield name, tensor

    for name, _ in quantized_stream(config, source(), linears(reference).__contains__,
                                    torch.float32):
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            # yielded as soon as the module's last part arrived, before anything after it
            assert consumed[-1].startswith(module + "."), (name, consumed[-1])


def test_stream_reports_missing_parts_per_module() -> None:
    config, tensors, reference, _ = fixture("autoawq-gemm-w4-g64")
    del tensors["model.layers.0.mlp.up_proj.scales"]
    del tensors["model.layers.1.self_attn.q_proj.qzeros"]
    del tensors["model.layers.1.self_attn.q_proj.scales"]
    with pytest.raises(ValueError, match=r"checkpoint lacks parts of 2 quantised linear\(s\): "
                       r"model.layers.0.mlp.up_proj \(missing scales\); "
                       r"model.layers.1.self_attn.q_proj \(missing qzeros, scales\)"):
        list(quantized_stream(config, iter(tensors.items()), linears(reference).__contains__,
                              torch.float32))


def test_stream_refuses_a_16_bit_weight_of_a_quantised_linear_and_duplicates() -> None:
    config, tensors, reference, _ = fixture("llmc-gptq-w4a16-g128")
    is_linear = linears(reference).__contains__
    bad = {**tensors, "model.layers.0.mlp.up_proj.weight": torch.zeros(256, 128)}
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' is a 16-bit "
                                         r"weight, but the quantization_config"):
        list(quantized_stream(config, iter(bad.items()), is_linear, torch.float32))
    items = list(tensors.items())
    twice = items + [(n, t) for n, t in items if n.endswith("k_proj.weight_scale")][:1]
    twice.sort(key=lambda item: item[0])
    with pytest.raises(ValueError, match="appears twice"):
        list(quantized_stream(config, iter(twice), is_linear, torch.float32))


def test_stream_passes_ignored_linears_and_other_tensors_through() -> None:
    config, tensors, reference, _ = fixture("llmc-gptq-w8a16-channel")
    module = "model.layers.1.mlp.down_proj"
    config = dataclasses.replace(config, ignore=(*config.ignore, module))
    dense = torch.randn(128, 256)
    source = {n: t for n, t in tensors.items() if not n.startswith(module + ".")}
    source[f"{module}.weight"] = dense
    source["model.layers.0.self_attn.q_proj.bias"] = torch.randn(128)
    out = dict(quantized_stream(config, iter(source.items()), linears(reference).__contains__,
                                torch.bfloat16))
    assert out[f"{module}.weight"] is dense
    assert out["model.layers.0.self_attn.q_proj.bias"] is \
        source["model.layers.0.self_attn.q_proj.bias"]
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert out[name] is source[name]
    assert out["model.layers.0.self_attn.q_proj.scales"].dtype == torch.bfloat16


def test_stream_rounds_16_bit_linears_at_load() -> None:
    config = QuantConfig(bits=4, group_size=32, symmetric=False)  # no checkpoint format
    g = torch.Generator().manual_seed(15)
    source = {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=g),
              "model.layers.0.mlp.down_proj.bias": torch.randn(64, generator=g),
              "model.layers.0.input_layernorm.weight": torch.randn(128, generator=g),
              "lm_head.weight": torch.randn(32, 128, generator=g)}
    is_linear = {"model.layers.0.mlp.down_proj", "lm_head"}.__contains__
    out = dict(quantized_stream(config, iter(source.items()), is_linear, torch.float16))
    expected = quantize_rtn(source["model.layers.0.mlp.down_proj.weight"], 4, 32, False,
                            scale_dtype=torch.float16)
    assert torch.equal(out["model.layers.0.mlp.down_proj.qweight"], expected.qweight)
    assert torch.equal(out["model.layers.0.mlp.down_proj.scales"], expected.scales)
    assert expected.zeros is not None
    assert torch.equal(out["model.layers.0.mlp.down_proj.zeros"], expected.zeros)
    for name in ("model.layers.0.mlp.down_proj.bias", "model.layers.0.input_layernorm.weight",
                 "lm_head.weight"):
        assert out[name] is source[name]
    assert "model.layers.0.mlp.down_proj.weight" not in out
