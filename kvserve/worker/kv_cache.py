"""Sizing and allocating the KV cache tensors.

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V). The number of blocks comes from ``num_kv_blocks`` when given,
else from a memory budget: on CUDA the share ``gpu_memory_utilization`` of
the card minus what weights and a profiled peak step already take, on CPU
``cpu_kv_cache_bytes`` capped at what the sequence budget could ever use.
Block 0 is the null block and comes on top of the usable ones.
"""

from __future__ import annotations

import logging

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig

logger = logging.getLogger(__name__)


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype
) -> int:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return (2 * model_config.num_layers * block_size * model_config.num_kv_heads
            * model_config.head_dim * element_bytes)


def determine_num_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Usable blocks (the null block not counted)."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    block_bytes = kv_bytes_per_block(model_config, cache_config.block_size, dtype)
    blocks_per_request = -(-scheduler_config.max_model_len // cache_config.block_size)
    max_useful = blocks_per_request * scheduler_config.max_num_seqs
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        budget = int(total_bytes * cache_config.gpu_memory_utilization) - used_bytes
        # room for the activations of the largest step
        budget -= _activation_reserve_bytes(model_config, scheduler_config, dtype)
    else:
        budget = cache_config.cpu_kv_cache_bytes
    num_blocks = min(budget // block_bytes, max_useful)
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"the KV cache budget ({budget / 1e9:.2f} GB) holds {max(num_blocks, 0)} blocks "
            f"of {cache_config.block_size} tokens; one request of max_model_len="
            f"{scheduler_config.max_model_len} needs {blocks_per_request}. Lower max_model_len "
            f"to at most {max(num_blocks, 0) * cache_config.block_size} or give more memory"
        )
    return int(num_blocks)


def _activation_reserve_bytes(
    model_config: ModelConfig, scheduler_config: SchedulerConfig, dtype: torch.dtype
) -> int:
    """A generous estimate of one step's transient memory: the widest
    activations of ``max_num_batched_tokens`` tokens plus float32 logits."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    tokens = scheduler_config.max_num_batched_tokens
    width = (model_config.num_heads + 2 * model_config.num_kv_heads) * model_config.head_dim
    width = max(width, 2 * model_config.intermediate_size, model_config.hidden_size)
    logits = scheduler_config.max_num_seqs * model_config.vocab_size * 4
    return 4 * tokens * width * element_bytes + 2 * logits


def allocate_kv_caches(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[list[torch.Tensor], int]:
    """Per-layer KV tensors and the number of usable blocks."""
    num_blocks = determine_num_blocks(model_config, cache_config, scheduler_config, device, dtype)
    shape = (2, num_blocks + 1, cache_config.block_size, model_config.num_kv_heads,
             model_config.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device)
              for _ in range(model_config.num_layers)]
    block_bytes = kv_bytes_per_block(model_config, cache_config.block_size, dtype)
    logger.info(
        "KV cache: %d blocks of %d tokens (%.3f GB, %d tokens)",
        num_blocks, cache_config.block_size, num_blocks * block_bytes / 1e9,
        num_blocks * cache_config.block_size,
    )
    return caches, num_blocks
