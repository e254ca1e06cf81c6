"""The fused small-op Triton kernels (RMSNorm with and without the residual
add, SiluAndMul, rotary) on CPU under ``TRITON_INTERPRET=1``, against the
layers' torch code, on ragged shapes: hidden sizes that are not powers of
two, strided rows, per-head norm on views of a packed qkv, 1 to 8 heads,
partial rotary, random positions up to ``max_position - 1``. Fresh outputs
are allocated NaN-poisoned (``torch.empty`` is patched), and the columns
around the rotated q/k views are NaN, so an unwritten output or a write
outside the views shows. Then the skinny GEMM (``Linear`` / ``LMHead`` with
``use_triton``) against ``F.linear`` in float32 rounded once, on sizes that
no block size divides, and which inputs its switch sends to it (one row).
Then whole tiny models: hidden states and logits of a 10-token step and a
one-row decode with ``set_triton_ops`` on and off, in float32 (the linears
keep ``F.linear``) and float16 (the one-row step's take the kernel).

Tolerances: float32 ``1e-5``; float16 99 % of elements bit-equal (the
interpreter rounds fp16 to nearest, so this checks the rounding sequence)
and the rest at most two units in the last place (ulps): where a float32
exp or sum differs from torch's in its last bit, an intermediate rounding
(silu, normed) can flip by one ulp, which the final product turns into up
to two ulps of its own magnitude. The interpreter casts
float32 to bfloat16 by truncation (compiled kernels round to nearest even),
so bfloat16 here is held to 4 ulps only; ``tests/gpu`` checks it compiled.
The skinny GEMM sums in another order than torch, so it is held to a relative
error of 1e-2 (norm of the difference over norm of the reference); the
interpreter has no bfloat16 matmul (it multiplies the raw bits), so its
``tl.dot`` form runs in float16 only here and in bfloat16 in ``tests/gpu``.
Skipped like ``test_triton_kernels.py``: without Triton, with CUDA, or when
Triton was imported without the interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_fused_ops_gpu.py")

from kvserve.attention.backend import get_attention_backend
from kvserve.kernels import skinny_gemm
from kvserve.kernels.activation import silu_and_mul
from kvserve.kernels.rms_norm import add_rms_norm, rms_norm
from kvserve.kernels.rotary import apply_rotary
from kvserve.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_matmul
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import bind_kv_cache
from kvserve.layers.custom_ops import set_triton_ops
from kvserve.layers.embedding import LMHead
from kvserve.layers.linear import Linear, QKVLinear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.lora.layers import LoRABatch, LoRALinear
from kvserve.models.loader import load_model
from kvserve.models.source import resolve_model_config
from tests.conftest import make_attention_metadata

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# bfloat16: the interpreter truncates, and two truncated roundings, each up to
# one ulp of its intermediate, can reach four ulps of the output's magnitude
MAX_ULPS = {torch.float16: 2.0, torch.bfloat16: 4.0}


@pytest.fixture(autouse=True)
def _poison_outputs(poisoned_empty: None) -> None:
    """Every test here sees NaN-poisoned ``torch.empty`` outputs."""


def ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``|out - ref|`` in units in the last place of ``ref``'s dtype at ``ref``'s magnitude."""
    info = torch.finfo(ref.dtype)
    ref32 = ref.float()
    _, exponent = torch.frexp(ref32)
    ulp = torch.ldexp(torch.full_like(ref32, info.eps), (exponent - 1).float())
    ulp = ulp.clamp(min=info.smallest_normal * info.eps)
    return (out.float() - ref32).abs() / ulp


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    worst = ulps(out, ref).max().item()
    assert worst <= MAX_ULPS[out.dtype], f"{worst} ulps apart"
    if out.dtype == torch.float16:
        equal = (out == ref).float().mean().item()
        assert equal >= 0.99, f"only {equal:.1%} of elements bit-equal"


def make_norm(hidden: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    generator = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(hidden, generator=generator))
    return norm.to(dtype)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator)).to(dtype)


def run_both(module: torch.nn.Module, *args: torch.Tensor) -> tuple[Any, Any]:
    """The module's torch forward, then its Triton forward, on the same inputs."""
    set_triton_ops(module, False)
    ref = module(*args)
    set_triton_ops(module, True)
    return module(*args), ref


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [96, 200])
def test_rms_norm_matches_layer(dtype: torch.dtype, hidden: int) -> None:
    norm = make_norm(hidden, dtype, seed=hidden)
    # rows of a wider buffer: row stride hidden + 40
    x = randn(13, hidden + 40, dtype=dtype, seed=1, scale=3.0)[:, 17 : 17 + hidden]
    out, ref = run_both(norm, x)
    assert out.is_contiguous()
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [96, 200])
def test_add_rms_norm_matches_layer(dtype: torch.dtype, hidden: int) -> None:
    norm = make_norm(hidden, dtype, seed=hidden + 1)
    x = randn(11, 2 * hidden, dtype=dtype, seed=2)[:, hidden:]
    residual = randn(11, hidden, dtype=dtype, seed=3, scale=4.0)
    (out, summed), (ref, ref_summed) = run_both(norm, x, residual)
    # one float32 add rounded once, as torch does: bit-equal where the interpreter rounds
    if dtype == torch.bfloat16:
        assert ulps(summed, ref_summed).max().item() <= 1.0
    else:
        assert torch.equal(summed, ref_summed)
    assert_matches(out, ref)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(1, 1), (4, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_per_head_norm_on_packed_qkv_views(num_heads: int, num_kv_heads: int,
                                           head_dim: int) -> None:
    # Qwen3's q/k norm: [num_tokens, heads, head_dim] views of the packed qkv projection
    # (the rounding per dtype is covered above; this checks the strided rows)
    dtype, num_tokens = torch.float16, 7
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = randn(num_tokens, sum(sizes), dtype=dtype, seed=num_heads * head_dim, scale=2.0)
    q, k, _ = qkv.split(sizes, dim=-1)
    for flat, heads, seed in ((q, num_heads, 1), (k, num_kv_heads, 2)):
        view = flat.reshape(num_tokens, heads, head_dim)
        assert view.data_ptr() == flat.data_ptr()  # still a view, not a copy
        out, ref = run_both(make_norm(head_dim, dtype, seed), view)
        assert_matches(out, ref)


def test_rms_norm_any_leading_dims() -> None:
    norm = make_norm(40, torch.float32, seed=5)
    for shape in ((40,), (2, 3, 4, 40)):
        out, ref = run_both(norm, randn(*shape, dtype=torch.float32, seed=6))
        assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [96, 200, 1500])
def test_silu_and_mul_matches_layer(dtype: torch.dtype, d: int) -> None:
    # d = 1500 spans two column blocks of 1024; rows are strided (row stride 2d + 8)
    x = randn(9, 2 * d + 8, dtype=dtype, seed=d, scale=4.0)[:, 8:]
    out, ref = run_both(SiluAndMul(), x)
    assert out.shape == (9, d) and out.is_contiguous()
    assert_matches(out, ref)


def test_silu_and_mul_leading_dims() -> None:
    x = randn(2, 3, 2 * 24, dtype=torch.float16, seed=7, scale=4.0)
    out, ref = run_both(SiluAndMul(), x)
    assert_matches(out, ref)


def packed_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A packed ``[q | k | v | NaN pad]`` buffer and its q, k, v views."""
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.full((num_tokens, sum(sizes) + 8), float("nan"), dtype=dtype)
    qkv[:, : sum(sizes)] = randn(num_tokens, sum(sizes), dtype=dtype, seed=seed, scale=2.0)
    return qkv, list(qkv[:, : sum(sizes)].split(sizes, dim=-1))


def check_rotary(rope: RotaryEmbedding, positions: torch.Tensor, qkv: torch.Tensor,
                 q: torch.Tensor, k: torch.Tensor) -> None:
    """Rotate q and k in place with the kernel and compare with the torch layer."""
    qkv_before = qkv.clone()
    set_triton_ops(rope, False)
    # the oracle of "float32 math, one rounding": the layer on upcast inputs
    exact_q, exact_k = (t.to(q.dtype) for t in rope(positions, q.float(), k.float()))
    ref_q, ref_k = rope(positions, q, k)  # the layer in q's dtype (rounds cos/sin, products)
    q_before, k_before = q.clone(), k.clone()
    set_triton_ops(rope, True)
    out_q, out_k = rope(positions, q, k)
    assert out_q is q and out_k is k  # rotated in place
    for out, exact, ref, before in ((q, exact_q, ref_q, q_before), (k, exact_k, ref_k, k_before)):
        assert_matches(out, exact)
        bound = 4 * torch.finfo(q.dtype).eps * ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=max(bound, 1e-5))
        # pass-through dims of partial rotary keep their bits
        tail = (out.shape[0], -1, rope.head_dim)
        kept = out.reshape(tail)[..., rope.rotary_dim :]
        assert torch.equal(kept, before.reshape(tail)[..., rope.rotary_dim :])
    # v and the NaN padding after it are untouched
    v_start = q[0].numel() + k[0].numel()
    torch.testing.assert_close(qkv[:, v_start:], qkv_before[:, v_start:], rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(1, 1), (8, 1), (6, 3)])
@pytest.mark.parametrize("head_dim,partial", [(16, 1.0), (64, 0.5)])
def test_rotary_matches_layer_on_packed_views(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, partial: float
) -> None:
    max_position = 300
    rope = RotaryEmbedding(head_dim, max_position,
                           {"rope_theta": 10000.0, "partial_rotary_factor": partial})
    generator = torch.Generator().manual_seed(num_heads * head_dim)
    positions = torch.randint(0, max_position, (9,), generator=generator)
    positions[:2] = torch.tensor([0, max_position - 1])
    qkv, (q, k, _) = packed_qkv(9, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    check_rotary(rope, positions, qkv, q, k)


def test_rotary_on_per_head_shaped_inputs() -> None:
    # after Qwen3's q/k norm, rope gets [num_tokens, heads, head_dim] tensors
    rope = RotaryEmbedding(32, 64, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16})
    qkv, (q, k, _) = packed_qkv(5, 4, 2, 32, torch.float16, seed=8)
    positions = torch.tensor([3, 63, 0, 17, 17], dtype=torch.int32)
    check_rotary(rope, positions, qkv, q.view(5, 4, 32), k.view(5, 2, 32))


def test_rotary_leaves_out_of_range_positions_unrotated() -> None:
    rope = RotaryEmbedding(16, 10, {})
    _, (q, k, _) = packed_qkv(3, 2, 1, 16, torch.float32, seed=9)
    q_before, k_before = q.clone(), k.clone()
    apply_rotary(torch.tensor([-1, 10, 4]), q, k, rope.cos_sin_cache, 16, 16)
    assert torch.equal(q[:2], q_before[:2]) and torch.equal(k[:2], k_before[:2])
    assert not torch.equal(q[2], q_before[2])


# N = 40, K = 80: no block size divides N; block_k 16 divides K (no K mask), 32 and
# the default 128 do not (the last K chunk masked)
SKINNY_N, SKINNY_K = 40, 80
SKINNY_CONFIGS = {
    "default": None,
    "fma": SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=3, use_dot=False),
    "fma-even-k": SkinnyConfig(block_n=8, block_k=16, num_warps=2, num_stages=1, use_dot=False),
    "dot": SkinnyConfig(block_n=16, block_k=32, num_warps=2, num_stages=3, use_dot=True),
    "dot-even-k": SkinnyConfig(block_n=32, block_k=16, num_warps=4, num_stages=2, use_dot=True),
}


def skinny_uses_dot(config: SkinnyConfig | None, m: int) -> bool:
    return (config or default_config(m, SKINNY_N, SKINNY_K)).use_dot


def linear_ref(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` in float32 on the upcast inputs, rounded once to their dtype."""
    bias32 = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), weight.float(), bias32).to(x.dtype)


def assert_close_linear(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.parametrize("config_name", list(SKINNY_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_skinny_matmul_matches_linear(config_name: str, dtype: torch.dtype, m: int,
                                      with_bias: bool) -> None:
    config = SKINNY_CONFIGS[config_name]
    if dtype == torch.bfloat16 and skinny_uses_dot(config, m):
        pytest.skip("the interpreter has no bfloat16 tl.dot")
    # rows of a wider buffer: x's row stride is K + 24
    x = randn(m, SKINNY_K + 24, dtype=dtype, seed=m)[:, 24:]
    weight = randn(SKINNY_N, SKINNY_K, dtype=dtype, seed=2, scale=0.1)
    bias = randn(SKINNY_N, dtype=dtype, seed=3) if with_bias else None
    out = skinny_matmul(x, weight, bias, config)
    assert_close_linear(out, linear_ref(x, weight, bias))


@pytest.mark.parametrize("config_name", ["default", "fma", "fma-even-k"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gated_skinny_matmul_equals_silu_and_mul_then_matmul(config_name: str,
                                                             dtype: torch.dtype) -> None:
    config = SKINNY_CONFIGS[config_name]
    gate_up = randn(1, 2 * SKINNY_K, dtype=dtype, seed=20, scale=2.0)
    weight = randn(SKINNY_N, SKINNY_K, dtype=dtype, seed=21, scale=0.1)
    fused = skinny_matmul(gate_up, weight, None, config, gated=True)
    # the activation computed as it is loaded, with the activation kernel's rounding
    assert torch.equal(fused, skinny_matmul(silu_and_mul(gate_up), weight, None, config))
    if dtype == torch.float16:  # the interpreter truncates to bfloat16: tests/gpu checks it
        assert_close_linear(fused, linear_ref(SiluAndMul()(gate_up), weight))
    with pytest.raises(ValueError, match="2K, gate and up"):
        skinny_matmul(gate_up[:, :SKINNY_K], weight, gated=True)


def test_down_projection_fuses_the_silu_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_skinny_calls(monkeypatch)
    down = Linear(SKINNY_K, SKINNY_N).to(torch.float16)
    with torch.no_grad():
        down.weight.copy_(randn(SKINNY_N, SKINNY_K, dtype=torch.float16, seed=22, scale=0.1))
    act = SiluAndMul()
    set_triton_ops(torch.nn.ModuleList([down, act]), True)
    for m in (1, 3):
        gate_up = randn(m, 2 * SKINNY_K, dtype=torch.float16, seed=23 + m)
        assert torch.equal(down.forward_gated(gate_up, act), down(act(gate_up)))
    assert calls == [1, 1]  # the one-row input, fused; three rows keep F.linear
    set_triton_ops(down, False)
    gate_up = randn(1, 2 * SKINNY_K, dtype=torch.float16, seed=30)
    assert torch.equal(down.forward_gated(gate_up, act), down(act(gate_up)))
    assert calls == [1, 1]


def test_skinny_default_config_fills_the_card() -> None:
    # Llama-3-8B's projections: a program for every SM at least, K chunks that divide K
    for m in (1, 2, 16):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            config = default_config(m, n, k, num_sms=132)
            assert config.use_dot == (m > 1)
            if m == 1:  # the measured one-row config
                assert (config.block_n, config.block_k, config.num_warps) == (8, 512, 4)
            assert -(-n // config.block_n) >= 132
            assert k % config.block_k == 0
    assert default_config(1, 40, 80).block_k == 128  # never much wider than K


def count_skinny_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ``skinny_matmul`` to record the row count of each call."""
    calls: list[int] = []

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return skinny_matmul(x, *args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_matmul", counted)
    return calls


def test_linear_switch_sends_small_16_bit_inputs_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_skinny_calls(monkeypatch)
    linear = Linear(SKINNY_K, SKINNY_N, bias=True).to(torch.float16)
    with torch.no_grad():
        linear.weight.copy_(randn(SKINNY_N, SKINNY_K, dtype=torch.float16, seed=4, scale=0.1))
        linear.bias.copy_(randn(SKINNY_N, dtype=torch.float16, seed=5))
    assert set_triton_ops(linear, True) == 1
    for m in (1, 2):
        x = randn(m, SKINNY_K, dtype=torch.float16, seed=m)
        assert_close_linear(linear(x), linear_ref(x, linear.weight, linear.bias))
    assert calls == [1]
    # F.linear for everything else: more rows, 3-D, float32, the switch off
    linear(randn(16, SKINNY_K, dtype=torch.float16, seed=6))
    linear(randn(1, 3, SKINNY_K, dtype=torch.float16, seed=7))
    linear.float()(randn(1, SKINNY_K, dtype=torch.float32, seed=8))
    set_triton_ops(linear, False)
    linear.half()(randn(1, SKINNY_K, dtype=torch.float16, seed=9))
    assert calls == [1]


def test_packed_linears_lm_head_and_lora_take_the_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_skinny_calls(monkeypatch)
    dtype, hidden = torch.float16, 48
    qkv = QKVLinear(hidden, head_dim=8, num_heads=4, num_kv_heads=2).to(dtype)
    head = LMHead(72, hidden).to(dtype)
    for module, seed in ((qkv, 10), (head, 11)):
        with torch.no_grad():
            module.weight.copy_(randn(*module.weight.shape, dtype=dtype, seed=seed, scale=0.1))
    lora = LoRALinear(qkv, [("q_proj", 0, 32), ("k_proj", 32, 16), ("v_proj", 48, 16)],
                      max_loras=2, max_rank=4, batch=LoRABatch())
    lora.set_slot(1, {"q_proj": (randn(4, hidden, dtype=dtype, seed=12, scale=0.1),
                                 randn(32, 4, dtype=dtype, seed=13, scale=0.1))})
    lora.batch.slot_rows = [(1, torch.tensor([0]))]
    x = randn(1, hidden, dtype=dtype, seed=14)
    ref_qkv, ref_logits = lora(x), head(x)
    assert set_triton_ops(torch.nn.ModuleList([lora, head]), True) == 2
    out_qkv, out_logits = lora(x), head(x)
    assert calls == [1, 1]
    assert out_logits.dtype == torch.float32
    assert_close_linear(out_qkv, ref_qkv)
    assert_close_linear(out_logits, ref_logits)


def test_skinny_matmul_rejects_bad_inputs() -> None:
    weight = torch.ones(SKINNY_N, SKINNY_K, dtype=torch.float16)
    x = torch.ones(2, SKINNY_K, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x: torch\.bfloat16"):
        skinny_matmul(x.bfloat16(), weight)
    with pytest.raises(ValueError, match=r"weight: dtype torch\.float32"):
        skinny_matmul(x.float(), weight.float())
    with pytest.raises(ValueError, match=r"x: shape \(17, 80\).*SKINNY_MAX_M=16"):
        skinny_matmul(torch.ones(17, SKINNY_K, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match=r"x: shape \(2, 3, 80\)"):
        skinny_matmul(torch.ones(2, 3, SKINNY_K, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match=r"x: shape \(2, 79\); expected 80 columns"):
        skinny_matmul(x[:, 1:], weight)
    with pytest.raises(ValueError, match="x: last-dimension stride 2"):
        skinny_matmul(torch.ones(2, 2 * SKINNY_K, dtype=torch.float16)[:, ::2], weight)
    with pytest.raises(ValueError, match="weight: shape"):
        skinny_matmul(x, torch.ones(SKINNY_K, SKINNY_N, dtype=torch.float16).t())
    with pytest.raises(ValueError, match=r"bias: shape \(39,\)"):
        skinny_matmul(x, weight, torch.ones(SKINNY_N - 1, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"bias: torch\.float32"):
        skinny_matmul(x, weight, torch.ones(SKINNY_N))
    with pytest.raises(ValueError, match="block_n=24"):
        SkinnyConfig(block_n=24, block_k=32, num_warps=4, num_stages=3, use_dot=False)
    with pytest.raises(ValueError, match="use_dot needs both >= 16"):
        SkinnyConfig(block_n=8, block_k=32, num_warps=4, num_stages=3, use_dot=True)


def test_launchers_reject_bad_inputs() -> None:
    weight = torch.ones(16)
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="x: shape"):
        rms_norm(torch.randn(3, 15), weight, 1e-6)
    with pytest.raises(ValueError, match=r"x: torch\.float16"):
        rms_norm(x.half(), weight, 1e-6)
    with pytest.raises(ValueError, match="x: last-dimension stride 2"):
        rms_norm(torch.randn(3, 32)[:, ::2], weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(2, 8), 1e-6)
    with pytest.raises(ValueError, match="residual: shape"):
        add_rms_norm(x, torch.randn(4, 16), weight, 1e-6)
    with pytest.raises(ValueError, match="x: shape"):
        silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="x: dtype"):
        silu_and_mul(torch.ones(3, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: last-dimension stride"):
        silu_and_mul(torch.randn(8, 3).t())
    cache = RotaryEmbedding(16, 10, {}).cos_sin_cache
    q, k, positions = torch.randn(2, 32), torch.randn(2, 16), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="rotary_dim=3"):
        apply_rotary(positions, q, k, cache, 16, 3)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(positions.float(), q, k, cache, 16, 16)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(positions, q, k, cache.half(), 16, 16)
    with pytest.raises(ValueError, match="q: shape"):
        apply_rotary(positions, torch.randn(2, 30), k, cache, 16, 16)
    with pytest.raises(ValueError, match="k: shape"):
        apply_rotary(positions, q, torch.randn(3, 16), cache, 16, 16)
    with pytest.raises(ValueError, match="k: dtype"):
        apply_rotary(positions, q, k.half(), cache, 16, 16)
    with pytest.raises(ValueError, match="q: last-dimension stride"):
        apply_rotary(positions, torch.randn(2, 64)[:, ::2], k, cache, 16, 16)


@pytest.mark.parametrize("variant,expected_count", [
    # per layer: 2 norms + SiluAndMul (+ Qwen3's q/k norms) + 4 linears (qkv, o, gate_up,
    # down); the final norm, the LM head and one shared rope
    ("llama", 2 * (3 + 4) + 3),
    ("qwen3", 3 * (5 + 4) + 3),
])
@pytest.mark.parametrize("dtype,max_error", [(torch.float32, 1e-4), (torch.float16, 1e-2)],
                         ids=["fp32", "fp16"])
def test_model_hidden_states_match_with_triton_ops(
    tiny_checkpoint: Callable[[str], Path], variant: str, expected_count: int,
    dtype: torch.dtype, max_error: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_skinny_calls(monkeypatch)
    config, model_path = resolve_model_config(str(tiny_checkpoint(variant)))
    model = load_model(config, model_path, "auto", dtype, torch.device("cpu"))
    assert not any(getattr(m, "use_triton", False) for m in model.modules())  # off by default
    # a 9-token prefill and a decode at position 20 in one flattened batch, then
    # a decode alone (one row: the linears' skinny GEMM)
    steps = [make_attention_metadata([9, 1], [9, 21], [[3, 1, 7], [2, 5, 4, 6, 9, 8]],
                                     block_size=4),
             make_attention_metadata([1], [21], [[2, 5, 4, 6, 9, 8]], block_size=4)]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (10,), generator=generator)
    outputs: dict[bool, list[torch.Tensor]] = {}
    for enabled in (False, True):
        assert set_triton_ops(model, enabled) == expected_count
        caches = [torch.zeros(2, 10, 4, config.num_kv_heads, config.head_dim, dtype=dtype)
                  for _ in range(config.num_layers)]
        bind_kv_cache(model, caches, get_attention_backend("torch"))
        outputs[enabled] = []
        with torch.inference_mode():
            for metadata, positions in steps:
                hidden = model(input_ids[:len(positions)], positions, metadata)
                outputs[enabled] += [hidden.float(), model.compute_logits(hidden)]
    # the one-row step: every linear and the head take the skinny GEMM in 16 bits
    assert calls == ([1] * (4 * config.num_layers + 1) if dtype == torch.float16 else [])
    for out, ref in zip(outputs[True], outputs[False], strict=True):
        error = ((out - ref).norm() / ref.norm()).item()
        assert error < max_error, f"relative error {error:.2e}"


def test_layers_import_and_run_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now fails
        "import torch\n"
        "from kvserve.layers.custom_ops import set_triton_ops\n"
        "from kvserve.layers.linear import Linear\n"
        "from kvserve.layers.norm import RMSNorm\n"
        "norm = RMSNorm(8)\n"
        "assert set_triton_ops(norm, False) == 1\n"
        "norm(torch.ones(2, 8), torch.ones(2, 8))\n"
        "Linear(8, 4)(torch.ones(2, 8))\n"
        "try:\n"
        "    set_triton_ops(norm, True)\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2], timeout=120, check=False)
    assert result.stdout.strip() == "ok", result.stderr
