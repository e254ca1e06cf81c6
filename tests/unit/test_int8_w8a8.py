"""INT8 W8A8 linears (``--quantization w8a8-int8``) on CPU: the torch
reference's arithmetic (``quant/int8.py``: int32 sums exact, the scales after),
the Triton per-token quantiser under ``TRITON_INTERPRET=1`` bit-equal to it
(one block and several per row, float32 / bfloat16 / float16, rows of zeros,
zero rows padded for ``torch._int_mm``) and so the Triton epilogue (scales,
bias, cast; padded rows left out), ``torch._int_mm`` on the CPU equal to
the reference's int32 product, the config's checks, and the engine on a tiny
random checkpoint: close to 16 bits. ``tests/gpu/test_int8_w8a8_gpu.py``
checks the compiled kernel and the ``torch._int_mm`` path;
``test_parallel_engine.py`` the tensor-parallel split."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_int8_w8a8_gpu.py")

from kvserve import LLM  # noqa: E402 (after the interpreter switch)
from kvserve.kernels import fp8_quant, int8_scale  # noqa: E402
from kvserve.quant import int8  # noqa: E402
from kvserve.quant.config import QuantConfig, quantize_at_load  # noqa: E402
from kvserve.quant.methods import Int8W8A8LinearMethod, linear_method  # noqa: E402
from tests import quant_cases as cases  # noqa: E402


def test_reference_quantises_per_token_and_sums_exactly() -> None:
    x, w = cases.reference_linear_inputs()
    x[1, :4] = torch.tensor([0.5, 1.5, 2.5, -2.5]) * (x[1].abs().max() / 127)  # ties
    xq, scales = int8.quantize_per_token(x)
    assert xq.dtype == torch.int8 and scales.shape == (6, 1)
    assert torch.equal(scales[:, 0], x.abs().amax(dim=1) / 127)
    assert int(xq.abs().max()) == 127 and not xq[3].any()
    assert xq[1, :4].tolist() == [0, 2, 2, -2]  # round half to even
    assert bool(((xq.float() * scales - x).abs() <= scales / 2 * (1 + 1e-6)).all())
    wq, w_scales = int8.quantize_weight(w)
    assert wq.dtype == torch.int8 and w_scales.dtype == torch.float32
    out = int8.int8_linear_reference(x.bfloat16(), wq, w_scales, torch.ones(32))
    assert out.dtype == torch.bfloat16 and out.shape == (6, 32)
    xq16, x_scales16 = int8.quantize_per_token(x.bfloat16())
    exact_int = xq16.double() @ wq.double().t()  # every int sum exact in float64
    expected = (exact_int * x_scales16.double() * w_scales.double().t() + 1).bfloat16()
    assert float((out.float() - expected.float()).abs().max()) <= float(
        expected.float().abs().max()) * 2**-7
    exact = x @ w.t() + 1
    assert float((out.float() - exact).norm() / exact.norm()) < 0.02
    assert torch.equal(out[3].float(), torch.ones(32))  # a zero row: the bias alone


def test_int_mm_on_the_cpu_is_the_references_int32_product() -> None:
    generator = torch.Generator().manual_seed(2)
    a = torch.randint(-127, 128, (5, 2500), generator=generator, dtype=torch.int8)
    b = torch.randint(-128, 128, (24, 2500), generator=generator, dtype=torch.int8)
    a[0], b[0] = -128, -128  # the largest sums: 2500 * 2**14, past float32's exact range
    exact = a.to(torch.int64) @ b.to(torch.int64).t()
    assert torch.equal(int8.int8_matmul(a, b).long(), exact)
    assert torch.equal(torch._int_mm(a, b.t()).long(), exact)


@cases.quantiser_dtypes
@cases.quantiser_blocks
def test_triton_quantiser_is_bit_equal_to_the_reference(
    dtype: torch.dtype, k: int, max_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fp8_quant, "MAX_BLOCK", max_block)
    x = cases.quantiser_input(k, dtype)  # row 4's outlier: the rest of it rounds to 0
    x[0, :3] = (torch.tensor([0.5, 1.5, -2.5]) * x[0].float().abs().max() / 127).to(dtype)
    out, scales = fp8_quant.per_token_quant_int8(x)
    expected, expected_scales = int8.quantize_per_token(x)
    assert torch.equal(scales, expected_scales) and torch.equal(out, expected)
    padded, padded_scales = fp8_quant.per_token_quant_int8(x, num_rows_padded=9)
    assert padded.shape == (9, k) and padded_scales.shape == (9, 1)
    assert torch.equal(padded[:5], expected) and not padded[5:].any()
    assert torch.equal(padded_scales[:5], expected_scales) and not padded_scales[5:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_triton_epilogue_is_bit_equal_to_the_reference(dtype: torch.dtype, with_bias: bool
                                                        ) -> None:
    generator = torch.Generator().manual_seed(4)
    acc = torch.randint(-2**24, 2**24, (40, 200), generator=generator, dtype=torch.int32)
    x_scales = torch.rand(40, 1, generator=generator) * 1e-2
    w_scales = torch.rand(200, 1, generator=generator) * 1e-3
    bias = torch.randn(200, generator=generator).to(dtype) if with_bias else None
    out = int8_scale.scale_int32(acc, x_scales, w_scales, bias, dtype, num_rows=37)
    expected = int8.scale_int32_product(acc[:37], x_scales[:37], w_scales, bias, dtype)
    assert out.shape == (37, 200) and out.dtype == dtype
    if dtype == torch.bfloat16:  # the interpreter truncates to bfloat16: within one step
        assert bool(((out.float() - expected.float()).abs()
                     <= expected.float().abs() * 2**-7).all())
    else:
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"num_rows=41: expected 0\.\.40"):
        int8_scale.scale_int32(acc, x_scales, w_scales, bias, dtype, num_rows=41)
    with pytest.raises(ValueError, match=r"w_scales: expected 200 contiguous float32"):
        int8_scale.scale_int32(acc, x_scales, w_scales[:100], bias, dtype, num_rows=3)


def test_config_and_method() -> None:
    config = quantize_at_load("w8a8-int8")
    assert config.name == "w8a8-int8" and config.weight_type == "w8a8-int8"
    method = linear_method(config, ["model.layers.0.self_attn.q_proj"])
    assert isinstance(method, Int8W8A8LinearMethod)
    assert not linear_method(config, ["lm_head"]).quantized
    with pytest.raises(ValueError, match=r"w8a8-int8 weights are 8-bit, symmetric, one scale "
                                         r"per output channel.*symmetric=False"):
        QuantConfig(bits=8, group_size=-1, symmetric=False, weight_type="w8a8-int8")


def test_method_on_the_cpu_runs_the_reference_with_or_without_triton() -> None:
    class Layer:
        output_size, input_size = 24, 64
        use_triton = True

    layer = Layer()
    method = Int8W8A8LinearMethod(quantize_at_load("w8a8-int8"))
    method.create_weights(layer)
    method.init_dummy(layer, torch.Generator().manual_seed(3), 0.02)
    method.process_weights_after_loading(layer)
    assert layer.qweight.dtype == torch.int8  # type: ignore[attr-defined]
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = method.apply(layer, x, None)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    expected = int8.int8_linear_reference(x, layer.qweight, layer.scales, None)  # type: ignore[attr-defined]
    assert torch.equal(out, expected)
    layer.scales.data[1] = -1.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="w8a8-int8 linear's weight scales are not all finite"):
        method.process_weights_after_loading(layer)


def test_engine_quantises_at_load_and_stays_close(tiny_checkpoint: Callable[[str], Path]
                                                  ) -> None:
    path = str(tiny_checkpoint("llama"))
    quantised = LLM(model=path, quantization="w8a8-int8", dtype="bfloat16")
    model = quantised.engine.core.executor.model  # type: ignore[attr-defined]
    for layer in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.down_proj):
        assert layer.qweight.dtype == torch.int8 and layer.scales.dtype == torch.float32
    tokens = cases.greedy_tokens(quantised, cases.ENGINE_PROMPTS, 12)
    exact = cases.greedy_tokens(LLM(model=path, dtype="bfloat16"), cases.ENGINE_PROMPTS, 12)
    # greedy decoding of a random model drifts once two candidates near-tie
    assert all(a[:3] == b[:3] for a, b in zip(tokens, exact, strict=True))
