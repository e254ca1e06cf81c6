"""The weight-only quantised GEMM kernels (``kernels/quant_matmul.py``) on CPU
under ``TRITON_INTERPRET=1``, against ``quant/packing.py``'s torch reference,
on tiny ragged shapes: N = 40 (no block divides it), K a multiple of the
group and also K that the K step does not divide (the masked last step);
INT4 and INT8; groups of 16 (INT8), 32, 64, 128 and one group per row;
symmetric and with zero points; one row (FMA), 2 / 5 / 16 rows (the skinny
dot tile), 33 rows (dot tiles on a 2-D grid in grouped order) and the
dequantise-then-``F.linear`` path; the fused SiLU gate; bias; float16 and
bfloat16. Weights are random codes over the whole range with random zero
points (``tests/quant_cases.py``). Outputs are NaN-poisoned (``torch.empty``
is patched), inputs fresh and seeded.

Tolerances (``within_one_rounding``: ``|out - ref| <= eps * (|ref| + 0.01 *
max|ref|)``, eps 2**-10 for float16 and 2**-7 for bfloat16, i.e. one unit in
the last place above a floor for cancelled sums):

- FMA against ``quantized_linear_reference`` (float32 over the float32
  dequantised weight, rounded once): one rounding apart, as only the order of
  the float32 sums differs;
- dot with groups: one rounding apart from the same product over the weight
  rounded to x's dtype (what the kernel multiplies), and within 2e-3 of the
  norm of the exact reference; dot with one group per row (exact weights):
  one rounding apart from the exact reference;
- dequantise kernel: float16 bit-equal to ``dequantize(qw)`` rounded to
  float16; bfloat16 one rounding apart, because the interpreter truncates
  float32 to bfloat16 (compiled kernels round to nearest; ``tests/gpu``).
- the fused gate: bit-equal to ``silu_and_mul`` then the plain kernel.

The interpreter has no bfloat16 ``tl.dot`` (it multiplies the raw bits), so
the dot path runs in float16 here and in bfloat16 in
``tests/gpu/test_quant_matmul_gpu.py``; the interpreter never traces the
programmatic-dependent-launch or inline-PTX branches, which
``tests/compile_kernels_sm90.py`` compiles for sm_90. Skipped like the other
interpreter tests: without Triton, with CUDA, or when Triton was imported
without the interpreter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_quant_matmul_gpu.py")

from kvserve.kernels import quant_matmul as qm  # noqa: E402 (after the interpreter switch)
from kvserve.kernels.activation import silu_and_mul  # noqa: E402
from kvserve.kernels.quant_matmul import (  # noqa: E402
    DequantConfig,
    DotConfig,
    FmaConfig,
    quant_matmul,
)
from kvserve.quant.packing import (  # noqa: E402
    QuantizedWeight,
    dequantize,
    quantized_linear_reference,
)
from tests.quant_cases import kernel_tensors, random_quantized_weight  # noqa: E402

N = 40
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
# (bits, group size (-1: one a row), symmetric, K): every group size, both zero modes
WEIGHTS = [(4, 32, False, 256), (4, 64, True, 256), (4, 128, False, 256), (4, -1, True, 224),
           (4, -1, False, 256), (8, 16, False, 208), (8, 64, True, 256), (8, -1, False, 256)]
WEIGHT_IDS = [f"int{b}-{'pc' if g == -1 else f'g{g}'}-{'sym' if s else 'asym'}-k{k}"
              for b, g, s, k in WEIGHTS]
# K steps of 64 columns: several iterations, and K = 208 / 224 leave a masked last step
FMA_CONFIG = FmaConfig(block_n=16, block_k=64, num_warps=2, num_stages=2)
SKINNY_DOT = DotConfig(block_m=16, block_n=16, block_k=64, num_warps=1, num_stages=2)
TILE_DOT = DotConfig(block_m=32, block_n=16, block_k=64, num_warps=1, num_stages=2, group_m=2)


@pytest.fixture(autouse=True)
def _poison_outputs(poisoned_empty: None) -> None:
    """Every test here sees NaN-poisoned ``torch.empty`` outputs."""


def within_one_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    ref32 = ref.float()
    tolerance = EPS[ref.dtype] * (ref32.abs() + 0.01 * ref32.abs().max())
    excess = (out.float() - ref32).abs() - tolerance
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} elements off by up to " \
                                f"{excess.max().item():.2e} beyond one rounding"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(bits: int, group: int, symmetric: bool, k: int, m: int, dtype: torch.dtype,
              seed: int, gated: bool = False
              ) -> tuple[QuantizedWeight, torch.Tensor, torch.Tensor | None]:
    """A weight, x ``[m, K]`` (``[m, 2K]`` gated) and a bias (with zero points only)."""
    qw = random_quantized_weight(N, k, bits, group, symmetric, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, (2 if gated else 1) * k, generator=generator).to(dtype)
    bias = None if symmetric else torch.randn(N, generator=generator).to(dtype)
    return qw, x, bias


def rounded_weight_reference(x: torch.Tensor, qw: QuantizedWeight,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """The product over the dequantised weight rounded to x's dtype, in float32."""
    out = x.float() @ dequantize(qw).to(x.dtype).float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def run(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
        config: qm.QuantGemmConfig | None, gated: bool = False) -> torch.Tensor:
    q, s, z = kernel_tensors(qw)
    return quant_matmul(x, q, s, z, qw.bits, qw.group_size, bias, gated, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("bits", "group", "symmetric", "k"), WEIGHTS, ids=WEIGHT_IDS)
def test_fma_path_matches_reference(bits: int, group: int, symmetric: bool, k: int,
                                    dtype: torch.dtype) -> None:
    qw, x, bias = make_case(bits, group, symmetric, k, 1, dtype, seed=bits + k + group)
    within_one_rounding(run(x, qw, bias, FMA_CONFIG), quantized_linear_reference(x, qw, bias))


def test_fma_default_config_with_one_step() -> None:
    qw, x, bias = make_case(4, 128, False, 256, 1, torch.float16, seed=5)
    assert qm.default_fma_config(4, N, 256).block_k == 256  # capped to K: one step
    within_one_rounding(run(x, qw, bias, None), quantized_linear_reference(x, qw, bias))


@pytest.mark.parametrize("m", [2, 5, 16, 33])
@pytest.mark.parametrize(("bits", "group", "symmetric", "k"), WEIGHTS, ids=WEIGHT_IDS)
def test_dot_path_matches_reference(bits: int, group: int, symmetric: bool, k: int,
                                    m: int) -> None:
    dtype = torch.float16  # the interpreter has no bfloat16 tl.dot
    qw, x, bias = make_case(bits, group, symmetric, k, m, dtype, seed=m + bits + k)
    out = run(x, qw, bias, SKINNY_DOT if m <= qm.SKINNY_MAX_M else TILE_DOT)
    exact = quantized_linear_reference(x, qw, bias)
    if group == -1:  # q - z exactly, the scale on the float32 sum
        within_one_rounding(out, exact)
    else:
        within_one_rounding(out, rounded_weight_reference(x, qw, bias))
        assert relative_error(out, exact) < 2e-3


def test_dot_tiles_spanning_several_groups_and_parts_of_one() -> None:
    # a K step of 128 columns over groups of 32 (four groups a step) and of 256 (half a group)
    for group, k in ((32, 256), (256, 512)):
        qw, x, bias = make_case(4, group, False, k, 3, torch.float16, seed=group)
        config = DotConfig(block_m=16, block_n=32, block_k=128, num_warps=2, num_stages=2)
        within_one_rounding(run(x, qw, bias, config), rounded_weight_reference(x, qw, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("bits", "group", "symmetric", "k"),
                         [WEIGHTS[0], WEIGHTS[3], WEIGHTS[5], WEIGHTS[7]],
                         ids=[WEIGHT_IDS[0], WEIGHT_IDS[3], WEIGHT_IDS[5], WEIGHT_IDS[7]])
def test_dequantize_kernel_rounds_the_reference_weight_once(
        bits: int, group: int, symmetric: bool, k: int, dtype: torch.dtype) -> None:
    qw = random_quantized_weight(N, k, bits, group, symmetric, dtype, seed=k + bits)
    out = qm.dequantize_weight(*kernel_tensors(qw), bits, qw.group_size,
                               DequantConfig(block_n=16, block_k=64, num_warps=2))
    if dtype == torch.float16:
        assert torch.equal(out, dequantize(qw).to(dtype))
    else:  # the interpreter truncates to bfloat16
        within_one_rounding(out, dequantize(qw).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dequant_path_is_cublas_over_the_rounded_weight(dtype: torch.dtype) -> None:
    qw, x, bias = make_case(4, 32, False, 256, 7, dtype, seed=11)
    out = run(x, qw, bias, DequantConfig(block_n=16, block_k=128, num_warps=2))
    weight = qm.dequantize_weight(*kernel_tensors(qw), 4, 32)
    assert torch.equal(out, torch.nn.functional.linear(x, weight, bias))
    assert relative_error(out, quantized_linear_reference(x, qw, bias)) < 1e-2


@pytest.mark.parametrize(("dtype", "config"), [
    (torch.float16, FMA_CONFIG), (torch.bfloat16, FMA_CONFIG), (torch.float16, SKINNY_DOT),
    (torch.bfloat16, DequantConfig(block_n=16, block_k=64, num_warps=2)),
], ids=["fma-fp16", "fma-bf16", "dot-fp16", "dequant-bf16"])
@pytest.mark.parametrize(("bits", "group", "symmetric", "k"), [WEIGHTS[0], WEIGHTS[7]],
                         ids=[WEIGHT_IDS[0], WEIGHT_IDS[7]])
def test_gated_input_equals_silu_and_mul_first(bits: int, group: int, symmetric: bool, k: int,
                                               dtype: torch.dtype,
                                               config: qm.QuantGemmConfig) -> None:
    m = 1 if isinstance(config, FmaConfig) else 3
    qw, gate_up, bias = make_case(bits, group, symmetric, k, m, dtype, seed=21, gated=True)
    gate_up = 2.0 * gate_up  # reach silu's curved part
    if isinstance(config, DotConfig):  # three rows: fused only when asked
        fused = qm.quant_matmul_dot(gate_up, *kernel_tensors(qw), bits, qw.group_size, bias,
                                    gated=True, config=config, fuse_gate=True)
    else:
        fused = run(gate_up, qw, bias, config, gated=True)
    assert torch.equal(fused, run(silu_and_mul(gate_up), qw, bias, config))
    assert torch.equal(fused, run(gate_up, qw, bias, config, gated=True))
    assert relative_error(fused, quantized_linear_reference(silu_and_mul(gate_up), qw, bias)) \
        < 1e-2


def test_repack_orders_int4_nibbles_by_half_chunks_and_transposes_scales() -> None:
    qw = random_quantized_weight(3, 64, 4, 32, False, torch.float16, seed=1)
    q, s, z = kernel_tensors(qw)
    codes = torch.stack((qw.qweight & 0xF, qw.qweight >> 4), dim=-1).flatten(1)  # [3, 64]
    for chunk in range(2):
        byte = q[:, chunk * 16:(chunk + 1) * 16]
        assert torch.equal(byte & 0xF, codes[:, chunk * 32:chunk * 32 + 16])
        assert torch.equal(byte >> 4, codes[:, chunk * 32 + 16:chunk * 32 + 32])
    assert z is not None and qw.zeros is not None
    assert torch.equal(s, qw.scales.t()) and s.is_contiguous()
    assert torch.equal(z, qw.zeros.t()) and z.is_contiguous()
    int8 = random_quantized_weight(3, 64, 8, -1, True, torch.float16, seed=2)
    q8, s8, z8 = kernel_tensors(int8)
    assert q8 is int8.qweight and z8 is None and s8.shape == (1, 3)


def test_path_follows_the_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, Any]] = []
    for name in ("quant_matmul_fma", "quant_matmul_dot", "quant_matmul_dequant"):
        def record(x: torch.Tensor, *args: Any, _name: str = name, **kwargs: Any) -> None:
            calls.append((_name.removeprefix("quant_matmul_"), x.shape[0], args[-1]))
        monkeypatch.setattr(qm, name, record)
    for m in (1, 2, qm.SKINNY_MAX_M, qm.SKINNY_MAX_M + 1, qm.DEQUANT_MIN_M - 1,
              qm.DEQUANT_MIN_M):
        quant_matmul(torch.empty(m, 64), *(None,) * 3, 4, 32)  # type: ignore[arg-type]
    assert [(path, m) for path, m, _ in calls] == [
        ("fma", 1), ("dot", 2), ("dot", qm.SKINNY_MAX_M), ("dot", qm.SKINNY_MAX_M + 1),
        ("dot", qm.DEQUANT_MIN_M - 1), ("dequant", qm.DEQUANT_MIN_M)]
    calls.clear()
    dequant = DequantConfig(16, 64, 2)
    for config in (SKINNY_DOT, dequant):  # a config forces its path, whatever the rows
        quant_matmul(torch.empty(1, 64), *(None,) * 3, 4, 32, config=config)  # type: ignore[arg-type]
    assert calls == [("dot", 1, SKINNY_DOT), ("dequant", 1, dequant)]


def test_default_configs_fill_the_card_and_divide_llama_shapes() -> None:
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
              (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]
    for bits in (4, 8):
        for n, k in shapes:
            fma = qm.default_fma_config(bits, n, k)
            assert k % fma.block_k == 0 and -(-n // fma.block_n) >= 132
            for m in (2, 16, 33, 256, 2048):
                dot = qm.default_dot_config(bits, m, n, k, num_sms=132)
                assert k % dot.block_k == 0
                programs = -(-n // dot.block_n) * -(-m // dot.block_m)
                # INT4 decode batches take fewer, larger programs (decision 0018)
                skinny = 64 if bits == 4 else 132
                assert programs >= (skinny if m <= qm.SKINNY_MAX_M else 32)
            assert k % qm.default_dequant_config(bits, k).block_k == 0


def test_bad_inputs_raise_naming_the_tensor() -> None:
    qw = random_quantized_weight(N, 64, 4, 32, False, torch.float16, seed=3)
    q, s, z = kernel_tensors(qw)
    assert z is not None
    x = torch.randn(2, 64).half()
    cases: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        (r"bits=3; allowed: \(4, 8\)", (x, q, s, z, 3, 32), {}),
        (r"qweight: torch\.int8", (x, q.view(torch.int8), s, z, 4, 32), {}),
        (r"qweight: .*strides", (x, q.t().contiguous().t(), s, z, 4, 32), {}),
        (r"qweight: shape \(40, 8\), 16 input columns .* multiple of 32",
         (x[:, :16], q[:, :8].contiguous(), s[:1], z[:1], 4, 16), {}),
        (r"group_size=48; allowed: K=64", (x, q, s, z, 4, 48), {}),
        (r"group_size=16; allowed: .*>= 32", (x, q, s, z, 4, 16), {}),
        (r"scales: .* shape \(40, 2\).*expected a contiguous \(2, 40\).*repack_for_kernels",
         (x, q, qw.scales, z, 4, 32), {}),
        (r"scales: None; expected a \(2, 40\) tensor", (x, q, None, z, 4, 32), {}),
        (r"zeros: torch\.float16 of shape \(2, 39\)", (x, q, s, z[:, :39], 4, 32), {}),
        (r"zeros: torch\.bfloat16; expected the scales' torch\.float16",
         (x, q, s, z.bfloat16(), 4, 32), {}),
        (r"x: shape \(2, 63\); expected 64 columns", (x[:, :63], q, s, z, 4, 32), {}),
        (r"x: shape \(2, 64\); expected 128 columns \(2K, gate and up",
         (x, q, s, z, 4, 32), {"gated": True}),
        (r"x: torch\.float32 of shape", (x.float(), q, s, z, 4, 32), {}),
        (r"x: torch\.bfloat16 on cpu; expected the scales' torch\.float16",
         (x.bfloat16(), q, s, z, 4, 32), {}),
        (r"x: torch\.float16 of shape \(2, 2, 64\); expected a 2-D",
         (x[None].expand(2, 2, 64), q, s, z, 4, 32), {}),
        (r"x: last-dimension stride 2", (torch.randn(2, 128).half()[:, ::2], q, s, z, 4, 32), {}),
        (r"bias: torch\.float16 of shape \(39,\)", (x, q, s, z, 4, 32),
         {"bias": torch.zeros(39).half()}),
        (r"bias: torch\.float32 of shape \(40,\)", (x, q, s, z, 4, 32),
         {"bias": torch.zeros(40)}),
        (r"x: shape \(2, 64\); the FMA path takes exactly one row", (x, q, s, z, 4, 32),
         {"config": FMA_CONFIG}),
    ]
    for message, args, kwargs in cases:
        with pytest.raises(ValueError, match=message):
            quant_matmul(*args, **kwargs)
    for bad, message in (
            (lambda: FmaConfig(24, 64, 2, 2), "block_n=24; must be a power of two"),
            (lambda: FmaConfig(16, 16, 2, 2), "block_k=16, num_stages=2; need block_k >= 32"),
            (lambda: DotConfig(8, 16, 64, 1, 2), "block_m=8, block_n=16, block_k=64"),
            (lambda: DotConfig(16, 16, 64, 1, 0), "num_stages=0"),
            (lambda: DotConfig(16, 16, 64, 1, 2, preload=3), "preload=3; allowed: 1, 2"),
            (lambda: DequantConfig(16, 16, 2), "block_k=16; must be >= 32"),
            (lambda: qm.repack_for_kernels(q, s, z, 4, 32), r"scales: .* packing\.py's layout")):
        with pytest.raises(ValueError, match=message):
            bad()
