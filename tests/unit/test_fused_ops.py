"""The fused small-op Triton kernels (RMSNorm with and without the residual
add, SiluAndMul, rotary) on CPU under ``TRITON_INTERPRET=1``, against the
layers' torch code, on ragged shapes: hidden sizes that are not powers of
two, strided rows, per-head norm on views of a packed qkv, 1 to 8 heads,
partial rotary, random positions up to ``max_position - 1``. Fresh outputs
are allocated NaN-poisoned (``torch.empty`` is patched), and the columns
around the rotated q/k views are NaN, so an unwritten output or a write
outside the views shows. The fused rope + KV write (``rope_store_kv``) must
leave q and the paged cache (NaN in every slot no request owns) bit-equal to
``apply_rotary`` then ``store_kv``, k, v and the NaN columns untouched, on
GQA / MQA / MHA, head_dim 16, 24 and 64, partial rotary, a cache dtype other
than q's, padding rows (slot -1) at any position and a real token at an
out-of-range one; and match the torch layer then ``write_kv``, and, through
the Triton backend, the torch reference backend. Then the skinny GEMM
(``Linear`` / ``LMHead`` with ``use_triton``) against ``F.linear`` in
float32 rounded once, on sizes that no block size divides, and which inputs
its switch sends to it (up to 16 rows; a gated input at one row).
Then whole tiny models: hidden states and logits of a 10-token step and a
one-row decode with ``set_triton_ops`` on and off, in float32 (the linears
keep ``F.linear``) and float16 (both steps' take the kernel); and,
over the Triton backend, rope fused into the KV write bit-equal to rotating
first.

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

import functools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.triton_interpreter import require_interpreter

require_interpreter("tests/gpu/test_fused_ops_gpu.py")

from kvserve.attention import triton_backend
from kvserve.attention.backend import FusedRope, get_attention_backend
from kvserve.attention.torch_ref import write_kv
from kvserve.config import ModelConfig
from kvserve.kernels import paged_attention, rotary, skinny_gemm
from kvserve.kernels.activation import silu_and_mul
from kvserve.kernels.rms_norm import add_rms_norm, rms_norm
from kvserve.kernels.rope_store_kv import rope_store_kv
from kvserve.kernels.rotary import apply_rotary
from kvserve.kernels.skinny_gemm import (
    SkinnyConfig,
    default_config,
    skinny_matmul,
)
from kvserve.kernels.store_kv import store_kv
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
from tests.attention_cases import make_case
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


# a mixed step for the fused rope + KV write: a fresh prefill, a decode, a chunk
# over a cached prefix, a one-token prefill, a chunk crossing several blocks
ROPE_Q, ROPE_S = [5, 1, 7, 1, 10], [5, 9, 30, 1, 37]
ROPE_MAX_POSITION = 64
# CUDA-graph padding rows: slot -1, positions in range and out of it
PAD_POSITIONS = [7, -1, 10**6]


@dataclass
class RopeStep:
    """One step's rotary module, positions, slots, packed qkv (and its views) and cache."""

    rope: RotaryEmbedding
    positions: torch.Tensor  # [num_tokens] int64
    slots: torch.Tensor  # [num_tokens] int64
    qkv: torch.Tensor  # [num_tokens, q | k | v | NaN pad]
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], a view of qkv
    k: torch.Tensor  # [num_tokens, num_kv_heads * head_dim], a view of qkv
    v: torch.Tensor  # [num_tokens, num_kv_heads * head_dim], a view of qkv
    kv_cache: torch.Tensor  # NaN in every slot no request owns


def rope_step(num_heads: int, num_kv_heads: int, head_dim: int, partial: float,
              dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
              padded: bool = True) -> RopeStep:
    """With ``padded``, one real token sits at ``max_position`` (left unrotated) and
    the padding rows of ``PAD_POSITIONS`` follow the real ones."""
    rope = RotaryEmbedding(head_dim, ROPE_MAX_POSITION,
                           {"rope_theta": 10000.0, "partial_rotary_factor": partial})
    case = make_case(ROPE_Q, ROPE_S, num_heads, num_kv_heads, head_dim, 4,
                     cache_dtype or dtype)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(ROPE_Q, ROPE_S, strict=True)])
    slots = case.metadata.slot_mapping
    if padded:
        positions[3] = ROPE_MAX_POSITION
        positions = torch.cat([positions, torch.tensor(PAD_POSITIONS)])
        slots = torch.cat([slots, torch.full((len(PAD_POSITIONS),), -1)])
    num_tokens = len(positions)
    qkv, (q, k, v) = packed_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype,
                                seed=num_heads * head_dim)
    return RopeStep(rope, positions, slots, qkv, q.view(num_tokens, num_heads, head_dim), k, v,
                    case.kv_cache)


def fused_rope_store(step: RopeStep) -> None:
    rope_store_kv(step.q, step.k, step.v, step.kv_cache, step.slots, step.positions,
                  step.rope.cos_sin_cache, step.rope.rotary_dim)


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal bit for bit, NaNs (the poison) included."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    as_int = {2: torch.int16, 4: torch.int32}[out.element_size()]
    assert torch.equal(out.view(as_int), ref.view(as_int))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (6, 2), (3, 3)])
@pytest.mark.parametrize("head_dim,partial", [(16, 1.0), (64, 0.5), (24, 0.5)])
def test_rope_store_kv_equals_rotary_then_store_kv(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, partial: float
) -> None:
    step = rope_step(num_heads, num_kv_heads, head_dim, partial, dtype)
    num_tokens, q_size = step.qkv.shape[0], num_heads * head_dim
    # the pair it replaces, on copies: rotate q and k in place, then write k and v
    pair_qkv, pair_cache = step.qkv.clone(), step.kv_cache.clone()
    pair_q, pair_k, pair_v = (pair_qkv[:, start : start + size].view(num_tokens, -1, head_dim)
                              for start, size in ((0, q_size), (q_size, step.k.shape[1]),
                                                  (q_size + step.k.shape[1], step.v.shape[1])))
    apply_rotary(step.positions, pair_q, pair_k, step.rope.cos_sin_cache, head_dim,
                 step.rope.rotary_dim)
    store_kv(pair_k, pair_v, pair_cache, step.slots)
    qkv_before = step.qkv.clone()
    fused_rope_store(step)
    assert_same_bits(step.q, pair_q)
    assert_same_bits(step.kv_cache, pair_cache)
    # k (only read), v and the NaN columns after them are untouched
    assert_same_bits(step.qkv[:, q_size:], qkv_before[:, q_size:])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim,partial", [(16, 1.0), (24, 0.5)])
def test_rope_store_kv_matches_torch_reference(dtype: torch.dtype, head_dim: int,
                                               partial: float) -> None:
    step = rope_step(4, 2, head_dim, partial, dtype, padded=False)
    set_triton_ops(step.rope, False)
    # the oracle of "float32 math, one rounding": the layer on upcast inputs, then write_kv
    ref_q, ref_k = (t.to(dtype) for t in step.rope(step.positions, step.q.float(),
                                                   step.k.float()))
    ref_cache = step.kv_cache.clone()
    write_kv(ref_k.view(-1, 2, head_dim), step.v.reshape(-1, 2, head_dim), ref_cache, step.slots)
    fused_rope_store(step)
    assert_matches(step.q, ref_q)
    written = ref_cache.view(2, -1, 2, head_dim)[:, step.slots]
    assert_matches(step.kv_cache.view(2, -1, 2, head_dim)[:, step.slots], written)
    assert torch.equal(step.kv_cache.isnan(), ref_cache.isnan())  # nothing else written


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float16, torch.bfloat16)],
                         ids=["fp32-fp16", "bf16-fp32", "fp16-bf16"])
def test_rope_store_kv_casts_to_the_cache_dtype(dtype: torch.dtype,
                                                cache_dtype: torch.dtype) -> None:
    step = rope_step(4, 2, 16, 1.0, dtype, cache_dtype)
    pair_q, pair_k, pair_cache = step.q.clone(), step.k.clone(), step.kv_cache.clone()
    apply_rotary(step.positions, pair_q, pair_k, step.rope.cos_sin_cache, 16, 16)
    store_kv(pair_k.view(-1, 2, 16), step.v.view(-1, 2, 16), pair_cache, step.slots)
    fused_rope_store(step)
    assert_same_bits(step.q, pair_q)
    assert_same_bits(step.kv_cache, pair_cache)


def test_rope_store_kv_with_no_tokens() -> None:
    step = rope_step(4, 2, 16, 1.0, torch.float16)
    cache = step.kv_cache.clone()
    rope_store_kv(step.q[:0], step.k[:0], step.v[:0], step.kv_cache, step.slots[:0],
                  step.positions[:0], step.rope.cos_sin_cache, 16)
    assert_same_bits(step.kv_cache, cache)


def test_rope_store_kv_rejects_bad_inputs() -> None:
    step = rope_step(4, 2, 16, 1.0, torch.float16)
    kwargs: dict[str, Any] = dict(q=step.q, k=step.k, v=step.v, kv_cache=step.kv_cache,
                                  slot_mapping=step.slots, positions=step.positions,
                                  cos_sin_cache=step.rope.cos_sin_cache, rotary_dim=16)

    def call(**override: Any) -> None:
        rope_store_kv(**{**kwargs, **override})

    with pytest.raises(ValueError, match="kv_cache: shape"):
        call(kv_cache=step.kv_cache[0])
    with pytest.raises(ValueError, match="rotary_dim=18; must be even and in"):
        call(rotary_dim=18)
    with pytest.raises(ValueError, match=r"positions: torch\.int16"):
        call(positions=step.positions.short())
    with pytest.raises(ValueError, match=r"cos_sin_cache: torch\.float16"):
        call(cos_sin_cache=step.rope.cos_sin_cache.half())
    with pytest.raises(ValueError, match=r"q: shape \(27, 4, 8\)"):
        call(q=step.q[..., :8])
    with pytest.raises(ValueError, match="q: last-dimension stride 2"):
        call(q=step.q.repeat_interleave(2, dim=-1)[..., ::2])
    with pytest.raises(ValueError, match="q: 3 heads; must be a multiple of"):
        call(q=step.q[:, :3])
    with pytest.raises(ValueError, match="k: 1 heads; expected kv_cache's num_kv_heads=2"):
        call(k=step.k[:, :16])
    with pytest.raises(ValueError, match=r"v: dtype torch\.float32; expected q's torch\.float16"):
        call(v=step.v.float())
    with pytest.raises(ValueError, match=r"slot_mapping: torch\.int32"):
        call(slot_mapping=step.slots.int())
    with pytest.raises(ValueError, match=r"slot_mapping: torch\.int64 of shape \(26,\)"):
        call(slot_mapping=step.slots[1:])
    with pytest.raises(ValueError, match="positions: on meta"):
        call(positions=step.positions.to("meta"))


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [3, 20, 41]), (ROPE_Q, ROPE_S)],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("partial", [0.5, 1.0], ids=["partial", "full"])
def test_triton_backend_fuses_rope(query_lens: list[int], seq_lens: list[int],
                                   dtype: torch.dtype, partial: float) -> None:
    """The backend given ``rope``: the same output and cache, bit for bit, as
    rotating first; close to the torch reference backend after the layer's rope.
    A decode step with full rotary takes the decode kernel's own KV write."""
    case = make_case(query_lens, seq_lens, 4, 2, 16, 4, dtype)
    positions = torch.cat([torch.arange(s - q, s)
                           for q, s in zip(query_lens, seq_lens, strict=True)])
    rope = RotaryEmbedding(16, ROPE_MAX_POSITION, {"partial_rotary_factor": partial})
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    assert triton_backend.fuses_rope and not torch_backend.fuses_rope
    args = (case.metadata, 0.25, 8)
    fused_cache, pair_cache, ref_cache = (case.kv_cache.clone() for _ in range(3))
    fused_q, pair_q, pair_k = case.q.clone(), case.q.clone(), case.k.clone()
    rope_args = FusedRope(positions, rope.cos_sin_cache, rope.rotary_dim)
    fused = triton_backend.forward(fused_q, case.k, case.v, fused_cache, *args, rope_args)
    apply_rotary(positions, pair_q, pair_k, rope.cos_sin_cache, 16, rope.rotary_dim)
    pair = triton_backend.forward(pair_q, pair_k, case.v, pair_cache, *args)
    assert_same_bits(fused, pair)
    assert_same_bits(fused_cache, pair_cache)
    ref_q, ref_k = rope(positions, case.q, case.k)  # the torch reference path
    ref = torch_backend.forward(ref_q, ref_k, case.v, ref_cache, *args)
    error = ((fused.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"
    with pytest.raises(ValueError, match="rope: the torch backend does not fuse"):
        torch_backend.forward(case.q, case.k, case.v, ref_cache, *args, rope_args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize("num_splits,window", [(1, None), (4, None), (8, 20)])
def test_decode_attention_writes_new_kv_like_rope_store_kv(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, num_splits: int, window: int | None
) -> None:
    """``decode_attention(new_kv=...)``: the output and cache of ``rope_store_kv``
    then ``decode_attention``, bit for bit, over one split and several (the last
    one writes the token, earlier ones read only older positions), with a
    padding row; q is left unrotated."""
    query_lens, seq_lens = [1, 1, 0, 1, 1], [1, 9, 8, 40, 130]
    case = make_case(query_lens, seq_lens, num_heads, num_kv_heads, 16, 4, dtype)
    md = case.metadata
    positions = torch.tensor([s - 1 for q, s in zip(query_lens, seq_lens, strict=True) if q])
    rope = RotaryEmbedding(16, 256, {"rope_theta": 10000.0})
    attend = functools.partial(paged_attention.decode_attention,
                               query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                               block_table=md.block_table, max_seq_len=md.max_seq_len,
                               scale=0.25, sliding_window=window, num_splits=num_splits,
                               min_split_tokens=4)
    pair_q, pair_cache = case.q.clone(), case.kv_cache.clone()
    rope_store_kv(pair_q, case.k, case.v, pair_cache, md.slot_mapping, positions,
                  rope.cos_sin_cache, 16)
    pair = attend(pair_q, pair_cache)
    fused_q, fused_cache = case.q.clone(), case.kv_cache.clone()
    fused = attend(fused_q, fused_cache, new_kv=paged_attention.NewKV(
        case.k, case.v, md.slot_mapping, rope.cos_sin_cache))
    assert_same_bits(fused, pair)
    assert_same_bits(fused_cache, pair_cache)
    assert_same_bits(fused_q, case.q)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_new_kv_with_a_negative_slot(num_splits: int) -> None:
    """A decode row whose slot is negative (CUDA-graph padding) writes nothing
    and attends over the cache as it is, as ``rope_store_kv`` then
    ``decode_attention`` would, bit for bit; the other rows are unaffected."""
    query_lens, seq_lens = [1, 1, 1], [9, 40, 130]
    case = make_case(query_lens, seq_lens, 8, 2, 16, 4, torch.bfloat16)
    md = case.metadata
    slots = md.slot_mapping.clone()
    slots[1] = -1
    positions = torch.tensor([s - 1 for s in seq_lens])
    rope = RotaryEmbedding(16, 256, {"rope_theta": 10000.0})
    attend = functools.partial(paged_attention.decode_attention,
                               query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                               block_table=md.block_table, max_seq_len=md.max_seq_len,
                               scale=0.25, num_splits=num_splits, min_split_tokens=4)
    pair_q, pair_cache = case.q.clone(), case.kv_cache.clone()
    rope_store_kv(pair_q, case.k, case.v, pair_cache, slots, positions, rope.cos_sin_cache, 16)
    pair = attend(pair_q, pair_cache)
    fused_cache = case.kv_cache.clone()
    fused = attend(case.q.clone(), fused_cache, new_kv=paged_attention.NewKV(
        case.k, case.v, slots, rope.cos_sin_cache))
    assert_same_bits(fused, pair)
    assert_same_bits(fused_cache, pair_cache)
    block_size = case.kv_cache.shape[2]
    skipped = int(md.slot_mapping[1])  # where row 1's token would have gone
    untouched = case.kv_cache[:, skipped // block_size, skipped % block_size]
    assert_same_bits(fused_cache[:, skipped // block_size, skipped % block_size], untouched)
    written = int(md.slot_mapping[2])
    assert not torch.equal(fused_cache[:, written // block_size, written % block_size],
                           case.kv_cache[:, written // block_size, written % block_size])


def test_decode_attention_new_kv_needs_full_rotary() -> None:
    case = make_case([1], [5], 4, 2, 16, 4, torch.float16)
    md = case.metadata
    partial = RotaryEmbedding(16, 64, {"partial_rotary_factor": 0.5})
    assert not paged_attention.fuses_new_kv(16, partial.rotary_dim)
    assert not paged_attention.fuses_new_kv(24, 24) and paged_attention.fuses_new_kv(16, 16)
    with pytest.raises(ValueError, match=r"new_kv\.cos_sin_cache: shape \(64, 8\)"):
        paged_attention.decode_attention(
            case.q, case.kv_cache, md.query_start_loc, md.seq_lens, md.block_table, 5, 0.25,
            new_kv=paged_attention.NewKV(case.k, case.v, md.slot_mapping, partial.cos_sin_cache))
    full = RotaryEmbedding(16, 64, {})
    with pytest.raises(ValueError, match=r"slot_mapping: torch\.int32"):
        paged_attention.decode_attention(
            case.q, case.kv_cache, md.query_start_loc, md.seq_lens, md.block_table, 5, 0.25,
            new_kv=paged_attention.NewKV(case.k, case.v, md.slot_mapping.int(),
                                         full.cos_sin_cache))


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


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("config_name", ["default", "fma", "fma-even-k", "dot"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gated_skinny_matmul_equals_silu_and_mul_then_matmul(config_name: str,
                                                             dtype: torch.dtype,
                                                             rows: int) -> None:
    config = SKINNY_CONFIGS[config_name]
    gate_up = randn(rows, 2 * SKINNY_K, dtype=dtype, seed=20, scale=2.0)
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
    # the one-row input, fused (and its reference); three rows unfused: the SiLU
    # kernel, then the many-row GEMM (twice, the reference too)
    assert calls == [1, 1, 3, 3]
    set_triton_ops(down, False)
    gate_up = randn(1, 2 * SKINNY_K, dtype=torch.float16, seed=30)
    assert torch.equal(down.forward_gated(gate_up, act), down(act(gate_up)))
    assert calls == [1, 1, 3, 3]


def test_skinny_default_config_fills_the_card() -> None:
    # Llama-3-8B's projections: a program for every SM at least, K chunks that divide K
    for m in (1, 2, 16):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            config = default_config(m, n, k)
            assert config.use_dot == (m > 1)
            if m == 1:  # the measured one-row configs: thin programs but for down and the head
                thin = k <= 4096 and n <= 28672
                assert (config.block_n, config.block_k, config.num_warps) == (
                    (4, 1024, 2) if thin else (8, 512, 4))
            elif n <= 32768:  # the measured many-row config: a six-stage pipeline of thin tiles
                assert (config.block_n, config.block_k, config.num_warps, config.num_stages) == (
                    16, 128, 2, 6)
            else:  # the head keeps the wider tiles, one warp a program
                assert (config.block_n, config.block_k, config.num_warps, config.num_stages) == (
                    16, 256, 1, 4)
            assert -(-n // config.block_n) >= 132
            assert k % config.block_k == 0
    assert default_config(1, 40, 80).block_k == 128  # never much wider than K
    assert default_config(5, 40, 80).block_k == 128


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
    assert calls == [1, 2]
    # F.linear for everything else: more than 16 rows, 3-D, float32, the switch off
    linear(randn(17, SKINNY_K, dtype=torch.float16, seed=6))
    linear(randn(1, 3, SKINNY_K, dtype=torch.float16, seed=7))
    linear.float()(randn(1, SKINNY_K, dtype=torch.float32, seed=8))
    set_triton_ops(linear, False)
    linear.half()(randn(1, SKINNY_K, dtype=torch.float16, seed=9))
    assert calls == [1, 2]


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
    lora.load_slot(1, lora.pack({"q_proj": (randn(4, hidden, dtype=dtype, seed=12, scale=0.1),
                                            randn(32, 4, dtype=dtype, seed=13, scale=0.1))}))
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


def model_steps(model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype,
                backend: str) -> list[torch.Tensor]:
    """Hidden states and logits of two forwards on fresh zero caches: a 9-token
    prefill and a decode at position 20 in one flattened batch, then that decode
    alone (10 rows, then one: the linears' skinny GEMM); then the caches."""
    steps = [make_attention_metadata([9, 1], [9, 21], [[3, 1, 7], [2, 5, 4, 6, 9, 8]],
                                     block_size=4),
             make_attention_metadata([1], [21], [[2, 5, 4, 6, 9, 8]], block_size=4)]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (10,), generator=generator)
    caches = [torch.zeros(2, 10, 4, config.num_kv_heads, config.head_dim, dtype=dtype)
              for _ in range(config.num_layers)]
    bind_kv_cache(model, caches, get_attention_backend(backend))
    outputs = []
    with torch.inference_mode():
        for metadata, positions in steps:
            hidden = model(input_ids[:len(positions)], positions, metadata)
            outputs += [hidden.float(), model.compute_logits(hidden)]
    return [*outputs, *caches]


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
    outputs: dict[bool, list[torch.Tensor]] = {}
    for enabled in (False, True):
        assert set_triton_ops(model, enabled) == expected_count
        outputs[enabled] = model_steps(model, config, dtype, "torch")[:4]
    # both steps (10 rows, then one): every linear and the head take the skinny
    # GEMM in 16 bits
    num_linears = 4 * config.num_layers + 1
    assert calls == ([10] * num_linears + [1] * num_linears if dtype == torch.float16 else [])
    for out, ref in zip(outputs[True], outputs[False], strict=True):
        error = ((out - ref).norm() / ref.norm()).item()
        assert error < max_error, f"relative error {error:.2e}"


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
                calls: dict[str, int]) -> None:
    """Patch ``module.name`` to count its calls in ``calls[name]``."""
    original = getattr(module, name)
    calls[name] = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_model_fuses_rope_into_the_kv_write(
    tiny_checkpoint: Callable[[str], Path], variant: str, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the Triton backend and the Triton ops on, every layer rotates q and k
    inside the backend: ``rope_store_kv`` in the mixed step, the decode kernel
    itself (``new_kv``) in the decode step; hidden states, logits and caches are
    bit-equal to rotating first (``apply_rotary``, then ``store_kv``). With the
    ops off the layer's torch rope runs first, and the backend's ``store_kv``."""
    calls: dict[str, int] = {}
    count_calls(monkeypatch, triton_backend, "rope_store_kv", calls)
    count_calls(monkeypatch, triton_backend, "store_kv", calls)
    count_calls(monkeypatch, rotary, "apply_rotary", calls)
    decode_writes: list[bool] = []  # per decode_attention call: given new_kv?
    decode_attention = triton_backend.decode_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        decode_writes.append(kwargs.get("new_kv") is not None)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", recording)
    config, model_path = resolve_model_config(str(tiny_checkpoint(variant)))
    model = load_model(config, model_path, "auto", dtype, torch.device("cpu"))
    layers = config.num_layers  # launches per kernel and step
    set_triton_ops(model, True)
    fused = model_steps(model, config, dtype, "triton")
    assert calls == {"rope_store_kv": layers, "store_kv": 0, "apply_rotary": 0}
    assert decode_writes == [False] * layers + [True] * layers
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "fuses_rope", False)
    rotated_first = model_steps(model, config, dtype, "triton")
    assert calls == {"rope_store_kv": layers, "store_kv": 2 * layers,
                     "apply_rotary": 2 * layers}
    for out, ref in zip(fused, rotated_first, strict=True):
        assert_same_bits(out, ref)
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "fuses_rope", True)
    set_triton_ops(model, False)
    torch_rope = model_steps(model, config, dtype, "triton")
    assert calls == {"rope_store_kv": layers, "store_kv": 4 * layers,
                     "apply_rotary": 2 * layers}
    for out, ref in zip(fused[:4], torch_rope[:4], strict=True):  # other ops differ too
        error = ((out - ref).norm() / ref.norm()).item()
        assert error < (1e-4 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


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
        # attention with rope over the torch backend: the layer rotates, in torch
        "from kvserve.attention.backend import get_attention_backend\n"
        "from kvserve.layers.attention import Attention, bind_kv_cache\n"
        "from kvserve.layers.rotary import RotaryEmbedding\n"
        "from tests.conftest import make_attention_metadata\n"
        "attn = Attention(2, 1, 8, 1.0)\n"
        "bind_kv_cache(attn, [torch.zeros(2, 2, 4, 1, 8)], get_attention_backend('torch'))\n"
        "metadata, positions = make_attention_metadata([3], [3], [[1]], 4)\n"
        "attn(torch.ones(3, 16), torch.ones(3, 8), torch.ones(3, 8), metadata, positions,\n"
        "     RotaryEmbedding(8, 16, {}))\n"
        "try:\n"
        "    set_triton_ops(norm, True)\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2], timeout=120, check=False)
    assert result.stdout.strip() == "ok", result.stderr
