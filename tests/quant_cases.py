"""Inputs of the quantisation tests, built once for every file that uses them.

Random weight-only quantised linears for the quantised GEMM tests
(``tests/unit/test_quant_kernels.py``, ``tests/gpu/test_quant_matmul_gpu.py``):
codes drawn uniformly over the whole range (0 and the maximum included),
random positive scales, zero points anywhere in the code range, so every
nibble position, group boundary and zero point is exercised, not only the
codes a round-to-nearest quantiser of a smooth weight would produce.

The W8A8 tests' inputs, the same for INT8 and FP8 (``tests/unit`` and
``tests/gpu``: ``test_int8_w8a8*.py``, ``test_fp8_linear*.py``): activations
whose rows and elements span many binades, with rows of zeros and an
outlier, for the per-token quantisers; a W8A8 linear with random weights for
the GEMM paths; prompts and greedy tokens for the engine runs. Kernel
modules are imported inside the functions: collecting a CPU test must
decorate no kernel before the interpreter switch.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvserve import SamplingParams
from kvserve.quant.packing import QuantizedWeight, pack_int4

if TYPE_CHECKING:
    from kvserve import LLM


def random_quantized_weight(
    n: int, k: int, bits: int, group_size: int, symmetric: bool, dtype: torch.dtype,
    seed: int, device: str | torch.device = "cpu", scale: float = 0.02,
) -> QuantizedWeight:
    """A ``[n, k]`` weight in ``quant/packing.py``'s layout (``group_size`` -1:
    one group per row), its scales ~``scale`` so outputs stay O(1)."""
    generator = torch.Generator().manual_seed(seed)
    group_size = k if group_size == -1 else group_size
    codes = torch.randint(0, 2**bits, (n, k), generator=generator, dtype=torch.uint8)
    groups = (n, k // group_size)
    scales = scale * (0.5 + torch.rand(groups, generator=generator))
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 2**bits, groups, generator=generator).to(dtype).to(device)
    return QuantizedWeight(
        qweight=(pack_int4(codes) if bits == 4 else codes).to(device),
        scales=scales.to(dtype).to(device), zeros=zeros, bits=bits, group_size=group_size)


def kernel_tensors(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None]:
    """``qw``'s tensors in the kernels' layout (``repack_for_kernels``, imported
    here so that collecting the GPU tests on a CPU machine decorates no kernel
    before the interpreter tests switch the interpreter on)."""
    from kvserve.kernels.quant_matmul import repack_for_kernels

    return repack_for_kernels(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype and bit patterns (1- or 4-byte elements; NaNs compare)."""
    as_int = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


# the CPU quantiser grid: every input dtype, one block a row and several
quantiser_dtypes = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
quantiser_blocks = pytest.mark.parametrize(
    "k,max_block", [(96, 4096), (200, 64)], ids=["one-pass", "two-pass"])
# the compiled quantiser's (rows, k): llama-3-8b's K of 4096 and 14336, a small
# K and one that is no power of two
DEVICE_QUANTISER_SHAPES = [(1, 4096), (7, 4096), (300, 14336), (64, 128), (3, 5000)]
# (n, k) of llama-3-8b's qkv, o, gate_up and down projections
W8A8_GEMM_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def reference_linear_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [6, 96] float32 whose rows are ~1e-3 to ~30 (row 3 all zeros) and a
    weight [32, 96] ~0.02, for the torch references' per-token arithmetic."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=generator) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 0.1, 5.0])[
        :, None]
    x[3] = 0.0
    w = torch.randn(32, 96, generator=generator) * 0.02
    return x, w


def quantiser_input(k: int, dtype: torch.dtype) -> torch.Tensor:
    """[5, k] on the CPU, each element in its own binade of 2**-14 .. 2**5; row 2
    all zeros; one outlier at [4, 7] (1e4, 6e4 in float16) that takes its row's
    scale, so the rest of the row rounds to 0 or subnormals."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(5, k, generator=generator)
         * 2.0 ** torch.randint(-14, 6, (5, k), generator=generator)).to(dtype)
    x[2] = 0.0
    x[4, 7] = 1e4 if dtype != torch.float16 else 6e4
    return x


def device_quantiser_input(rows: int, k: int, dtype: torch.dtype,
                           device: str = "cuda") -> torch.Tensor:
    """[rows, k] on ``device`` (the global generator), each row scaled into its
    own binade of 2**-12 .. 2**5; row 0 all zeros."""
    x = (torch.randn(rows, k, device=device)
         * 2.0 ** torch.randint(-12, 6, (rows, 1), device=device)).to(dtype)
    x[0, :] = 0.0
    return x


def w8a8_linear_case(
    method: Any, quantize_weight: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    m: int, n: int, k: int, device: str = "cuda",
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(layer, x, bias)``: an [n, k] linear built by the W8A8 ``method`` on
    ``device`` (Triton on) holding ``quantize_weight`` of a weight ~0.02, an
    input [m, k] and a bias [n], both bfloat16."""

    class Layer:
        output_size, input_size, use_triton = n, k, True

    layer: Any = Layer()
    with torch.device(device):
        method.create_weights(layer)
    qweight, scales = quantize_weight(torch.randn(n, k, device=device) * 0.02)
    layer.qweight.data.copy_(qweight)
    layer.scales.data.copy_(scales)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    return layer, x, bias


# three prompts of the tiny checkpoints' vocabulary: 7 tokens, 37, 2
ENGINE_PROMPTS = [[5, 17, 99, 3, 250, 7, 42], list(range(20, 57)), [11, 12]]


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 2 to 40 tokens in ``[3, 250)``."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = 24
                  ) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy output tokens (EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
