"""Sizing and allocating the KV cache tensors, and the memory checks of start-up.

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V). The number of blocks comes from ``num_kv_blocks`` when given,
else from a memory budget: on CUDA the share ``gpu_memory_utilization`` of
the card minus what is already used (weights, context, other processes) and
the peak step the model runner profiled, on CPU ``cpu_kv_cache_bytes``;
either is capped at what the sequence budget could ever use. Block 0 is the
null block and comes on top of the usable ones. When the model or one
request of ``max_model_len`` cannot fit, start-up fails at once with the
numbers and what would fit.
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


def check_weights_fit(
    model_config: ModelConfig, dtype: torch.dtype, device: torch.device, utilization: float
) -> None:
    """Fail before loading when the weights alone exceed the memory budget."""
    if device.type != "cuda":
        return
    from kvserve.plan.planner import count_params

    element_bytes = torch.empty((), dtype=dtype).element_size()
    weights = count_params(model_config).total * element_bytes
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    budget = int(total_bytes * utilization) - (total_bytes - free_bytes)
    if weights > budget:
        raise ValueError(
            f"the model's weights need {weights / 1e9:.2f} GB in {dtype} but "
            f"gpu_memory_utilization={utilization} of this {total_bytes / 1e9:.1f} GB device "
            f"leaves {budget / 1e9:.2f} GB ({(total_bytes - free_bytes) / 1e9:.2f} GB already "
            "in use); use a larger device, a smaller model or a higher gpu_memory_utilization"
        )


def determine_num_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    reserved_bytes: int = 0,
    extra_block_bytes: int = 0,
) -> int:
    """Usable blocks (the null block not counted); ``reserved_bytes`` is the
    profiled transient memory of the largest step, kept out of the pool;
    ``extra_block_bytes`` what each block costs beyond the model's KV (a
    speculative proposer's KV at the same block ids)."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    block_bytes = (kv_bytes_per_block(model_config, cache_config.block_size, dtype)
                   + extra_block_bytes)
    blocks_per_request = -(-scheduler_config.max_model_len // cache_config.block_size)
    max_useful = blocks_per_request * scheduler_config.max_num_seqs
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        budget = int(total_bytes * cache_config.gpu_memory_utilization) - used_bytes
        budget -= reserved_bytes
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


def allocate_kv_caches(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    reserved_bytes: int = 0,
    extra_block_bytes: int = 0,
) -> tuple[list[torch.Tensor], int]:
    """Per-layer KV tensors and the number of usable blocks."""
    num_blocks = determine_num_blocks(model_config, cache_config, scheduler_config, device, dtype,
                                      reserved_bytes, extra_block_bytes)
    shape = (2, num_blocks + 1, cache_config.block_size, model_config.num_kv_heads,
             model_config.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device)
              for _ in range(model_config.num_layers)]
    block_bytes = kv_bytes_per_block(model_config, cache_config.block_size, dtype)
    max_tokens = num_blocks * cache_config.block_size
    logger.info(
        "KV cache: %d blocks of %d tokens, %.2f GB, %d tokens at most "
        "(%.1f requests of max_model_len=%d at once)",
        num_blocks, cache_config.block_size, num_blocks * block_bytes / 1e9, max_tokens,
        max_tokens / scheduler_config.max_model_len, scheduler_config.max_model_len,
    )
    return caches, num_blocks


def allocate_scratch_kv_caches(
    model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One null block and one usable block per layer, for a profiling step."""
    shape = (2, 2, cache_config.block_size, model_config.num_kv_heads, model_config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(model_config.num_layers)]
