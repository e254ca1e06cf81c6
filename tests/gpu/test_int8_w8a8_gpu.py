"""INT8 W8A8 linears on a CUDA device (skipped without one): the compiled
per-token int8 quantiser bit-equal to the torch reference over a grid of
shapes (llama-3-8b's K of 4096 and 14336, one block a row and several, small
batches padded for ``torch._int_mm``), the ``torch._int_mm`` path against the
reference's arithmetic (batch 1 to 4096 rows: the int32 sums exact, so only
the float32 epilogue's rounding differs), the Triton epilogue against the
reference's, and the engine with
``quantization="w8a8-int8"``: greedy tokens identical with CUDA graphs on and
off, identical between batch 1 and batch 64, and first-token logprobs close
to bfloat16's (``tests/near_ties.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM
from kvserve.quant import int8
from tests import quant_cases as cases
from tests.near_ties import FIRST_TOKEN, first_token_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,k", cases.DEVICE_QUANTISER_SHAPES)
def test_quantiser_is_bit_equal_to_the_reference(dtype: torch.dtype, rows: int, k: int) -> None:
    from kvserve.kernels.fp8_quant import per_token_quant_int8

    x = cases.device_quantiser_input(rows, k, dtype)
    out, scales = per_token_quant_int8(x, num_rows_padded=32)
    expected, expected_scales = int8.quantize_per_token(x)
    assert out.shape[0] == max(rows, 32)
    assert torch.equal(scales[:rows], expected_scales) and torch.equal(out[:rows], expected)
    assert not out[rows:].any() and not scales[rows:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 6144), (33, 4096), (4096, 28672), (5, 100)])
def test_epilogue_matches_the_reference(dtype: torch.dtype, rows: int, n: int) -> None:
    from kvserve.kernels.int8_scale import scale_int32

    acc = torch.randint(-2**24, 2**24, (max(rows, 32), n), device="cuda", dtype=torch.int32)
    x_scales = torch.rand(acc.shape[0], 1, device="cuda") * 1e-2
    w_scales = torch.rand(n, 1, device="cuda") * 1e-3
    bias = torch.randn(n, device="cuda").to(dtype)
    out = scale_int32(acc, x_scales, w_scales, bias, dtype, rows)
    ref = int8.scale_int32_product(acc[:rows], x_scales[:rows], w_scales, bias, dtype)
    # a fused multiply-add may round the float32 sum once where torch rounds twice
    assert out.shape == (rows, n)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("m", [1, 16, 17, 257, 4096])
@pytest.mark.parametrize("n,k", cases.W8A8_GEMM_SHAPES)
def test_int_mm_path_matches_the_reference(m: int, n: int, k: int) -> None:
    from kvserve.quant.config import quantize_at_load
    from kvserve.quant.methods import Int8W8A8LinearMethod

    method = Int8W8A8LinearMethod(quantize_at_load("w8a8-int8"))
    layer, x, bias = cases.w8a8_linear_case(method, int8.quantize_weight, m, n, k)
    out = method.apply(layer, x, bias)
    ref = int8.int8_linear_reference(x, layer.qweight, layer.scales, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # the int32 sums are exact on both sides: only the epilogue's rounding differs
    assert float((out.float() - ref.float()).abs().max()) <= float(
        ref.float().abs().max()) * 2**-7


def test_engine_graphs_eager_batch_and_close_to_bf16(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 16-bit LM head's one-row skinny GEMM is switched off, as in
    ``test_cuda_graphs_gpu.py``'s batch test: it sums in another order than
    cuBLAS. The int8 linears' int32 sums are exact whatever the batch."""
    from kvserve.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "LAYER_MAX_M", 0)
    path = str(tiny_checkpoint("llama"))
    prompts = cases.random_prompts(64, seed=2)
    kwargs: dict[str, Any] = dict(model=path, dtype="bfloat16", device="cuda", max_num_seqs=64,
                                  gpu_memory_utilization=0.3)
    llm = LLM(**kwargs, quantization="w8a8-int8")
    graphs = cases.greedy_tokens(llm, prompts)
    # batch 1 vs 64: per-token scales make each request's rows independent of the others'
    assert [cases.greedy_tokens(llm, [p])[0] for p in prompts] == graphs
    assert cases.greedy_tokens(LLM(**kwargs, quantization="w8a8-int8", enforce_eager=True),
                   prompts) == graphs
    int8 = llm.generate(prompts, FIRST_TOKEN, use_tqdm=False)
    bf16 = LLM(**kwargs).generate(prompts, FIRST_TOKEN, use_tqdm=False)
    # an H100 measured a median of 0.08 against float32
    assert first_token_error(int8, bf16) < 0.15
