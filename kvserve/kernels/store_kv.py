"""The KV write kernel: stores each new token's K and V into the paged cache
at its slot (``slot = block_id * block_size + offset``, from the metadata's
slot mapping), cast to the cache dtype or quantised into an fp8 or int8 cache
(``kv_quant.py``; an int8 write also stores each head vector's scale).
Negative slots are skipped, so padded tokens (CUDA-graph batches) write
nothing. It owns no allocation and never reads the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.kv_quant import (
    QUANTISED_DTYPES,
    check_kv_scales,
    kv_quant_mode,
    scale_index,
    scale_pointers,
    store_kv_row,
)

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *QUANTISED_DTYPES)


@triton.jit
def store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # float32 kv_scales[0] (kv_quant.py), read only when quantised
    v_scale_ptr,  # float32 kv_scales[1]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KV_QUANT: tl.constexpr,  # kv_quant.KV_NONE, KV_FP8 or KV_INT8
):
    token_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    cache_offset = (
        block_id * stride_cache_block + block_offset * stride_cache_slot
        + kv_head * stride_cache_head + dims
    )
    key = tl.load(k_ptr + token_idx * stride_k_token + kv_head * stride_k_head + dims,
                  mask=dim_mask)
    value = tl.load(v_ptr + token_idx * stride_v_token + kv_head * stride_v_head + dims,
                    mask=dim_mask)
    scale_idx = scale_index(block_id, block_offset, kv_head, stride_scale_slot, BLOCK_SIZE,
                            KV_QUANT)
    store_kv_row(key, k_cache_ptr + cache_offset, k_scale_ptr + scale_idx, dim_mask, KV_QUANT)
    store_kv_row(value, v_cache_ptr + cache_offset, v_scale_ptr + scale_idx, dim_mask, KV_QUANT)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """Raise ValueError unless ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]`` of a supported dtype with a unit-stride last dimension."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache: shape {tuple(kv_cache.shape)}; expected "
            "[2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache: dtype {kv_cache.dtype}; allowed: {CACHE_DTYPES}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache: last-dimension stride {kv_cache.stride(-1)}; must be 1")


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_scales: torch.Tensor | None = None,  # an fp8 or int8 cache's (kv_quant.py)
) -> None:
    """Write ``k`` and ``v`` into ``kv_cache`` at ``slot_mapping``, cast to the cache
    dtype or quantised (an int8 cache's scales written into ``kv_scales``)."""
    check_kv_cache(kv_cache)
    check_kv_scales(kv_cache, kv_scales)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, tensor in (("k", k), ("v", v)):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"store_kv: {name} has shape {tuple(tensor.shape)}; expected "
                f"[num_tokens, num_kv_heads, head_dim] = {list(expected)}"
            )
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"store_kv: {name} last-dimension stride {tensor.stride(-1)}; must be 1"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"store_kv: {name} dtype {tensor.dtype} is not floating point")
        if tensor.device != kv_cache.device:
            raise ValueError(
                f"store_kv: {name} on {tensor.device} but kv_cache on {kv_cache.device}"
            )
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError(
            f"store_kv: slot_mapping must be 1-D int64; got {slot_mapping.dtype} "
            f"of shape {tuple(slot_mapping.shape)}"
        )
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scales, v_scales, stride_scale_slot = scale_pointers(kv_cache, kv_scales)
    store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_scale_slot,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_QUANT=kv_quant_mode(kv_cache.dtype),
    )
