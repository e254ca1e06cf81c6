"""kvserve's packed weight-only layout (``quant/packing.py``): packing, the
dequantised reference, round-to-nearest quantisation, and its checks."""

from __future__ import annotations

import pytest
import torch

from kvserve.quant.config import QuantConfig
from kvserve.quant.packing import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    quantize_rtn,
    quantized_linear_reference,
    unpack,
)


def test_int4_packs_even_columns_in_the_low_nibble() -> None:
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[1 | 2 << 4, 15]]
    assert torch.equal(unpack(packed, 4), q)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_round_trips_within_half_a_step(bits: int, group_size: int, symmetric: bool) -> None:
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(bits + group_size))
    qw = quantize_rtn(weight, bits, group_size, symmetric, scale_dtype=torch.float32)
    assert qw.qweight.shape == (16, 128 * bits // 8)
    assert qw.shape == (16, 128)
    steps = qw.scales.repeat_interleave(qw.group_size, dim=1)
    assert ((dequantize(qw) - weight).abs() <= steps / 2 + 1e-6).all()
    assert qw.symmetric == symmetric


def test_symmetric_int4_is_centred_on_eight() -> None:
    weight = torch.linspace(-1.0, 1.0, 65).reshape(1, 65)[:, 1:]  # 64 values, 0 excluded
    weight = torch.cat([weight, torch.zeros(1, 64)], dim=1)
    qw = quantize_rtn(weight, 4, -1, symmetric=True, scale_dtype=torch.float32)
    q = unpack(qw.qweight, 4)
    # absmax / 7.5: +1.0 lands on 7.5 -> clamped to 15, -1.0 is not in the tensor
    assert int(q.max()) == 15 and int(q.min()) <= 1
    assert (q[0, 64:] == 8).all()  # zero is exact
    assert qw.scales.item() == pytest.approx(1.0 / 7.5)


def test_act_order_permutation_is_applied_to_the_input() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 64, generator=generator)
    perm = torch.randperm(64, generator=generator)
    qw = quantize_rtn(weight[:, perm], 8, 32, scale_dtype=torch.float32)
    qw.perm = perm
    x = torch.randn(3, 64, generator=generator)
    expected = x @ dequantize(qw, original_order=True).T
    torch.testing.assert_close(quantized_linear_reference(x, qw), expected)
    torch.testing.assert_close(dequantize(qw, original_order=True), weight, atol=0.05, rtol=0)


def test_bad_layouts_name_the_tensor() -> None:
    qw = quantize_rtn(torch.randn(4, 64), 4, 32)
    with pytest.raises(ValueError, match="scales: shape"):
        QuantizedWeight(qw.qweight, qw.scales[:, :1], None, 4, 32)
    with pytest.raises(ValueError, match="qweight"):
        QuantizedWeight(qw.qweight.to(torch.int32), qw.scales, None, 4, 32)
    with pytest.raises(ValueError, match="group_size=48"):
        QuantizedWeight(qw.qweight, qw.scales, None, 4, 48)
    with pytest.raises(ValueError, match="bits=3"):
        quantize_rtn(torch.randn(4, 64), 3, 32)


def test_quant_config_names_and_ignores() -> None:
    config = QuantConfig(bits=4, group_size=128, ignore=("lm_head", "re:.*layers\\.0\\..*"))
    assert config.name == "int4-g128"
    assert QuantConfig(bits=8, group_size=-1, symmetric=False).name == "int8-asym"
    assert not config.quantizes("lm_head")
    assert not config.quantizes("model.layers.0.mlp.down_proj")
    assert config.quantizes("model.layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match="group_size=96"):
        QuantConfig(bits=4, group_size=96)


def test_bytes_per_weight_counts_scales_and_zeros() -> None:
    assert QuantConfig(bits=4, group_size=128).bytes_per_weight(4096, 2) == 0.5 + 2 / 128
    asym = QuantConfig(bits=4, group_size=32, symmetric=False)
    assert asym.bytes_per_weight(4096, 2) == 0.5 + 4 / 32
    assert QuantConfig(bits=8, group_size=-1).bytes_per_weight(4096, 2) == 1 + 2 / 4096
    assert QuantConfig(bits=8, group_size=-1).num_quantized(100, 10) == 100
    assert QuantConfig(bits=8, group_size=-1, ignore=()).num_quantized(100, 10) == 110


def test_decode_bytes_of_a_quantised_preset() -> None:
    import dataclasses

    from kvserve.bench.offline import ModelFigures
    from kvserve.config import ModelConfig
    from kvserve.models.presets import get_preset

    config = ModelConfig.from_hf_config(get_preset("llama-3-8b"))
    bf16 = ModelFigures.of(config, 2).weight_read_bytes
    int4 = ModelFigures.of(dataclasses.replace(
        config, quantization=QuantConfig(bits=4, group_size=128)), 2).weight_read_bytes
    lm_head = config.vocab_size * config.hidden_size * 2
    # the 16-bit LM head stays; the decoder's linears shrink 16 / (4 + 16 / 128) times
    assert (int4 - lm_head) == pytest.approx((bf16 - lm_head) * (0.5 + 2 / 128) / 2, rel=1e-3)
