"""FP8 W8A8 linears (``--quantization fp8``) on CPU: the torch reference's
arithmetic (``quant/fp8.py``), the Triton per-token quantiser under
``TRITON_INTERPRET=1`` bit-equal to it (one block and several per row;
float32, bfloat16, float16; rows of zeros), the config's checks, and the
engine on tiny random checkpoints: close to 16 bits, and tensor parallel
like one process (``test_parallel_engine.py``). ``tests/gpu`` checks the
compiled kernel and ``torch._scaled_mm`` path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_fp8_linear_gpu.py")

from kvserve import LLM  # noqa: E402 (after the interpreter switch)
from kvserve.kernels import fp8_quant  # noqa: E402
from kvserve.quant import fp8  # noqa: E402
from kvserve.quant.config import QuantConfig, quantize_at_load  # noqa: E402
from kvserve.quant.methods import Fp8LinearMethod, linear_method  # noqa: E402
from tests import quant_cases as cases  # noqa: E402


def test_reference_quantises_per_token_and_per_channel() -> None:
    x, w = cases.reference_linear_inputs()
    xq, scales = fp8.quantize_per_token(x)
    assert xq.dtype == torch.float8_e4m3fn and scales.shape == (6, 1)
    assert torch.equal(scales[:, 0], x.abs().amax(dim=1) / 448)
    assert float(xq.float().abs().max()) == 448.0 and not xq[3].float().any()
    expected = (x / torch.where(scales > 0, scales, 1.0)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert cases.same_bits(xq, expected)
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of itself (normals)
    error = (xq.float() * scales - x).abs()
    assert bool((error <= x.abs() / 16 + scales * 2.0**-9).all())
    wq, w_scales = fp8.quantize_weight(w)
    out = fp8.fp8_linear_reference(x.bfloat16(), wq, w_scales, torch.ones(32))
    assert out.dtype == torch.bfloat16 and out.shape == (6, 32)
    exact = x @ w.t() + 1
    # e4m3 rounds each operand by up to 1/16 (about 3.6% rms): the sums keep that order
    assert float((out.float() - exact).norm() / exact.norm()) < 0.05
    assert torch.equal(out[3].float(), torch.ones(32))  # a zero row: the bias alone


@cases.quantiser_dtypes
@cases.quantiser_blocks
def test_triton_quantiser_is_bit_equal_to_the_reference(
    dtype: torch.dtype, k: int, max_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fp8_quant, "MAX_BLOCK", max_block)
    x = cases.quantiser_input(k, dtype)  # row 4's outlier: the rest of it goes subnormal
    out, scales = fp8_quant.per_token_quant_fp8(x)
    expected, expected_scales = fp8.quantize_per_token(x)
    assert cases.same_bits(scales, expected_scales) and cases.same_bits(out, expected)


def test_quantiser_checks_its_input() -> None:
    with pytest.raises(ValueError, match=r"x: expected a 2-D tensor"):
        fp8_quant.per_token_quant_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"x: dtype torch\.int32"):
        fp8_quant.per_token_quant_fp8(torch.zeros(2, 4, dtype=torch.int32))


def test_config_and_method() -> None:
    config = quantize_at_load("fp8")
    assert config.name == "fp8" and config.weight_type == "fp8" and config.quantizes("q_proj")
    assert isinstance(linear_method(config, ["model.layers.0.self_attn.q_proj"]), Fp8LinearMethod)
    assert not linear_method(config, ["lm_head"]).quantized
    with pytest.raises(ValueError, match=r"fp8 weights are 8-bit, symmetric, one scale per "
                                         r"output channel.*group_size=128"):
        QuantConfig(bits=8, group_size=128, weight_type="fp8")
    with pytest.raises(ValueError, match=r"weight_type='fp4' is not supported"):
        QuantConfig(bits=8, group_size=-1, weight_type="fp4")


def test_engine_quantises_at_load_and_stays_close(tiny_checkpoint: Callable[[str], Path]
                                                  ) -> None:
    path = str(tiny_checkpoint("llama"))
    quantised = LLM(model=path, quantization="fp8", dtype="bfloat16")
    layer = quantised.engine.core.executor.model.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    assert layer.qweight.dtype == torch.float8_e4m3fn and layer.scales.dtype == torch.float32
    tokens = cases.greedy_tokens(quantised, cases.ENGINE_PROMPTS, 12)
    exact = cases.greedy_tokens(LLM(model=path, dtype="bfloat16"), cases.ENGINE_PROMPTS, 12)
    # greedy decoding of a random model drifts once two candidates near-tie
    assert all(a[:3] == b[:3] for a, b in zip(tokens, exact, strict=True))


def test_corrupt_weight_scales_are_refused() -> None:
    class Layer:
        output_size, input_size = 4, 16

    layer = Layer()
    method = Fp8LinearMethod(quantize_at_load("fp8"))
    method.create_weights(layer)
    layer.scales.data.fill_(float("nan"))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="fp8 linear's weight scales are not all finite"):
        method.process_weights_after_loading(layer)
