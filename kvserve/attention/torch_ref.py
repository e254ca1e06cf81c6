"""Pure-torch paged attention: the reference every fast backend is checked against.

Slow on purpose and easy to read: a Python loop over requests, K/V gathered
from the blocks of each request's block table (dequantised to float32 from
an fp8 or int8 cache, ``kv_quant.py``), GQA by repeating K/V heads, softmax
in float32. Runs on CPU and GPU. Keep it forever as the oracle.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import FusedRope
from kvserve.attention.kv_quant import dequantize_kv, quantize_kv
from kvserve.attention.metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,  # an fp8 or int8 cache's (kernels/kv_quant.py)
) -> None:
    """Store the new tokens' K and V at their slots, cast or quantised (an int8
    cache's scales at the same slots of ``kv_scales``); negative slots (padding)
    are skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    num_kv_heads = kv_cache.shape[3]
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, kv_cache.shape[4])
    if flat.dtype == torch.float8_e4m3fn:  # CPU torch has no fp8 index_copy_: copy the bytes
        flat = flat.view(torch.uint8)
    fp8_scales = kv_scales if kv_cache.dtype == torch.float8_e4m3fn else None
    for i, x in enumerate((k, v)):
        values, scales = quantize_kv(x, kv_cache.dtype,
                                     None if fp8_scales is None else fp8_scales[i])
        flat[i].index_copy_(0, slot_mapping, values.view(flat.dtype))
        if scales is not None:
            assert kv_scales is not None, "an int8 cache needs its kv_scales"
            kv_scales[i].view(-1, num_kv_heads).index_copy_(0, slot_mapping, scales)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    kv_scales: torch.Tensor | None = None,  # an fp8 or int8 cache's (kernels/kv_quant.py)
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
        # [seq_len, num_kv_heads, head_dim] float32
        keys, values = (
            dequantize_kv(kv_cache[i, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len],
                          _scales_of(kv_cache, kv_scales, i, blocks, seq_len))
            for i in (0, 1))
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
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


def _scales_of(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, i: int,
               blocks: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """K's (``i`` 0) or V's scales for a request's context: an fp8 cache's per
    head, an int8 cache's ``[seq_len, num_kv_heads]`` per token; else None."""
    if kv_scales is None:
        return None
    if kv_cache.dtype == torch.int8:
        return kv_scales[i, blocks].reshape(-1, kv_cache.shape[3])[:seq_len]
    return kv_scales[i]


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
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if rope is not None:
            raise ValueError(
                "rope: the torch backend does not fuse rotary embedding (fuses_rope is False); "
                "rotate q and k before forward"
            )
        write_kv(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        return paged_attention_ref(q, kv_cache, metadata, scale, sliding_window, kv_scales)
