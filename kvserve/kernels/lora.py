"""Batched LoRA kernels: ``lora_shrink`` (``x @ A.T``) and ``lora_expand``
(``out += buf @ B.T``) over a step whose tokens use different adapters, or
none, in one launch each for all slices of a packed linear.

Buffers (``kvserve/lora/layers.py`` owns them, these kernels only read them):

- ``lora_a [num_slices, max_loras, max_rank, K]``: slice ``s`` of adapter slot ``l``;
- ``lora_b [max_loras, N, max_rank]``: slice ``s`` in rows
  ``slice_start[s] .. slice_start[s] + slice_size[s]``, the adapter's scaling
  already folded in;
- ``buf [SPLIT_K, num_slices, max_tokens, max_rank]`` float32: the
  shrink's output, the expand's input. The shrink splits K over
  ``SPLIT_K`` programs (a batch-1 decode step otherwise has a dozen
  programs streaming A); the expand sums the partial products in a fixed
  order, so the result does not depend on timing. Rows of tokens without
  an adapter are never written or read.

Which adapter a token uses comes from device tensors at fixed addresses, so
a CUDA graph replays with whatever the runner wrote into them, and no grid
depends on the step's adapters:

- gathered form (decode steps): ``token_slots [num_tokens]`` int32, the slot
  of each token (-1: none). A program owns one token and one slice (and a
  chunk of the rank for the shrink, of N for the expand) and reads its own
  adapter's rows; it is the small batch's form, with no sorting and no
  idle programs but those of tokens without an adapter.
- segmented form (larger steps): ``sorted_ids [num_tokens]`` int32, the
  tokens with an adapter grouped by slot, and ``tiles [3, max_tiles]``
  int32: per tile of at most ``TILE_M`` tokens of one adapter, its first
  and end positions in ``sorted_ids`` and its slot (-1: no tile). A step of
  ``T`` tokens has at most ``cdiv(T, TILE_M) + max_loras`` tiles, the grid's
  size, so it depends on ``T`` alone; a tile's products are ``tl.dot``
  tiles, and each adapter's A and B are read once per tile, not per token.

Arithmetic: products and sums in float32 (``input_precision="ieee"``, so a
float32 model gets no TF32), the shrink's result kept in float32, the
expand's delta added to ``out`` in float32 and rounded once. The torch
path of ``LoRALinear`` (per slot, ``index_select`` / ``index_add_``) is the
oracle and the CPU path. Nothing is allocated or read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_M = 16  # tokens per tile of the segmented form (tl.dot's smallest M)
SPLIT_K = 4  # programs sharing the K of one shrink product


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [num_slices, max_loras, max_rank, K]
    buf_ptr,  # [SPLIT, num_slices, max_tokens, max_rank] float32
    token_slots_ptr,  # [num_tokens] int32, gathered form
    sorted_ids_ptr,  # [num_tokens] int32, segmented form
    tiles_ptr,  # [3, tile_stride] int32, segmented form
    tile_stride,
    K,
    stride_xm,
    stride_as,
    stride_al,
    stride_ar,
    stride_bp,
    stride_bs,
    stride_bm,
    RANK: tl.constexpr,  # max_rank
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SEGMENTED: tl.constexpr,
):
    """Gathered grid ``(num_tokens, num_slices, cdiv(RANK, BLOCK_R) * SPLIT)``;
    segmented grid ``(num_tiles, num_slices, SPLIT)``."""
    s = tl.program_id(1)
    part = tl.program_id(2) % SPLIT
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_start = part * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    buf_ptr += part * stride_bp + s * stride_bs
    ranks = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    if SEGMENTED:
        tile = tl.program_id(0)
        slot = tl.load(tiles_ptr + 2 * tile_stride + tile)
        if slot < 0:
            return
        rows = tl.load(tiles_ptr + tile) + tl.arange(0, BLOCK_M)
        row_mask = rows < tl.load(tiles_ptr + tile_stride + tile)
        tokens = tl.load(sorted_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        rank_mask = ranks < RANK
        a_base = a_ptr + s * stride_as + slot.to(tl.int64) * stride_al
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            cols = k + offs_k
            x = tl.load(x_ptr + tokens[:, None] * stride_xm + cols[None, :],
                        mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)
            a = tl.load(a_base + ranks[None, :] * stride_ar + cols[:, None],
                        mask=rank_mask[None, :] & (cols[:, None] < K), other=0.0)
            acc += tl.dot(x, a, input_precision="ieee")  # [BLOCK_M, BLOCK_R]
        tl.store(buf_ptr + tokens[:, None] * stride_bm + ranks[None, :], acc,
                 mask=row_mask[:, None] & rank_mask[None, :])
    else:
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(token_slots_ptr + token)
        if slot < 0:
            return
        ranks = (tl.program_id(2) // SPLIT) * BLOCK_R + ranks
        rank_mask = ranks < RANK
        a_base = a_ptr + s * stride_as + slot.to(tl.int64) * stride_al
        acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            cols = k + offs_k
            x = tl.load(x_ptr + token * stride_xm + cols, mask=cols < K, other=0.0)
            a = tl.load(a_base + ranks[:, None] * stride_ar + cols[None, :],
                        mask=rank_mask[:, None] & (cols[None, :] < K), other=0.0)
            acc2 += a.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(buf_ptr + token * stride_bm + ranks, tl.sum(acc2, axis=1), mask=rank_mask)


@triton.jit
def lora_expand_kernel(
    buf_ptr,  # [SPLIT, num_slices, max_tokens, max_rank] float32
    b_ptr,  # [max_loras, N, max_rank]
    out_ptr,  # [num_tokens, N], added to in place
    slices_ptr,  # [2, num_slices] int32: each slice's first row in N, and its rows
    token_slots_ptr,  # [num_tokens] int32, gathered form
    sorted_ids_ptr,  # [num_tokens] int32, segmented form
    tiles_ptr,  # [3, tile_stride] int32, segmented form
    tile_stride,
    num_n,  # cdiv(max slice rows, BLOCK_N)
    num_slices,
    stride_bp,
    stride_bs,
    stride_bm,
    stride_wl,
    stride_wn,
    stride_om,
    RANK: tl.constexpr,  # max_rank
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr,
    SEGMENTED: tl.constexpr,
):
    """Gathered grid ``(num_tokens, num_slices, cdiv(max slice rows, BLOCK_N))``;
    segmented grid ``(num_tiles * cdiv(max slice rows, BLOCK_N), num_slices)``."""
    s = tl.program_id(1)
    slice_start = tl.load(slices_ptr + s)
    slice_size = tl.load(slices_ptr + num_slices + s)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < RANK
    buf_ptr += s * stride_bs
    if SEGMENTED:
        tile = tl.program_id(0) // num_n
        n_tile = tl.program_id(0) % num_n
        slot = tl.load(tiles_ptr + 2 * tile_stride + tile)
        if slot < 0 or n_tile * BLOCK_N >= slice_size:
            return
        rows = tl.load(tiles_ptr + tile) + tl.arange(0, BLOCK_M)
        row_mask = rows < tl.load(tiles_ptr + tile_stride + tile)
        tokens = tl.load(sorted_ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for part in tl.static_range(SPLIT):  # the shrink's partial sums, in a fixed order
            shrunk += tl.load(buf_ptr + part * stride_bp + tokens[:, None] * stride_bm
                              + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :],
                              other=0.0)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < slice_size
        cols = slice_start + cols
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_wl + cols[None, :] * stride_wn
                    + ranks[:, None], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        delta = tl.dot(shrunk, b.to(tl.float32), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        out_ptrs = out_ptr + tokens[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
    else:
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(token_slots_ptr + token)
        if slot < 0:
            return
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < slice_size
        if tl.program_id(2) * BLOCK_N >= slice_size:
            return
        cols = slice_start + cols
        shrunk = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for part in tl.static_range(SPLIT):
            shrunk += tl.load(buf_ptr + part * stride_bp + token * stride_bm + ranks,
                              mask=rank_mask, other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_wl + cols[:, None] * stride_wn
                    + ranks[None, :], mask=col_mask[:, None] & rank_mask[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * shrunk[None, :], axis=1)  # [BLOCK_N]
        out_ptrs = out_ptr + token * stride_om + cols
        mask = col_mask
    current = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (current.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def num_tiles(num_tokens: int, max_loras: int) -> int:
    """The most tiles of the segmented form a step of ``num_tokens`` tokens has."""
    return triton.cdiv(num_tokens, TILE_M) + min(max_loras, num_tokens)


def _check_indices(num_tokens: int, max_loras: int, token_slots: torch.Tensor | None,
                   sorted_ids: torch.Tensor | None, tiles: torch.Tensor | None) -> int:
    """Check the index tensors of one form; the segmented grid's tiles (0: gathered)."""
    if (token_slots is None) == (sorted_ids is None) or (sorted_ids is None) != (tiles is None):
        raise ValueError("lora kernels: pass token_slots (gathered) or sorted_ids and tiles "
                         "(segmented), not both")
    if token_slots is not None:
        if token_slots.dtype != torch.int32 or token_slots.shape[0] < num_tokens:
            raise ValueError(f"token_slots: int32 [>= {num_tokens}] needed, got "
                             f"{token_slots.dtype} {tuple(token_slots.shape)}")
        return 0
    assert sorted_ids is not None and tiles is not None
    count = num_tiles(num_tokens, max_loras)
    if (tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[0] != 3
            or tiles.shape[1] < count or tiles.stride(1) != 1):
        raise ValueError(f"tiles: int32 [3, >= {count}] needed, got {tiles.dtype} "
                         f"{tuple(tiles.shape)}")
    if sorted_ids.dtype != torch.int32 or sorted_ids.shape[0] < num_tokens:
        raise ValueError(f"sorted_ids: int32 [>= {num_tokens}] needed, got "
                         f"{sorted_ids.dtype} {tuple(sorted_ids.shape)}")
    return count


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, K]
    lora_a: torch.Tensor,  # [num_slices, max_loras, max_rank, K]
    buf: torch.Tensor,  # [SPLIT_K, >= num_slices, >= num_tokens, max_rank] float32
    token_slots: torch.Tensor | None = None,  # [>= num_tokens] int32
    sorted_ids: torch.Tensor | None = None,  # [>= num_tokens] int32
    tiles: torch.Tensor | None = None,  # [3, >= num_tiles] int32
) -> None:
    """``buf[s, t] = x[t] @ lora_a[s, slot(t)].T`` for every slice ``s`` and every
    token ``t`` with an adapter; one launch."""
    num_tokens, k = x.shape
    num_slices, max_loras, rank, k_a = lora_a.shape
    if k_a != k or x.stride(1) != 1 or not lora_a.is_contiguous():
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} (stride 1 in K) and a contiguous "
                         f"lora_a [slices, loras, rank, {k}] needed, got {tuple(lora_a.shape)}")
    _check_buf("lora_shrink", buf, num_slices, num_tokens, rank)
    segmented_tiles, index, table = _launch_indices(num_tokens, max_loras, token_slots,
                                                    sorted_ids, tiles)
    if num_tokens == 0:
        return
    if segmented_tiles:
        block_r, block_k = _rank_block(rank), 128
        grid: tuple[int, ...] = (segmented_tiles, num_slices, SPLIT_K)
    else:
        block_r, block_k = min(4, triton.next_power_of_2(rank)), 256
        grid = (num_tokens, num_slices, triton.cdiv(rank, block_r) * SPLIT_K)
    lora_shrink_kernel[grid](
        x, lora_a, buf, index, index, table, table.stride(0),
        k, x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        buf.stride(0), buf.stride(1), buf.stride(2),
        RANK=rank, BLOCK_M=TILE_M, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT=SPLIT_K,
        SEGMENTED=bool(segmented_tiles),
    )


def _launch_indices(num_tokens: int, max_loras: int, token_slots: torch.Tensor | None,
                    sorted_ids: torch.Tensor | None, tiles: torch.Tensor | None
                    ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The checked indices as the kernels take them: the segmented form's tile
    count (0: gathered), the token index and the tile table (the index itself,
    one row, in the gathered form)."""
    segmented_tiles = _check_indices(num_tokens, max_loras, token_slots, sorted_ids, tiles)
    index = token_slots if token_slots is not None else sorted_ids
    assert index is not None
    return segmented_tiles, index, tiles if tiles is not None else index.view(1, -1)


def _check_buf(name: str, buf: torch.Tensor, num_slices: int, num_tokens: int,
               rank: int) -> None:
    if (buf.dtype != torch.float32 or buf.dim() != 4 or buf.shape[0] != SPLIT_K
            or buf.shape[1] < num_slices or buf.shape[3] != rank or buf.shape[2] < num_tokens
            or buf.stride(3) != 1):
        raise ValueError(f"{name}: buf float32 [{SPLIT_K}, >= {num_slices}, >= {num_tokens}, "
                         f"{rank}] needed, got {buf.dtype} {tuple(buf.shape)}")


def lora_expand(
    buf: torch.Tensor,  # [SPLIT_K, >= num_slices, >= num_tokens, max_rank] float32
    lora_b: torch.Tensor,  # [max_loras, N, max_rank]
    out: torch.Tensor,  # [num_tokens, N]
    slices: torch.Tensor,  # [2, num_slices] int32: (first row, rows) per slice
    max_slice_size: int,
    token_slots: torch.Tensor | None = None,
    sorted_ids: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
) -> None:
    """``out[t, slice s] += buf[s, t] @ lora_b[slot(t), slice s].T`` for every
    token with an adapter; one launch for all slices."""
    num_tokens, n = out.shape
    max_loras, n_b, rank = lora_b.shape
    num_slices = slices.shape[1]
    if n_b != n or out.stride(1) != 1 or not lora_b.is_contiguous():
        raise ValueError(f"lora_expand: out {tuple(out.shape)} (stride 1 in N) and a "
                         f"contiguous lora_b [loras, {n}, rank] needed, got "
                         f"{tuple(lora_b.shape)}")
    if slices.dtype != torch.int32 or slices.shape[0] != 2 or not slices.is_contiguous():
        raise ValueError(f"lora_expand: slices int32 [2, num_slices] needed, got "
                         f"{slices.dtype} {tuple(slices.shape)}")
    _check_buf("lora_expand", buf, num_slices, num_tokens, rank)
    segmented_tiles, index, table = _launch_indices(num_tokens, max_loras, token_slots,
                                                    sorted_ids, tiles)
    if num_tokens == 0:
        return
    block_n = 64 if segmented_tiles else 128
    num_n = triton.cdiv(max_slice_size, block_n)
    if segmented_tiles:
        grid: tuple[int, ...] = (segmented_tiles * num_n, num_slices)
    else:
        grid = (num_tokens, num_slices, num_n)
    lora_expand_kernel[grid](
        buf, lora_b, out, slices, index, index, table, table.stride(0), num_n, num_slices,
        buf.stride(0), buf.stride(1), buf.stride(2), lora_b.stride(0), lora_b.stride(1),
        out.stride(0), RANK=rank, BLOCK_M=TILE_M, BLOCK_N=block_n, BLOCK_R=_rank_block(rank),
        SPLIT=SPLIT_K, SEGMENTED=bool(segmented_tiles),
    )
