"""FP8 W8A8 linears on a CUDA device (skipped without one): the compiled
per-token quantiser bit-equal to the torch reference over a grid of shapes
(llama-3-8b's K of 4096 and 14336, one block a row and several), the
``torch._scaled_mm`` path against the reference's arithmetic (row-wise
scales; batch 1 to 4096 rows), and the engine with ``quantization="fp8"``:
greedy tokens identical with CUDA graphs on and off, and close to
bfloat16."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.quant import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="FP8 GEMMs need compute capability 8.9 or newer"),
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,k", [(1, 4096), (7, 4096), (300, 14336), (64, 128), (3, 5000)])
def test_quantiser_is_bit_equal_to_the_reference(dtype: torch.dtype, rows: int, k: int) -> None:
    from kvserve.kernels.fp8_quant import per_token_quant_fp8

    x = (torch.randn(rows, k, device="cuda")
         * 2.0 ** torch.randint(-12, 6, (rows, 1), device="cuda")).to(dtype)
    x[0, :] = 0.0
    out, scales = per_token_quant_fp8(x)
    expected, expected_scales = fp8.quantize_per_token(x)
    assert same_bits(scales, expected_scales) and same_bits(out, expected)


@pytest.mark.parametrize("m", [1, 16, 257, 4096])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_scaled_mm_path_matches_the_reference(m: int, n: int, k: int) -> None:
    from kvserve.quant.config import quantize_at_load
    from kvserve.quant.methods import Fp8LinearMethod

    class Layer:
        output_size, input_size, use_triton = n, k, True

    layer: Any = Layer()
    method = Fp8LinearMethod(quantize_at_load("fp8"))
    with torch.device("cuda"):
        method.create_weights(layer)
    qweight, scales = fp8.quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    layer.qweight.data.copy_(qweight)
    layer.scales.data.copy_(scales)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = method.apply(layer, x, bias)
    ref = fp8.fp8_linear_reference(x, layer.qweight, layer.scales, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # the same products summed in another order, rounded to bfloat16 once
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_graphs_eager_and_close_to_bf16(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = str(tiny_checkpoint("llama"))
    prompts = _prompts(17, seed=2)
    kwargs: dict[str, Any] = dict(model=path, dtype="bfloat16", device="cuda", max_num_seqs=32,
                                  gpu_memory_utilization=0.3)
    graphs = _tokens(LLM(**kwargs, quantization="fp8"), prompts)
    assert _tokens(LLM(**kwargs, quantization="fp8", enforce_eager=True), prompts) == graphs
    bf16 = _tokens(LLM(**kwargs), prompts)
    assert all(a[:3] == b[:3] for a, b in zip(graphs, bf16, strict=True))
