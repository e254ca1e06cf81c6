"""``carry_rows``: the rows of a step queued before the speculative step it
follows has been read, fixed up on the device (``ModelRunner._carry``).

The host writes such a request's rows as if the speculative step accepted
every proposal it verified. Each carried row ``t`` names its row of the
step's flat inputs, its request (the row of the step's block table), its
index in the speculative step's outputs and its offset in the request's
rows: offset 0 is the token after the accepted proposals, offset ``j > 0``
the ``j``-th proposal that step made (row ``proposal_row`` of
``proposals``). Each row moves back by that step's rejected proposals:
its position, its KV slot (looked up in the block table at the new
position) and its sequence length (per row in a verify layout, else per
request, once, at offset 0).

``worker/input_batch.carry_rows`` does it with torch ops (the oracle, and
the CPU path); this kernel does it in one launch, where the torch ops take
some twenty, which cost the host about half a millisecond a step (H100
host, the bundled model's EAGLE steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # carried rows a program fixes up


@triton.jit(do_not_specialize=["num_rows", "proposals_stride", "num_proposals"])
def carry_rows_kernel(
    index_ptr,  # [5, num_rows] int64, contiguous
    num_rows,
    tokens_ptr,
    rejected_ptr,
    proposals_ptr,  # [B, num_proposals], row stride proposals_stride (read when HAS_PROPOSALS)
    proposals_stride,
    num_proposals,
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    block_table_ptr,
    block_table_stride,
    seq_lens_ptr,
    KV_BLOCK: tl.constexpr,
    PER_ROW: tl.constexpr,
    HAS_PROPOSALS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = i < num_rows
    row = tl.load(index_ptr + i, mask=mask, other=0)
    request = tl.load(index_ptr + num_rows + i, mask=mask, other=0)
    source = tl.load(index_ptr + 2 * num_rows + i, mask=mask, other=0)
    proposal_row = tl.load(index_ptr + 3 * num_rows + i, mask=mask, other=0)
    offset = tl.load(index_ptr + 4 * num_rows + i, mask=mask, other=0)
    moved_back = tl.load(rejected_ptr + source, mask=mask, other=0).to(tl.int64)
    position = tl.load(positions_ptr + row, mask=mask, other=0) - moved_back
    tl.store(positions_ptr + row, position, mask=mask)
    token = tl.load(tokens_ptr + source, mask=mask, other=0).to(tl.int64)
    if HAS_PROPOSALS:
        column = tl.minimum(tl.maximum(offset - 1, 0), num_proposals - 1)
        proposal = tl.load(proposals_ptr + proposal_row * proposals_stride + column,
                           mask=mask & (offset > 0), other=0).to(tl.int64)
        token = tl.where(offset == 0, token, proposal)
    tl.store(input_ids_ptr + row, token, mask=mask)
    block = tl.load(block_table_ptr + request * block_table_stride + position // KV_BLOCK,
                    mask=mask, other=0).to(tl.int64)
    tl.store(slot_mapping_ptr + row, block * KV_BLOCK + position % KV_BLOCK, mask=mask)
    if PER_ROW:
        tl.store(seq_lens_ptr + row, (position + 1).to(tl.int32), mask=mask)
    else:
        first = mask & (offset == 0)
        seq_len = tl.load(seq_lens_ptr + request, mask=first, other=0)
        tl.store(seq_lens_ptr + request, seq_len - moved_back.to(tl.int32), mask=first)


def carry_rows(
    index: torch.Tensor,
    tokens: torch.Tensor,
    rejected: torch.Tensor,
    proposals: torch.Tensor | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    per_row: bool,
) -> None:
    """``worker/input_batch.carry_rows`` in one launch (same arguments;
    ``input_ids``, ``positions``, ``slot_mapping`` int64, ``block_table`` and
    ``seq_lens`` int32, ``proposals`` with unit column stride)."""
    num_rows = index.shape[1]
    if num_rows == 0:
        return
    index = index.contiguous()
    carry_rows_kernel[(triton.cdiv(num_rows, BLOCK),)](
        index, num_rows, tokens, rejected,
        proposals if proposals is not None else tokens,
        proposals.stride(0) if proposals is not None else 0,
        proposals.shape[1] if proposals is not None else 1,
        input_ids, positions, slot_mapping, block_table, block_table.stride(0), seq_lens,
        KV_BLOCK=block_size, PER_ROW=per_row, HAS_PROPOSALS=proposals is not None,
        BLOCK_ROWS=BLOCK,
    )
