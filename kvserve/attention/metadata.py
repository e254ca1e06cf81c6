"""Per-step attention metadata, built once by the model runner and read by
every attention layer of that step.

The batch is flattened (selective batching): the scheduled tokens of all
requests lie in one ``[num_tokens, ...]`` tensor, request ``i`` owning rows
``query_start_loc[i]:query_start_loc[i + 1]``. Its KV lives in the paged
cache at the blocks of ``block_table[i]``; the new tokens' KV is written to
``slot_mapping`` (slot = block_id * block_size + offset).

A speculative verify step may be laid out one query token per row
(``verify``): row ``i`` is then token ``i`` alone, with ``seq_lens[i]`` its
position + 1, so the causal mask over a request's ``1 + k`` new tokens is
the decode kernel's context bound; the rows of one request read each
other's new KV, so a backend writes the KV of every row before any attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What an attention backend needs to run one step."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: KV length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    # host copies, so reference code never synchronises with the device
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # one query token per row of a verify step (see above): no fused KV write
    verify: bool = False
