"""Pure-torch paged attention: the reference every fast backend is checked against.

Slow on purpose and easy to read: a Python loop over requests, K/V gathered
from the blocks of each request's block table, GQA by repeating K/V heads,
softmax in float32. Runs on CPU and GPU. Keep it forever as the oracle.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import FusedRope
from kvserve.attention.metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K and V at their slots; negative slots (padding) are skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached context."""
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = metadata.query_start_loc_cpu
    for i in range(metadata.num_reqs):
        q_start, q_end = starts[i], starts[i + 1]
        num_query = q_end - q_start
        if num_query == 0:
            continue
        seq_len = metadata.seq_lens_cpu[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = metadata.block_table[i, :num_blocks].long()
        # [seq_len, num_kv_heads, head_dim]
        keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        keys = keys.repeat_interleave(group, dim=1).float()
        values = values.repeat_interleave(group, dim=1).float()
        query = q[q_start:q_end].float()
        # [num_heads, num_query, seq_len]
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        query_pos = torch.arange(seq_len - num_query, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        scores.masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class TorchRefAttentionBackend:
    """The reference backend, registered as ``"torch"``."""

    name = "torch"
    supports_cuda_graphs = False  # loops over the host copies of the metadata
    fuses_rope = False  # the layer rotates q and k first, with the rotary module's torch code

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rope: FusedRope | None = None,
    ) -> torch.Tensor:
        if rope is not None:
            raise ValueError(
                "rope: the torch backend does not fuse rotary embedding (fuses_rope is False); "
                "rotate q and k before forward"
            )
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        return paged_attention_ref(q, kv_cache, metadata, scale, sliding_window)
