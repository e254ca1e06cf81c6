"""The KV write kernel: stores each new token's K and V into the paged cache
at its slot (``slot = block_id * block_size + offset``, from the metadata's
slot mapping). Negative slots are skipped, so padded tokens (CUDA-graph
batches) write nothing. It owns no allocation and never reads the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
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
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=dim_mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=dim_mask)


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
) -> None:
    """Write ``k`` and ``v`` into ``kv_cache`` at ``slot_mapping`` (cast to the cache dtype)."""
    check_kv_cache(kv_cache)
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
    store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
