"""The compiled weight-only quantised GEMMs (``kernels/quant_matmul.py``) on a
CUDA device (skipped without one), against ``quant/packing.py``'s float32
reference (``x.float() @ dequantize(qw).T + bias``, TF32 off), on
Llama-3-8B's and Llama-3-70B's projection shapes (qkv, o_proj, gate_up,
down, lm_head) and two odd ones, at 1, 2, 7, 16, 33, 256 and 2,048 rows,
bfloat16: INT8 per channel, INT4 g128 symmetric and with zero points (the
odd shapes also INT4 g32 with zeros and INT8 g128, and float16). Each
output is NaN-free (fresh outputs are NaN-poisoned) with a relative error
``||out - ref|| / ||ref||`` under ``FMA_MAX_ERROR`` = 4e-3 for the one-row
FMA path (bf16's output rounding alone is ~1.1e-3) and ``MAX_ERROR`` = 8e-3
for the dot and dequant paths, which also round the weight to bf16.

Then: every path forced at the same rows agrees with the reference (the
dispatcher's choice is not the only one exercised); the fused SiLU gate (FMA,
and the dot kernel's when asked) is bit-equal to ``silu_and_mul`` then the
plain GEMM; programmatic dependent
launch on and off give bit-equal outputs; each path captured in a CUDA graph
and replayed on new inputs equals its eager output bit for bit; and bad
devices raise. Kernel modules are imported inside the tests, so collecting
this file on a CPU machine decorates no kernel before the interpreter tests
switch the interpreter on.

    python -m pytest -q -m gpu tests/gpu/test_quant_matmul_gpu.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvserve.quant.packing import QuantizedWeight, dequantize
from tests.quant_cases import kernel_tensors, random_quantized_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FMA_MAX_ERROR = 4e-3
MAX_ERROR = 8e-3
ROWS = [1, 2, 7, 16, 33, 256, 2048]
LLAMA_SHAPES = {  # name: (N, K)
    "8b-qkv": (6144, 4096), "8b-o_proj": (4096, 4096), "8b-gate_up": (28672, 4096),
    "8b-down": (4096, 14336), "8b-lm_head": (128256, 4096),
    "70b-qkv": (10240, 8192), "70b-o_proj": (8192, 8192), "70b-gate_up": (57344, 8192),
    "70b-down": (8192, 28672), "70b-lm_head": (128256, 8192),
}
# (bits, group size (-1: per channel), symmetric)
WEIGHT_KINDS = {"int8": (8, -1, True), "int4-g128": (4, 128, True),
                "int4-g128-asym": (4, 128, False)}
ODD_CASES = [  # (N, K, bits, group, symmetric, dtype): no block divides N, K steps masked
    (1000, 4000, 4, 32, False, torch.bfloat16), (1000, 4000, 8, -1, False, torch.float16),
    (333, 1152, 8, 128, False, torch.bfloat16), (333, 1152, 4, 128, True, torch.float16),
]


@pytest.fixture(autouse=True)
def _poison_outputs(poisoned_empty: None) -> None:
    """Every test here sees NaN-poisoned ``torch.empty`` outputs."""


@pytest.fixture(autouse=True)
def _exact_float32_reference() -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements NaN or unwritten"
    return ((out.float() - ref).norm() / ref.norm()).item()


class Case:
    """A quantised weight on the GPU, its kernel tensors and float32 reference weight."""

    def __init__(self, n: int, k: int, bits: int, group: int, symmetric: bool,
                 dtype: torch.dtype, seed: int = 0) -> None:
        self.qw: QuantizedWeight = random_quantized_weight(n, k, bits, group, symmetric, dtype,
                                                           seed, device="cuda")
        self.tensors = kernel_tensors(self.qw)
        self.weight32 = dequantize(self.qw)  # [N, K] float32
        self.bias = (0.5 * torch.randn(n, device="cuda")).to(dtype)
        self.dtype = dtype

    def x(self, m: int, seed: int, gated: bool = False) -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        cols = self.weight32.shape[1] * (2 if gated else 1)
        return torch.randn(m, cols, device="cuda", generator=generator).to(self.dtype)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x.float() @ self.weight32.T
        return out if bias is None else out + bias.float()

    def run(self, x: torch.Tensor, bias: torch.Tensor | None = None, **kwargs: object
            ) -> torch.Tensor:
        from kvserve.kernels.quant_matmul import quant_matmul

        q, s, z = self.tensors
        return quant_matmul(x, q, s, z, self.qw.bits, self.qw.group_size, bias,
                            **kwargs)  # type: ignore[arg-type]


def check_rows(case: Case, rows: list[int]) -> None:
    for m in rows:
        x = case.x(m, seed=m)
        bias = case.bias if m % 2 else None
        out = case.run(x, bias)
        assert out.shape == (m, case.weight32.shape[0]) and out.dtype == case.dtype
        limit = FMA_MAX_ERROR if m == 1 else MAX_ERROR
        assert error(out, case.reference(x, bias)) < limit, f"M={m}"


@pytest.mark.parametrize("kind", list(WEIGHT_KINDS))
@pytest.mark.parametrize("shape", list(LLAMA_SHAPES))
def test_llama_shapes_match_reference(shape: str, kind: str) -> None:
    n, k = LLAMA_SHAPES[shape]
    bits, group, symmetric = WEIGHT_KINDS[kind]
    check_rows(Case(n, k, bits, group, symmetric, torch.bfloat16), ROWS)


@pytest.mark.parametrize(("n", "k", "bits", "group", "symmetric", "dtype"), ODD_CASES)
def test_odd_shapes_match_reference(n: int, k: int, bits: int, group: int, symmetric: bool,
                                    dtype: torch.dtype) -> None:
    check_rows(Case(n, k, bits, group, symmetric, dtype), ROWS)


def forced_configs(m: int) -> list[object]:
    from kvserve.kernels import quant_matmul as qm

    configs: list[object] = [qm.DequantConfig(16, 1024, 4),
                             qm.DotConfig(16 if m <= 16 else 64, 32, 128, 2, 3)]
    if m == 1:
        configs.append(qm.FmaConfig(8, 512, 2, 4))
    return configs


@pytest.mark.parametrize("kind", list(WEIGHT_KINDS))
def test_every_path_matches_reference_at_the_same_rows(kind: str) -> None:
    bits, group, symmetric = WEIGHT_KINDS[kind]
    case = Case(6144, 4096, bits, group, symmetric, torch.bfloat16, seed=1)
    for m in (1, 7, 256):
        x = case.x(m, seed=10 + m)
        ref = case.reference(x, case.bias)
        for config in forced_configs(m):
            assert error(case.run(x, case.bias, config=config), ref) < MAX_ERROR, (m, config)


@pytest.mark.parametrize("kind", ["int8", "int4-g128-asym"])
def test_fused_gate_equals_silu_and_mul_then_gemm(kind: str) -> None:
    from kvserve.kernels.activation import silu_and_mul
    from kvserve.kernels.quant_matmul import quant_matmul_dot

    bits, group, symmetric = WEIGHT_KINDS[kind]
    case = Case(4096, 14336, bits, group, symmetric, torch.bfloat16, seed=2)
    for m in (1, 5, 16, 33):
        gate_up = 2.0 * case.x(m, seed=20 + m, gated=True)
        plain = case.run(silu_and_mul(gate_up))
        fused = [case.run(gate_up, gated=True)]  # fused at one row, silu_and_mul first above
        if m > 1:  # the dot kernel's own fused gate
            fused.append(quant_matmul_dot(gate_up, *case.tensors, bits, case.qw.group_size,
                                          gated=True, fuse_gate=True))
        assert all(torch.equal(out, plain) for out in fused), f"M={m}"
        limit = FMA_MAX_ERROR if m == 1 else MAX_ERROR
        assert error(fused[0], case.reference(silu_and_mul(gate_up), None)) < limit


def test_pdl_on_and_off_give_the_same_bits() -> None:
    from kvserve.kernels.pdl import set_pdl

    case = Case(4096, 14336, 4, 128, False, torch.bfloat16, seed=3)
    inputs = [case.x(m, seed=30 + m) for m in (1, 4, 16)]
    with_pdl = [case.run(x, case.bias) for x in inputs]
    set_pdl(False)
    try:
        without = [case.run(x, case.bias) for x in inputs]
    finally:
        set_pdl(True)
    assert all(torch.equal(a, b) for a, b in zip(with_pdl, without, strict=True))


def graph_replays_equal_eager(call: Callable[[torch.Tensor], torch.Tensor],
                              inputs: list[torch.Tensor]) -> None:
    static = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(static)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static)
    for x in inputs[1:]:
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, call(x))


@pytest.mark.parametrize("m", [1, 7, 256, 4096])
def test_each_path_replays_in_a_cuda_graph(m: int) -> None:
    case = Case(6144, 4096, 4, 128, False, torch.bfloat16, seed=4)
    inputs = [case.x(m, seed=40 + i) for i in range(3)]
    graph_replays_equal_eager(lambda x: case.run(x, case.bias), inputs)
    gated = [case.x(m, seed=50 + i, gated=True) for i in range(3)]
    graph_replays_equal_eager(lambda x: case.run(x, gated=True), gated)


def test_tensors_on_different_devices_raise() -> None:
    case = Case(256, 512, 4, 128, False, torch.bfloat16, seed=5)
    x = case.x(2, seed=6)
    with pytest.raises(ValueError, match=r"x: torch\.bfloat16 on cpu; expected .* on cuda"):
        case.run(x.cpu())
    with pytest.raises(ValueError, match=r"bias: .* on cpu"):
        case.run(x, case.bias.cpu())
