"""The fused rope + KV write kernel ``rope_store_kv``: one launch per layer that
rotates q IN PLACE by its tokens' positions and writes the rotated k, and v,
into the paged cache at the slot mapping, cast to the cache dtype.

It replaces ``apply_rotary`` (``rotary.py``) followed by ``store_kv``
(``store_kv.py``) in the Triton attention backend, and leaves q and the cache
bit for bit as that pair does: the same ``rotate_pair`` in float32, each
output rounded once to q/k's dtype, k then cast to the cache dtype. k itself
is only read (what attention reads next is the cache), which saves writing
it back. A position outside ``[0, max_position)`` leaves its token
unrotated; a negative slot (CUDA-graph padding) writes nothing to the cache,
yet its q is still rotated, as the pair would.

Grid ``(num_tokens, num_kv_heads)``: a program rotates the GQA group of
query heads that share its KV head and writes that head's k and v. At
decode a token's work then spreads over ``num_kv_heads`` programs (SMs)
instead of one, and a program's heads are exactly its group, so nothing is
masked but the padding of the group to a power of two; each program re-reads
its position's cos/sin row (``rotary_dim`` floats, from cache). Nothing is
read back to the host.

With programmatic dependent launch (``kernels/pdl.py``, Hopper) a program
reads its position, slot and cos/sin row (the step's inputs and a
constant), then waits for the kernel that writes q, k and v and lets the
next kernel start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.kv_quant import (
    KV_FP8,
    KV_INT8,
    abs_max,
    check_kv_scales,
    int8_scale,
    kv_quant_mode,
    scale_index,
    scale_pointers,
    store_kv_row,
    to_cache,
)
from kvserve.kernels.pdl import use_pdl
from kvserve.kernels.rotary import check_rotary_inputs, heads_view, rotate_heads, rotate_pair
from kvserve.kernels.store_kv import check_kv_cache


@triton.jit
def rope_store_kv_kernel(
    positions_ptr,  # [num_tokens] int32 or int64
    slot_mapping_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], read only
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # float32 kv_scales[0] (kv_quant.py), read only when quantised
    v_scale_ptr,  # float32 kv_scales[1]
    cos_sin_ptr,  # [max_position, 2 * HALF] float32: cos | sin
    max_position,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_slot,
    stride_cos_sin_pos,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,  # covers the head_dim - rotary_dim unrotated dims (at least 1)
    KV_QUANT: tl.constexpr,  # kv_quant.KV_NONE, KV_FP8 or KV_INT8
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (kernels/pdl.py)
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    rotate = (pos >= 0) & (pos < max_position)
    dims = tl.arange(0, HALF_PAD)
    half_mask = dims < HALF
    # an out-of-range position reads row 0, which nothing then uses
    cos_sin_row = cos_sin_ptr + tl.where(rotate, pos, 0) * stride_cos_sin_pos
    cos = tl.load(cos_sin_row + dims, mask=half_mask, other=0.0)
    sin = tl.load(cos_sin_row + HALF + dims, mask=half_mask, other=0.0)
    if PDL:  # q, k and v are the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    if rotate:
        rotate_heads(q_ptr + token * stride_q_token + kv_head * GROUP * stride_q_head,
                     stride_q_head, cos[None, :], sin[None, :], GROUP, GROUP_PAD, HALF, HALF_PAD)
    if slot >= 0:
        store_rotated_kv(k_ptr + token * stride_k_token + kv_head * stride_k_head,
                         v_ptr + token * stride_v_token + kv_head * stride_v_head,
                         k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, kv_head,
                         rotate, cos, sin, stride_cache_block, stride_cache_slot,
                         stride_cache_head, stride_scale_slot,
                         BLOCK_SIZE, HALF, HALF_PAD, HEAD_DIM, HEAD_DIM_PAD, TAIL_PAD, KV_QUANT)


@triton.jit
def store_rotated_kv(
    k_head,  # this token's k of one KV head: [head_dim], unit stride
    v_head,  # its v
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, kv_head, rotate, cos, sin,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_scale_slot,
    BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Write one token's k (rotated by ``cos``/``sin`` when ``rotate``) and v of one
    KV head into the cache at ``slot`` (>= 0), cast or quantised (``kv_quant.py``):
    the one KV write of a rotated key, shared with the decode attention kernel,
    which does it for a decode step."""
    cache_offset = ((slot // BLOCK_SIZE) * stride_cache_block
                    + (slot % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head)
    k_cache_head = k_cache_ptr + cache_offset
    scale_idx = scale_index(slot // BLOCK_SIZE, slot % BLOCK_SIZE, kv_head, stride_scale_slot,
                            BLOCK_SIZE, KV_QUANT)
    dims = tl.arange(0, HALF_PAD)
    half_mask = dims < HALF
    x1 = tl.load(k_head + dims, mask=half_mask)
    x2 = tl.load(k_head + HALF + dims, mask=half_mask)
    rotated1, rotated2 = rotate_pair(x1.to(tl.float32), x2.to(tl.float32), cos, sin)
    # rounded to k's dtype, then cast to (or quantised into) the cache's: as
    # rotating k in place and storing it would; an out-of-range position keeps
    # k's own bits
    key1 = tl.where(rotate, rotated1.to(k_head.dtype.element_ty), x1)
    key2 = tl.where(rotate, rotated2.to(k_head.dtype.element_ty), x2)
    tail = 2 * HALF + tl.arange(0, TAIL_PAD)  # partial rotary: copied as they are
    tail_mask = tail < HEAD_DIM
    key_tail = tl.load(k_head + tail, mask=tail_mask)
    if KV_QUANT == KV_INT8:  # the scale of the whole head vector
        k_scale = int8_scale(tl.maximum(tl.maximum(abs_max(key1, half_mask),
                                                   abs_max(key2, half_mask)),
                                        abs_max(key_tail, tail_mask)))
        tl.store(k_scale_ptr + scale_idx, k_scale)
    elif KV_QUANT == KV_FP8:
        k_scale = tl.load(k_scale_ptr + scale_idx)
    else:
        k_scale = 1.0
    tl.store(k_cache_head + dims, to_cache(key1, k_scale, k_cache_head, KV_QUANT),
             mask=half_mask)
    tl.store(k_cache_head + HALF + dims, to_cache(key2, k_scale, k_cache_head, KV_QUANT),
             mask=half_mask)
    tl.store(k_cache_head + tail, to_cache(key_tail, k_scale, k_cache_head, KV_QUANT),
             mask=tail_mask)
    head_dims = tl.arange(0, HEAD_DIM_PAD)
    head_mask = head_dims < HEAD_DIM
    value = tl.load(v_head + head_dims, mask=head_mask)
    store_kv_row(value, v_cache_ptr + cache_offset + head_dims, v_scale_ptr + scale_idx,
                 head_mask, KV_QUANT)


def rope_store_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] or [num_tokens, num_heads * head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] or [.., num_kv_heads * head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] or [.., num_kv_heads * head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    positions: torch.Tensor,  # [num_tokens] int32 or int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: cos | sin
    rotary_dim: int,
    kv_scales: torch.Tensor | None = None,  # an fp8 or int8 cache's (kv_quant.py)
) -> None:
    """Rotate ``q`` in place by ``positions`` and write ``k`` rotated, and ``v``, into
    ``kv_cache`` at ``slot_mapping`` (quantised into an fp8 or int8 cache, an
    int8 cache's scales written into ``kv_scales``); ``k`` is left as it was.

    q, k and v need only a unit last stride (views of a packed qkv tensor do).
    """
    check_kv_cache(kv_cache)
    check_kv_scales(kv_cache, kv_scales)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_rotary_inputs(positions, cos_sin_cache, head_dim, rotary_dim)
    num_tokens = positions.shape[0]
    q3, k3, v3 = check_new_kv(q, k, v, kv_cache, slot_mapping, num_tokens)
    for name, tensor in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if tensor.device != kv_cache.device:
            raise ValueError(
                f"{name}: on {tensor.device}; expected {kv_cache.device} (kv_cache's device)"
            )
    if num_tokens == 0:
        return
    group = q3.shape[1] // num_kv_heads
    half = rotary_dim // 2
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scales, v_scales, stride_scale_slot = scale_pointers(kv_cache, kv_scales)
    pdl = use_pdl(kv_cache.device)
    rope_store_kv_kernel[(num_tokens, num_kv_heads)](
        positions, slot_mapping, q3, k3, v3, k_cache, v_cache, k_scales, v_scales,
        cos_sin_cache, cos_sin_cache.shape[0],
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_scale_slot,
        cos_sin_cache.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        TAIL_PAD=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        KV_QUANT=kv_quant_mode(kv_cache.dtype),
        PDL=pdl,
        launch_pdl=pdl,
    )


def check_new_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as ``[num_tokens, heads, head_dim]`` views, after checking them and
    ``slot_mapping`` against a checked ``kv_cache``: the inputs of a rotated KV
    write (here, or in the decode attention kernel)."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    q3 = heads_view("q", q, num_tokens, head_dim)
    k3 = heads_view("k", k, num_tokens, head_dim)
    v3 = heads_view("v", v, num_tokens, head_dim)
    for name, tensor in (("k", k3), ("v", v3)):
        if tensor.shape[1] != num_kv_heads:
            raise ValueError(
                f"{name}: {tensor.shape[1]} heads; expected kv_cache's num_kv_heads={num_kv_heads}"
            )
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {tensor.dtype}; expected q's {q.dtype}")
    if q3.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q: {q3.shape[1]} heads; must be a multiple of kv_cache's "
            f"num_kv_heads={num_kv_heads}"
        )
    if (slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,)
            or not slot_mapping.is_contiguous()):
        raise ValueError(
            f"slot_mapping: {slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}; expected "
            f"a contiguous [num_tokens={num_tokens}] int64 tensor"
        )
    for name, tensor in (("q", q), ("k", k), ("v", v), ("slot_mapping", slot_mapping)):
        if tensor.device != kv_cache.device:
            raise ValueError(
                f"{name}: on {tensor.device}; expected {kv_cache.device} (kv_cache's device)"
            )
    return q3, k3, v3
