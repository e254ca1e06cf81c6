"""Paged attention kernels: causal attention of each request's new tokens over
its whole context in the paged KV cache (cached prefix plus themselves).

Two kernels, each beside its launcher:

- ``prefill_attention_kernel`` handles any batch: prefills, chunked
  prefills, decodes and mixes of them. Grid ``(q_blocks, num_kv_heads)``:
  a program owns ``BLOCK_Q`` query tokens of one request times all
  ``GROUP`` query heads of one KV head, flattened into ``BLOCK_M`` rows, so
  each K/V tile is loaded once per group (GQA without repeating K/V). The
  request of a q-block is found by binary search over ``query_start_loc``,
  so the grid (``num_tokens // BLOCK_Q + num_reqs`` q-blocks, at most one
  idle per request) needs no device-to-host read. It walks K/V tiles of ``BLOCK_N`` positions,
  gathering each position's block from the block table, from the window
  start (or 0) up to the q-block's last position, with an online softmax in
  float32.
- ``decode_attention_kernel`` handles steps where every request has one new
  token (flash-decoding) in one launch. Grid ``(num_reqs, num_kv_heads,
  num_splits)``: a program owns one request's group of query heads of one KV
  head and one contiguous slice of its context. A context that fits one
  slice is written normalised, directly. Otherwise each slice's program
  writes its partial max, sum and unnormalised output, then counts itself on
  the (request, KV head)'s semaphore; the program that arrives last merges
  every used split of the group (as many heads per round of loads as its
  tile holds), writes the output and resets the semaphore to 0 (split-K with
  a semaphore: no second launch for the reduction). In a decode step it can
  also do ``rope_store_kv``'s work (``new_kv``): each program rotates its q in
  registers, and the one holding the last position writes the new k and v
  before its own loads read them. Each request cuts its own
  context into equal slices, so the grid depends on the batch size alone: a
  CUDA graph replays it for any context, and an eager step of the same batch
  does exactly the same arithmetic.

Scores are kept in base 2 (``scale * log2(e)`` folded into the scale) and
every softmax statistic is float32. The kernels never allocate the cache
nor read past a request's ``seq_len``: masked loads keep padded block-table
entries (block 0, the null block) unread.

The decode semaphores are this module's one piece of state: an int32
buffer per device (``decode_semaphores``), zeroed once when allocated and
left zeroed by every launch, so no call pays a memset. It only grows, and a
buffer once handed out is never freed, because a CUDA graph keeps its
address. Decode launches on one device must therefore not overlap in time
(one stream, as the engine runs). Programmatic dependent launch keeps that:
a decode launch may start early only beside the kernel just before it, and
its programs touch the semaphores only after ``gdc_wait``, by which time
every earlier kernel, the previous decode launch included, has finished.
With PDL (``kernels/pdl.py``) the decode kernel reads the step's inputs
(and, with ``new_kv``, its first K/V tile) before that wait and lets the
next kernel start right after it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvserve.kernels.kv_quant import (
    KV_FP8,
    KV_INT8,
    check_kv_scales,
    dequant_scores,
    dequant_values,
    head_scales,
    kv_quant_mode,
    scale_index,
    scale_pointers,
)
from kvserve.kernels.pdl import use_pdl
from kvserve.kernels.rope_store_kv import check_new_kv, store_rotated_kv
from kvserve.kernels.rotary import rotate_pair
from kvserve.kernels.store_kv import check_kv_cache

LOG2E = 1.4426950408889634
# Below any real score (scores are bounded by |q||k|·scale), finite so that
# fully masked rows give exp2(-inf - NEG_BIG) = 0 and never NaN.
NEG_BIG = tl.constexpr(-1.0e30)
# Decode split-K policy: aim at this many programs per SM, never more than
# MAX_SPLITS splits; a request uses only as many splits as give each at
# least MIN_SPLIT_TOKENS positions.
PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 64  # measured fastest at batch 1 (a split is whole BLOCK_N tiles)
# 16, not more: the merge of 16 splits reduces a GQA group of 4 heads in one
# pass of loads; at batch 1 on an H200 that beat 32 and 64 splits at every
# context up to 4K and lost 5% at 16K (docs/decisions/0014)
MAX_SPLITS = 16
# from this many splits on (batch <= 4 on 132 SMs), 16-bit KV tiles of 64
# positions: short contexts have fewer positions per split than 128
SHORT_TILE_MIN_SPLITS = 16
MERGE_TILE_ELEMENTS = 8192  # float32 partial outputs the merge holds at once (64 per thread)
DEFAULT_NUM_SMS = 132


@triton.jit
def _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning q-block ``q_block_idx``: request ``i`` owns q-blocks
    ``[query_start_loc[i] // BLOCK_Q + i, query_start_loc[i + 1] // BLOCK_Q + i + 1)``."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_q_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_q_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, key_pos, key_valid,
    kv_head, dims, dim_mask, stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_scale_slot, BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """K and V of one KV head at ``key_pos`` ([BLOCK_N]), gathered through the
    block table: two [BLOCK_N, HEAD_DIM_PAD] tiles, zero where masked, as
    stored; with an int8 cache also their [BLOCK_N] scales (else unused zeros)."""
    block_id = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
    # [BLOCK_N] element offset of each position's head vector
    kv_offset = (
        block_id.to(tl.int64) * stride_cache_block
        + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
    )
    kv_mask = key_valid[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if KV_QUANT == KV_INT8:
        scale_idx = scale_index(block_id, key_pos % BLOCK_SIZE, kv_head, stride_scale_slot,
                                BLOCK_SIZE, KV_QUANT)
        k_scale = tl.load(k_scale_ptr + scale_idx, mask=key_valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_idx, mask=key_valid, other=0.0)
    else:
        k_scale = tl.zeros(key_pos.shape, dtype=tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _attend_tile(q, k, v, k_scale, v_scale, key_valid, m_i, l_i, acc, scale_log2,
                 DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr):
    """One K/V tile of the decode kernel's online softmax: the running max
    ``m_i`` and sum ``l_i`` (base 2) and the unnormalised output ``acc``."""
    scores = dequant_scores(q, k, k_scale, scale_log2, DOT_PRECISION, KV_QUANT)
    scores = tl.where(key_valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dequant_values(p, v, v_scale, q.dtype, DOT_PRECISION,
                                                  KV_QUANT)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_reqs", "sliding_window", "stride_bt"])
def prefill_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # float32 kv_scales[0] (kv_quant.py), read only when quantised
    v_scale_ptr,  # float32 kv_scales[1]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_table_ptr,  # [num_reqs, max_blocks] int32
    scale_log2,  # softmax scale * log2(e)
    num_reqs,
    sliding_window,  # used only when USE_WINDOW
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_slot,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # key positions per tile
    USE_WINDOW: tl.constexpr,
    SKIP_DECODES: tl.constexpr,  # leave requests of one new token to decode_attention
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.KV_NONE, KV_FP8 or KV_INT8
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:
        return
    if SKIP_DECODES and q_len == 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_token = q_block_local * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] index within request
    head_in_group = rows % GROUP_PAD
    row_valid = (q_token < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + q_token  # [BLOCK_M] position in the sequence
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    # [BLOCK_M, HEAD_DIM_PAD]
    q = tl.load(
        q_ptr + (q_start + q_token)[:, None] * stride_q_token
        + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    )
    first_q_pos = context_len + q_block_local * BLOCK_Q
    kv_end = tl.minimum(first_q_pos + BLOCK_Q, seq_len)  # last q position + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(first_q_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    scale_log2, v_head_scale = head_scales(k_scale_ptr, v_scale_ptr, kv_head, scale_log2,
                                            KV_QUANT)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_valid = key_pos < kv_end
        k, v, k_scale, v_scale = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, key_pos,
            key_valid, kv_head, dims, dim_mask, stride_cache_block, stride_cache_slot,
            stride_cache_head, stride_scale_slot, BLOCK_SIZE, KV_QUANT)
        # [BLOCK_M, BLOCK_N]
        scores = dequant_scores(q, k, k_scale, scale_log2, DOT_PRECISION, KV_QUANT)
        allowed = key_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            allowed = allowed & (key_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dequant_values(p, v, v_scale, q.dtype, DOT_PRECISION,
                                                      KV_QUANT)
        m_i = m_new

    if KV_QUANT == KV_FP8:
        acc = acc * v_head_scale
    # padded rows saw no key (l_i = 0); they are not stored, keep them finite
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + q_token)[:, None] * stride_out_token
        + head[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_mask[None, :],
    )


@triton.jit
def _merge_splits(
    out_row_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, first_stat_idx, num_splits,
    useful_splits, first_head, stride_out_head,
    GROUP: tl.constexpr, HEADS_PER_PASS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge the used splits of ``GROUP`` consecutive query heads from the
    partial results and write them normalised into one token's output row;
    ``HEADS_PER_PASS`` heads at a time, each pass one round of loads (a
    [HEADS_PER_PASS, SPLITS_PAD, HEAD_DIM_PAD] tile of partial outputs)."""
    splits = tl.arange(0, SPLITS_PAD)
    used = splits < useful_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    for first in tl.static_range(0, GROUP, HEADS_PER_PASS):
        h = first + tl.arange(0, HEADS_PER_PASS)
        h_valid = h < GROUP
        stat_idx = first_stat_idx + h[:, None] * num_splits + splits[None, :]  # [H, S]
        stat_mask = h_valid[:, None] & used[None, :]
        m_split = tl.load(part_max_ptr + stat_idx, mask=stat_mask, other=NEG_BIG, volatile=True)
        l_split = tl.load(part_sum_ptr + stat_idx, mask=stat_mask, other=0.0, volatile=True)
        acc_split = tl.load(  # [H, S, D]
            part_out_ptr + stat_idx[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=stat_mask[:, :, None] & dim_mask[None, None, :], other=0.0, volatile=True)
        weight = tl.exp2(m_split - tl.max(m_split, 1)[:, None])  # [H, S]
        l_total = tl.sum(l_split * weight, 1)  # [H]; 0 only on masked heads
        acc = tl.sum(acc_split * weight[:, :, None], 1)  # [H, D]
        tl.store(out_row_ptr + (first_head + h)[:, None] * stride_out_head + dims[None, :],
                 (acc / l_total[:, None]).to(out_row_ptr.dtype.element_ty),
                 mask=h_valid[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["sliding_window", "stride_bt"])
def decode_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # float32 kv_scales[0] (kv_quant.py), read only when quantised
    v_scale_ptr,  # float32 kv_scales[1]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_reqs, num_heads, num_splits, head_dim] fp32, unnormalised
    part_max_ptr,  # [num_reqs, num_heads, num_splits] fp32, base-2 running max
    part_sum_ptr,  # [num_reqs, num_heads, num_splits] fp32
    semaphore_ptr,  # [>= num_reqs * num_kv_heads] int32, zero between launches
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    block_table_ptr,  # [num_reqs, max_blocks] int32
    new_k_ptr,  # [num_tokens, num_kv_heads, head_dim], read only with FUSE_ROPE
    new_v_ptr,  # [num_tokens, num_kv_heads, head_dim], read only with FUSE_ROPE
    slot_mapping_ptr,  # [num_tokens] int64, read only with FUSE_ROPE
    cos_sin_ptr,  # [max_position, head_dim] float32: cos | sin, read only with FUSE_ROPE
    max_position,
    scale_log2,
    sliding_window,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_slot,
    stride_bt,
    stride_new_k_token,
    stride_new_k_head,
    stride_new_v_token,
    stride_new_v_head,
    stride_cos_sin_pos,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    NUM_SPLITS_IS_ONE: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits padded to a power of two
    MERGE_HEADS: tl.constexpr,  # query heads the merge reduces at once
    MIN_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_ROPE: tl.constexpr,  # rotate q and write the new k, v here (rope_store_kv's work)
    HALF: tl.constexpr,  # head_dim // 2, a power of two, when FUSE_ROPE
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (kernels/pdl.py)
    KV_QUANT: tl.constexpr,  # kv_quant.KV_NONE, KV_FP8 or KV_INT8
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # three independent loads, one round trip to memory
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    if q_end - q_start != 1:
        return  # padding, or a prompt chunk that prefill_attention handles

    # each request cuts its own context into equal slices (a multiple of
    # BLOCK_N, at least MIN_SPLIT positions), so the grid depends on no
    # context length; programs past the request's slices exit at once,
    # neither counted on the semaphore nor read by the merge
    context_start = 0
    if USE_WINDOW:
        context_start = tl.maximum(0, seq_len - sliding_window)
    context_len = seq_len - context_start
    wanted_splits = tl.minimum(num_splits, tl.maximum(1, tl.cdiv(context_len, MIN_SPLIT)))
    partition_size = tl.cdiv(tl.cdiv(context_len, wanted_splits), BLOCK_N) * BLOCK_N
    # rounding slices up to whole tiles can leave the last wanted ones empty
    useful_splits = tl.maximum(1, tl.cdiv(context_len, partition_size))
    if split >= useful_splits:
        return
    split_start = context_start + split * partition_size
    split_end = tl.minimum(split_start + partition_size, seq_len)

    rows = tl.arange(0, ROWS)
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_row = q_ptr + q_start * stride_q_token + head[:, None] * stride_q_head  # [ROWS, 1]
    m_i = tl.full([ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    scale_log2, v_head_scale = head_scales(k_scale_ptr, v_scale_ptr, kv_head, scale_log2,
                                            KV_QUANT)
    loop_start = split_start
    if FUSE_ROPE:
        # rope_store_kv's work for this token: a decode token sits at position
        # seq_len - 1. Every split rotates the group's q in registers (q in
        # memory stays as it was); the split that holds the last position also
        # writes the token's k (rotated) and v, then its barrier makes them
        # visible to its own tile loads below, the only ones that read them.
        # The split's first tile loads first, before q: only its row at this
        # token's position, if it holds it, is read again after the write.
        pos = seq_len - 1
        rotate = pos < max_position
        halves = tl.arange(0, HALF)
        cos_sin_row = cos_sin_ptr + tl.where(rotate, pos, 0).to(tl.int64) * stride_cos_sin_pos
        cos = tl.load(cos_sin_row + halves)
        sin = tl.load(cos_sin_row + HALF + halves)
        first_pos = split_start + tl.arange(0, BLOCK_N)
        first_valid = first_pos < split_end
        first_k, first_v, first_k_scale, first_v_scale = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, first_pos,
            first_valid, kv_head, dims, dim_mask, stride_cache_block, stride_cache_slot,
            stride_cache_head, stride_scale_slot, BLOCK_SIZE, KV_QUANT)
    if PDL:
        # everything above is the step's input or earlier steps' cache; q, k
        # and v are the previous kernel's output. Once they are readable, the
        # next kernel may start.
        gdc_wait()
        gdc_launch_dependents()
    if FUSE_ROPE:
        x1 = tl.load(q_row + halves[None, :], mask=row_valid[:, None], other=0.0)
        x2 = tl.load(q_row + HALF + halves[None, :], mask=row_valid[:, None], other=0.0)
        rotated1, rotated2 = rotate_pair(x1.to(tl.float32), x2.to(tl.float32),
                                         cos[None, :], sin[None, :])
        q1 = tl.where(rotate, rotated1.to(q_ptr.dtype.element_ty), x1)
        q2 = tl.where(rotate, rotated2.to(q_ptr.dtype.element_ty), x2)
        # [ROWS, HALF, 2] -> [ROWS, 2, HALF] -> [ROWS, HEAD_DIM]: q1's dims, then q2's
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (ROWS, HEAD_DIM_PAD))
        if split == useful_splits - 1:
            slot = tl.load(slot_mapping_ptr + q_start)
            if slot >= 0:
                store_rotated_kv(
                    new_k_ptr + q_start * stride_new_k_token + kv_head * stride_new_k_head,
                    new_v_ptr + q_start * stride_new_v_token + kv_head * stride_new_v_head,
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, kv_head, rotate,
                    cos, sin, stride_cache_block, stride_cache_slot, stride_cache_head,
                    stride_scale_slot, BLOCK_SIZE, HALF, HALF, HEAD_DIM, HEAD_DIM_PAD, 1,
                    KV_QUANT)
            tl.debug_barrier()
        this_token = first_valid & (first_pos == pos)  # all false but in the last split
        new_k, new_v, new_k_scale, new_v_scale = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, first_pos,
            this_token, kv_head, dims, dim_mask, stride_cache_block, stride_cache_slot,
            stride_cache_head, stride_scale_slot, BLOCK_SIZE, KV_QUANT)
        first_k = tl.where(this_token[:, None], new_k, first_k)
        first_v = tl.where(this_token[:, None], new_v, first_v)
        if KV_QUANT == KV_INT8:
            first_k_scale = tl.where(this_token, new_k_scale, first_k_scale)
            first_v_scale = tl.where(this_token, new_v_scale, first_v_scale)
        m_i, l_i, acc = _attend_tile(q, first_k, first_v, first_k_scale, first_v_scale,
                                     first_valid, m_i, l_i, acc, scale_log2, DOT_PRECISION,
                                     KV_QUANT)
        loop_start = split_start + BLOCK_N
    else:
        q = tl.load(q_row + dims[None, :], mask=row_valid[:, None] & dim_mask[None, :],
                    other=0.0)  # [ROWS, HEAD_DIM_PAD]

    for tile_start in range(loop_start, split_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < split_end
        k, v, k_scale, v_scale = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, key_pos,
            key_valid, kv_head, dims, dim_mask, stride_cache_block, stride_cache_slot,
            stride_cache_head, stride_scale_slot, BLOCK_SIZE, KV_QUANT)
        m_i, l_i, acc = _attend_tile(q, k, v, k_scale, v_scale, key_valid, m_i, l_i, acc,
                                     scale_log2, DOT_PRECISION, KV_QUANT)

    if KV_QUANT == KV_FP8:
        acc = acc * v_head_scale
    store_mask = row_valid[:, None] & dim_mask[None, :]
    if useful_splits == 1:
        # the whole context in this program (always so with one split): the
        # output directly, no partials, semaphore or merge
        tl.store(
            out_ptr + q_start * stride_out_token + head[:, None] * stride_out_head
            + dims[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    elif not NUM_SPLITS_IS_ONE:
        num_heads = GROUP * tl.num_programs(1)
        # row (req, head) of the [num_reqs, num_heads, num_splits] statistics
        stat_idx = (req * num_heads + head) * num_splits + split
        tl.store(part_max_ptr + stat_idx, m_i, mask=row_valid)
        tl.store(part_sum_ptr + stat_idx, l_i, mask=row_valid)
        tl.store(part_out_ptr + stat_idx[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=store_mask)
        # Publish the partials, then count this split. GPU memory ordering
        # (the interpreter runs programs one after another and shows none of
        # it): the scalar atomic is executed by one thread of the program, so
        # the barrier first orders every thread's stores above before it
        # (CTA scope); its release half, at GPU scope and cumulative, then
        # makes them visible to whichever program acquires the count later.
        tl.debug_barrier()
        semaphore = semaphore_ptr + req * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(semaphore, 1, sem="acq_rel", scope="gpu")
        if arrived == useful_splits - 1:
            # Last of the used splits: every other one released its partials
            # before its increment, and this acquire read the sum of them all.
            # Every thread takes this branch (Triton broadcasts the atomic's
            # result), and the barrier orders each thread's loads below after
            # the one thread's acquire, whatever that broadcast does. The
            # loads are volatile so that neither the compiler nor L1 can
            # serve them from before it. No other program touches the
            # semaphore again in this launch; the next launch (or graph
            # replay) starts after this one completes and sees the 0.
            tl.debug_barrier()
            tl.store(semaphore, 0)
            _merge_splits(out_ptr + q_start * stride_out_token, part_out_ptr, part_max_ptr,
                          part_sum_ptr, (req * num_heads + kv_head * GROUP) * num_splits,
                          num_splits, useful_splits, kv_head * GROUP, stride_out_head, GROUP,
                          MERGE_HEADS, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD)


# ---------------------------------------------------------------- launchers


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    sliding_window: int | None,
    out: torch.Tensor | None,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Validate the common inputs; return ``out`` (allocated when None)."""
    check_kv_cache(kv_cache)
    check_kv_scales(kv_cache, kv_scales)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q: shape {tuple(q.shape)}; expected [num_tokens, num_heads, {head_dim}] with "
            f"num_heads a multiple of num_kv_heads={num_kv_heads}"
        )
    # a quantised cache is read in q's dtype, any of the others'
    q_dtypes = ((torch.float16, torch.bfloat16, torch.float32) if kv_quant_mode(kv_cache.dtype)
                else (kv_cache.dtype,))
    if q.dtype not in q_dtypes or q.stride(-1) != 1 or q.device != kv_cache.device:
        raise ValueError(
            f"q: dtype {q.dtype}, last stride {q.stride(-1)}, device {q.device}; expected "
            f"dtype {' or '.join(map(str, q_dtypes))}, last stride 1, device "
            f"{kv_cache.device} (the cache's)"
        )
    num_reqs = seq_lens.shape[0]
    for name, tensor, shape in (
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
        ("seq_lens", seq_lens, (num_reqs,)),
    ):
        if (tensor.dtype != torch.int32 or tuple(tensor.shape) != shape
                or not tensor.is_contiguous()):
            raise ValueError(
                f"{name}: {tensor.dtype} of shape {tuple(tensor.shape)}; expected contiguous "
                f"int32 of shape {list(shape)}"
            )
    if (block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != num_reqs or block_table.stride(1) != 1):
        raise ValueError(
            f"block_table: {block_table.dtype} of shape {tuple(block_table.shape)}, strides "
            f"{block_table.stride()}; expected int32 [num_reqs={num_reqs}, max_blocks] with "
            "unit last stride"
        )
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                         ("block_table", block_table)):
        if tensor.device != q.device:
            raise ValueError(f"{name}: on {tensor.device}; expected {q.device} (q's device)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}; must be None or >= 1")
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out: {out.dtype} of shape {tuple(out.shape)}, last stride {out.stride(-1)}; "
            f"expected {q.dtype} of shape {tuple(q.shape)}, last stride 1"
        )
    return out


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including the new tokens
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    skip_decodes: bool = False,
    kv_scales: torch.Tensor | None = None,  # an fp8 or int8 cache's (kernels/kv_quant.py)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal paged attention for any mix of prefills, chunked prefills and decodes.

    Every query head of one KV head is computed in the same program. Needs no
    device-to-host copy: the grid comes from ``q.shape[0]``, the number of
    requests and ``max_query_len``. With ``skip_decodes`` the rows of
    requests with one new token are left unwritten, for ``decode_attention``
    on the same ``out``: its split-K kernel reads their context faster than
    a tile made for many query tokens.
    """
    out = _check_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                        out, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(head_dim)
    max_rows, block_n = _prefill_tile_limits(q.dtype, head_dim_pad)
    block_m = max(min(max_rows, max(16, triton.next_power_of_2(max_query_len * group_pad))),
                  group_pad)
    block_q = block_m // group_pad
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scales, v_scales, stride_scale_slot = scale_pointers(kv_cache, kv_scales)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    prefill_attention_kernel[grid](
        q, k_cache, v_cache, k_scales, v_scales, out, query_start_loc, seq_lens, block_table,
        scale * LOG2E, num_reqs, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_scale_slot,
        block_table.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        SKIP_DECODES=skip_decodes,
        DOT_PRECISION=_dot_precision(q.dtype),
        KV_QUANT=kv_quant_mode(kv_cache.dtype),
        num_warps=8 if block_m >= 128 else 4,
        num_stages=3,
    )
    return out


def decode_num_splits(num_reqs: int, num_kv_heads: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """How many context slices each (request, KV head) of a decode step may get.

    A power of two, enough for ``PROGRAMS_PER_SM * num_sms`` programs in all,
    at most ``MAX_SPLITS``: one split at large batch, many at batch 1. It
    reads the batch size rounded up to a power of two, never a context
    length, so a step padded to a CUDA graph's size splits like the same
    step run eagerly.
    """
    programs = triton.next_power_of_2(max(1, num_reqs)) * num_kv_heads
    splits = min(triton.cdiv(PROGRAMS_PER_SM * num_sms, programs), MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


# device -> every semaphore buffer handed out there, the newest (largest)
# last; older ones stay referenced because captured CUDA graphs use them
_SEMAPHORES: dict[torch.device, list[torch.Tensor]] = {}
MIN_SEMAPHORES = 1024


def decode_semaphores(device: torch.device, num_semaphores: int) -> torch.Tensor:
    """The int32 split counters of ``decode_attention`` on ``device``: at
    least ``num_semaphores``, all 0 between launches.

    Allocated and zeroed only when a call needs more than the newest buffer
    has (doubling, at least ``MIN_SEMAPHORES``); every launch leaves the
    counters it used at 0 again. Growing inside a CUDA graph capture would
    record the zeroing in the graph instead of running it, so it is refused:
    run the largest batch eagerly first (graph capture warms each size up
    eagerly, largest first).
    """
    buffers = _SEMAPHORES.setdefault(device, [])
    if buffers and buffers[-1].numel() >= num_semaphores:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"decode_attention: {num_semaphores} split semaphores needed on {device} while "
            f"capturing a CUDA graph, {buffers[-1].numel() if buffers else 0} allocated; run "
            "the largest decode batch once eagerly before capturing"
        )
    size = max(MIN_SEMAPHORES, triton.next_power_of_2(num_semaphores),
               2 * buffers[-1].numel() if buffers else 0)
    buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 caches: three tf32 products, about float32 accuracy on tensor cores
    # ("ieee" spills registers heavily at head_dim 128); ignored for 16-bit inputs
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _prefill_tile_limits(dtype: torch.dtype, head_dim_pad: int) -> tuple[int, int]:
    """(most rows per program, key positions per tile) that fit sm_90 registers:
    float32 tiles are twice as large, head dims above 128 need smaller tiles.
    16-bit rows stop at 64, not 128: twice the programs for a prompt of ~1K
    tokens measured 1.2-1.5x faster on an H100 (docs/benchmarks.md)."""
    if dtype == torch.float32:
        return 32, 32
    if head_dim_pad > 128:
        return 64, 32
    return 64, 64


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    new_kv: NewKV | None = None,
    kv_scales: torch.Tensor | None = None,  # an fp8 or int8 cache's (kernels/kv_quant.py)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Split-K paged attention of the requests with exactly one new token.

    In a decode step that is every request (padding rows have none); in a
    mixed step the others' rows are left to ``prefill_attention(...,
    skip_decodes=True)`` on the same ``out``.

    ``num_splits`` (default: ``decode_num_splits``) is the most slices a
    context is cut into; a request of ``n`` positions wants
    ``min(num_splits, ceil(n / min_split_tokens))`` equal ones, each rounded up
    to whole KV tiles, so it uses as many as those rounded slices need. Used
    slices are merged by the last of them to finish, in the same launch; one
    slice writes the output itself. Every query row must be the
    last position of its request. ``max_seq_len`` may be any upper bound of
    ``seq_lens`` (a CUDA graph captured for reuse passes ``max_model_len``).

    With ``new_kv`` (a decode step: every request has one new token), the
    kernel also does ``rope_store_kv``'s work for each token, at position
    ``seq_len - 1``: q rotated (in registers; q itself is left as it is) and
    the new k, rotated, with v written to the cache at the slot mapping.
    Full rotary only, on a power-of-two head_dim (``fuses_new_kv``).
    """
    out = _check_inputs(q, kv_cache, query_start_loc, seq_lens, block_table, sliding_window,
                        out, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    if new_kv is None:  # the new-KV pointers go unread: any tensor of the right dtype will do
        new_k, new_v, slots, cos_sin = q, q, seq_lens, out
    else:
        new_k, new_v = _check_new_kv(q, kv_cache, new_kv)
        slots, cos_sin = new_kv.slot_mapping, new_kv.cos_sin_cache
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_seq_len < 1:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(num_reqs, num_kv_heads, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}; must be >= 1")
    if min_split_tokens < 1:
        raise ValueError(f"min_split_tokens={min_split_tokens}; must be >= 1")
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    splits_pad = triton.next_power_of_2(num_splits)
    # 128 positions of 16-bit KV per tile: as fast as 64 on even contexts, up to
    # 1.4x faster on ragged or long ones (H100, decision 0013), except at the
    # smallest batches (decision 0014)
    if q.dtype == torch.float32 or head_dim_pad > 128:
        block_n = 32
    else:
        block_n = 64 if num_splits >= SHORT_TILE_MIN_SPLITS else 128
    if num_splits > 1:
        # [num_reqs, num_heads, num_splits(, head_dim)] float32 partial results
        part_out = torch.empty((num_reqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
        semaphores = decode_semaphores(q.device, num_reqs * num_kv_heads)
    else:
        part_out = part_max = part_sum = out
        semaphores = seq_lens  # unused by the one-split kernel
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scales, v_scales, stride_scale_slot = scale_pointers(kv_cache, kv_scales)
    pdl = use_pdl(q.device)
    decode_attention_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scales, v_scales, out, part_out, part_max, part_sum, semaphores,
        query_start_loc, seq_lens, block_table, new_k, new_v, slots, cos_sin, cos_sin.shape[0],
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_scale_slot,
        block_table.stride(0),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), cos_sin.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        NUM_SPLITS_IS_ONE=num_splits == 1,
        SPLITS_PAD=splits_pad,
        MERGE_HEADS=min(triton.next_power_of_2(group),
                        max(1, MERGE_TILE_ELEMENTS // (splits_pad * head_dim_pad))),
        MIN_SPLIT=min_split_tokens,
        DOT_PRECISION=_dot_precision(q.dtype),
        FUSE_ROPE=new_kv is not None,
        HALF=head_dim // 2,
        PDL=pdl,
        KV_QUANT=kv_quant_mode(kv_cache.dtype),
        num_warps=4,
        num_stages=2,
        launch_pdl=pdl,
    )
    return out


class NewKV(NamedTuple):
    """A decode step's new keys and values for ``decode_attention`` to rotate and
    write itself (instead of ``rope_store_kv`` before it)."""

    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim] or [.., num_kv_heads * head_dim]
    v: torch.Tensor  # as k
    slot_mapping: torch.Tensor  # [num_tokens] int64; a negative slot writes nothing
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cos | sin


def fuses_new_kv(head_dim: int, rotary_dim: int) -> bool:
    """Whether ``decode_attention`` can take ``new_kv`` for heads of ``head_dim``
    rotated over ``rotary_dim`` dims (full rotary, ``head_dim`` a power of two)."""
    return rotary_dim == head_dim and head_dim >= 2 and head_dim & (head_dim - 1) == 0


def _check_new_kv(q: torch.Tensor, kv_cache: torch.Tensor,
                  new_kv: NewKV) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_kv``'s k and v as ``[num_tokens, num_kv_heads, head_dim]`` views, after
    checking them, its slot mapping and its cos/sin cache."""
    head_dim = kv_cache.shape[-1]
    rotary_dim = new_kv.cos_sin_cache.shape[-1] if new_kv.cos_sin_cache.dim() == 2 else -1
    if not fuses_new_kv(head_dim, rotary_dim):
        raise ValueError(
            f"new_kv.cos_sin_cache: shape {tuple(new_kv.cos_sin_cache.shape)}; expected "
            f"[max_position, head_dim={head_dim}] with head_dim a power of two (full rotary)"
        )
    if (new_kv.cos_sin_cache.dtype != torch.float32 or new_kv.cos_sin_cache.stride(1) != 1
            or new_kv.cos_sin_cache.device != kv_cache.device):
        raise ValueError(
            f"new_kv.cos_sin_cache: {new_kv.cos_sin_cache.dtype} on "
            f"{new_kv.cos_sin_cache.device}; expected float32 on {kv_cache.device} with a "
            "unit last stride"
        )
    _, new_k, new_v = check_new_kv(q, new_kv.k, new_kv.v, kv_cache, new_kv.slot_mapping,
                                   q.shape[0])
    return new_k, new_v
