"""The Triton attention backend, registered as ``"triton"``: the default on CUDA.

Each layer call writes the step's new K/V into the paged cache, then runs
the attention kernels. The write is ``store_kv``, or,
when the layer hands over its rotary embedding (``rope``), ``rope_store_kv``:
one launch that rotates q in place and stores the rotated k with v, leaving
the same bits as ``apply_rotary`` then ``store_kv`` with a launch fewer per
layer. In a decode step (every request one new token) with full rotary,
``decode_attention`` does that work itself (``new_kv``), one launch a layer
in all (not in a verify step laid out one token per row, ``metadata.verify``,
whose rows read each other's new KV: it stores first). Then:

- ``decode_attention`` (split-K, flash-decoding) for every request with one
  new token, so long contexts at small batch still fill the GPU; that is the
  whole batch of a decode step (``max_query_len == 1``);
- in any other step also ``prefill_attention`` for the requests with more,
  told to skip the others: a mixed step's decodes (most of its attention's
  reads at large batch) keep the decode kernel, whose one-token tiles do a
  fraction of the prefill kernel's work per position. Both kernels take the
  whole batch and pick their rows on the device, so the batch needs no
  reordering and a CUDA graph of the step holds for any mix.

An fp8 or int8 cache comes with its scales (``kv_scales``): every write
above quantises into it and both kernels dequantise as they read.

The choice reads only host ints of the metadata; nothing here synchronises
with the device. Kernels live in ``kvserve/kernels``; this module owns only
the dispatch.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import FusedRope
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kernels.paged_attention import (
    NewKV,
    decode_attention,
    fuses_new_kv,
    prefill_attention,
)
from kvserve.kernels.rope_store_kv import rope_store_kv
from kvserve.kernels.store_kv import store_kv


class TritonAttentionBackend:
    """Paged attention with Triton kernels, registered as ``"triton"``."""

    name = "triton"
    supports_cuda_graphs = True
    fuses_rope = True

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rope: FusedRope | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
        if (rope is not None and metadata.max_query_len == 1 and not metadata.verify
                and fuses_new_kv(q.shape[-1], rope.rotary_dim)):
            # a decode step: the decode kernel rotates and writes the new KV itself
            return decode_attention(
                q, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
                metadata.max_seq_len, scale, sliding_window,
                new_kv=NewKV(k, v, metadata.slot_mapping, rope.cos_sin_cache),
                kv_scales=kv_scales,
            )
        if rope is None:
            store_kv(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        else:
            rope_store_kv(q, k, v, kv_cache, metadata.slot_mapping, rope.positions,
                          rope.cos_sin_cache, rope.rotary_dim, kv_scales)
        out = None
        if metadata.max_query_len > 1:
            out = prefill_attention(
                q, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
                metadata.max_query_len, scale, sliding_window, skip_decodes=True,
                kv_scales=kv_scales,
            )
        return decode_attention(
            q, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
            metadata.max_seq_len, scale, sliding_window, out=out, kv_scales=kv_scales,
        )


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
