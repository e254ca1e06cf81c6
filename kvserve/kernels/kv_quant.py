"""The quantised KV cache's arithmetic, shared by the KV writes (``store_kv``,
``rope_store_kv``, the decode kernel's fused write) and the attention
kernels that read it, and the launchers' check of a cache's scales.

The cache tensor's dtype says how it is quantised (``kv_quant_mode``):

- 16-bit or float32 (``KV_NONE``): stored as the model computes it; no scales.
- ``torch.float8_e4m3fn`` (``KV_FP8``): x of KV head h is stored as
  e4m3(clamp(x / scale[h], -448, 448)), rounded to nearest even.
  ``kv_scales`` is float32 ``[2, num_kv_heads]``, K's row then V's, fixed for
  the engine's life (a checkpoint's scales, else 1.0).
- ``torch.int8`` (``KV_INT8``): every token's head vector has its own scale
  ``amax / 127``, written beside it, and its values are round(x / scale), ties
  to even, in [-127, 127]. ``kv_scales`` is float32 ``[2, num_blocks,
  block_size, num_kv_heads]``: the same block ids and slots as the cache, so
  whatever keeps a block (prefix caching, preemption, reuse) keeps its scales.

Readers convert the stored values to q's dtype in registers (exact: int8 and
e4m3 values are exact in bfloat16 and float16) and apply the scales to the
products, not to the tiles: a per-head K scale multiplies the softmax scale,
a per-head V scale the output; per-token K scales multiply the scores'
columns and per-token V scales the probabilities' columns.

Divisions are ``div_rn`` (IEEE, as torch divides; Triton's ``/`` is an
approximation on the GPU) and the e4m3 rounding is done here in float32
(``round_to_e4m3``), so the writes are bit-equal to the torch reference's
(``kvserve/attention/kv_quant.py``) on the GPU and under the interpreter,
whose own float-to-fp8 conversion rounds wrongly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_NONE = tl.constexpr(0)
KV_FP8 = tl.constexpr(1)
KV_INT8 = tl.constexpr(2)
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
INT8_MAX = tl.constexpr(127.0)  # symmetric: -128 is never written
QUANTISED_DTYPES: dict[torch.dtype, int] = {torch.float8_e4m3fn: 1, torch.int8: 2}
# 1.5 * 2**23: adding and subtracting it rounds a float32 below 2**22 to an
# integer, ties to even
_RINT_MAGIC = tl.constexpr(12582912.0)
# 2**14: adding and subtracting it rounds a float32 in [0, 2**-6) to a
# multiple of 2**-9 (e4m3's subnormal step), ties to even
_E4M3_SUBNORMAL_MAGIC = tl.constexpr(16384.0)
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6


def kv_quant_mode(dtype: torch.dtype) -> int:
    """``KV_FP8`` or ``KV_INT8`` for a quantised cache dtype, else ``KV_NONE`` (0)."""
    return QUANTISED_DTYPES.get(dtype, 0)


def check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """Raise ValueError unless ``kv_scales`` fits a checked ``kv_cache``: None for
    a 16- or 32-bit cache, float32 ``[2, num_kv_heads]`` for fp8, float32
    ``[2, num_blocks, block_size, num_kv_heads]`` for int8; contiguous, on the
    cache's device."""
    mode = kv_quant_mode(kv_cache.dtype)
    if mode == 0:
        if kv_scales is not None:
            raise ValueError(f"kv_scales: given for a {kv_cache.dtype} cache, which has none")
        return
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    shape = ((2, num_kv_heads) if mode == 1 else (2, num_blocks, block_size, num_kv_heads))
    if kv_scales is None:
        raise ValueError(f"kv_scales: missing; a {kv_cache.dtype} cache needs float32 "
                         f"scales of shape {list(shape)}")
    if (kv_scales.dtype != torch.float32 or tuple(kv_scales.shape) != shape
            or not kv_scales.is_contiguous() or kv_scales.device != kv_cache.device):
        raise ValueError(
            f"kv_scales: {kv_scales.dtype} of shape {tuple(kv_scales.shape)} on "
            f"{kv_scales.device}; a {kv_cache.dtype} cache needs contiguous float32 "
            f"{list(shape)} on {kv_cache.device}"
        )


def scale_pointers(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K scales, V scales, elements between two slots' scales) for a launch:
    the slot stride is ``num_kv_heads`` for int8 and unused otherwise; without
    scales, any float32 tensor stands for them (never read)."""
    if kv_scales is None:
        unused = torch.empty(0, dtype=torch.float32, device=kv_cache.device)
        return unused, unused, 0
    return kv_scales[0], kv_scales[1], kv_cache.shape[3]


@triton.jit
def round_to_e4m3(y):
    """``y`` (float32, ``|y| <= 448``) rounded to the nearest float8_e4m3fn value,
    ties to even, as float32: normals keep 3 of float32's 23 mantissa bits
    (a carry moves into the exponent), subnormals are multiples of 2**-9."""
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    magnitude = bits & 0x7FFFFFFF
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -1048576  # ~0xFFFFF
    a = magnitude.to(tl.float32, bitcast=True)
    subnormal = ((a + _E4M3_SUBNORMAL_MAGIC) - _E4M3_SUBNORMAL_MAGIC).to(tl.int32, bitcast=True)
    rounded = tl.where(a < _E4M3_MIN_NORMAL, subnormal, normal)
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def abs_max(x, mask):
    """The largest ``|x|`` over ``mask`` (one head vector or a piece of it), in float32."""
    return tl.max(tl.where(mask, tl.abs(x.to(tl.float32)), 0.0), 0)


@triton.jit
def int8_scale(amax):
    """The int8 scale of a head vector whose largest magnitude is ``amax``:
    ``amax / 127`` (0 for a vector of zeros)."""
    return tl.math.div_rn(amax, INT8_MAX)


@triton.jit
def to_cache(x, scale, cache_ptr, KV_QUANT: tl.constexpr):
    """``x`` as ``cache_ptr``'s cache stores it: cast, or quantised from float32 by
    ``scale`` (the head's for fp8, the vector's ``int8_scale`` for int8)."""
    if KV_QUANT == KV_NONE:
        return x.to(cache_ptr.dtype.element_ty)
    elif KV_QUANT == KV_FP8:
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        return round_to_e4m3(y).to(tl.float8e4nv)
    else:
        y = tl.math.div_rn(x.to(tl.float32), tl.where(scale > 0.0, scale, 1.0))
        y = tl.minimum(tl.maximum(y, -INT8_MAX), INT8_MAX)
        return ((y + _RINT_MAGIC) - _RINT_MAGIC).to(tl.int8)


@triton.jit
def row_scale(x, mask, scale_ptr, KV_QUANT: tl.constexpr):
    """The scale ``to_cache`` needs for the head vector ``x`` (``mask`` its real
    dims): an fp8 head's, read at ``scale_ptr``; an int8 vector's own, written
    there; unused (1.0) for a 16- or 32-bit cache."""
    if KV_QUANT == KV_FP8:
        return tl.load(scale_ptr)
    elif KV_QUANT == KV_INT8:
        scale = int8_scale(abs_max(x, mask))
        tl.store(scale_ptr, scale)
        return scale
    else:
        return 1.0


@triton.jit
def store_kv_row(x, cache_row, scale_ptr, mask, KV_QUANT: tl.constexpr):
    """Write one head vector ``x`` at ``cache_row`` (its elements' pointers in the
    cache), cast or quantised; ``scale_ptr`` is its scale's (``row_scale``)."""
    scale = row_scale(x, mask, scale_ptr, KV_QUANT)
    tl.store(cache_row, to_cache(x, scale, cache_row, KV_QUANT), mask=mask)


@triton.jit
def scale_index(block_id, slot_in_block, kv_head, stride_scale_slot, BLOCK_SIZE: tl.constexpr,
                KV_QUANT: tl.constexpr):
    """Where the scale of (block, slot in it, KV head) sits in one of
    ``kv_scales``'s halves: the slot's for int8, the head's for fp8."""
    if KV_QUANT == KV_INT8:
        return (block_id.to(tl.int64) * BLOCK_SIZE + slot_in_block) * stride_scale_slot + kv_head
    else:
        return kv_head


@triton.jit
def head_scales(k_scale_ptr, v_scale_ptr, kv_head, scale_log2, KV_QUANT: tl.constexpr):
    """(the softmax scale, base 2, times the head's fp8 K scale; the head's fp8 V
    scale, 1.0 otherwise): per-head scales apply to the products, not the tiles."""
    if KV_QUANT == KV_FP8:
        return scale_log2 * tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
    else:
        return scale_log2, 1.0


@triton.jit
def dequant_scores(q, k, k_scale, scale_log2, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr):
    """[rows, BLOCK_N] base-2 scores of q against a K tile, dequantised in
    registers: the stored values in q's dtype (exact for fp8 and int8), then
    the int8 tile's per-position scales on the columns."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if KV_QUANT == KV_INT8:
        return scores * (k_scale * scale_log2)[None, :]
    else:
        return scores * scale_log2


@triton.jit
def dequant_values(p, v, v_scale, out_dtype: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     KV_QUANT: tl.constexpr):
    """``p @ v`` for a V tile, dequantised in registers: an int8 tile's
    per-position scales multiply p's columns."""
    if KV_QUANT == KV_INT8:
        p = p * v_scale[None, :]
    return tl.dot(p.to(out_dtype), v.to(out_dtype), input_precision=DOT_PRECISION)
