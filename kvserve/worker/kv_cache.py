"""Sizing and allocating the KV cache tensors, and the memory checks of start-up.

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V). The number of blocks comes from ``num_kv_blocks`` when given,
else from a memory budget: on CUDA the share ``gpu_memory_utilization`` of
the card minus what is already used (weights, context, other processes) and
the peak step the model runner profiled; on the CPU ``cpu_kv_cache_bytes``
when set, else one the model's size: as many bytes as its weights, at least
``CPU_KV_MIN_REQUESTS`` requests of ``max_model_len``, at most
``CPU_KV_MEMORY_SHARE`` of the memory still available. Either is capped at
what the sequence budget could ever use. Block 0 is the null block and
comes on top of the usable ones. When the model or one request of
``max_model_len`` cannot fit (on CUDA or in the host's memory), start-up
fails at once with the numbers and what would fit.
"""

from __future__ import annotations

import logging

import torch

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.worker.cpu_host import available_memory_bytes, total_memory_bytes

logger = logging.getLogger(__name__)

# the CPU KV pool, when sized for the model: at least this many requests of
# max_model_len (fewer if max_num_seqs is lower), at most this share of the
# memory available once the weights are loaded
CPU_KV_MIN_REQUESTS = 4
CPU_KV_MEMORY_SHARE = 0.5


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype
) -> int:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return (2 * model_config.num_layers * block_size * model_config.num_kv_heads
            * model_config.head_dim * element_bytes)


def weights_bytes(model_config: ModelConfig, dtype: torch.dtype) -> float:
    """The model's parameters in ``dtype``, counted from its config; a
    weight-only quantised linear counts its packed values, scales and zeros."""
    from kvserve.param_count import count_params

    element_bytes = torch.empty((), dtype=dtype).element_size()
    params = count_params(model_config)
    weights = float(params.total * element_bytes)
    quant = model_config.quantization
    if quant is not None:
        quantized = quant.num_quantized(params.linear, params.lm_head)
        weights -= quantized * (
            element_bytes - quant.bytes_per_weight(model_config.hidden_size, element_bytes))
    return weights


def check_weights_fit(
    model_config: ModelConfig, dtype: torch.dtype, device: torch.device, utilization: float,
    min_kv_bytes: int = 0,
) -> None:
    """Fail before loading when the weights alone exceed the device's memory
    budget (on the CPU: the weights and ``min_kv_bytes`` of KV cache exceed
    the memory available)."""
    weights = weights_bytes(model_config, dtype)
    quant = model_config.quantization
    if device.type == "cpu":
        _check_host_memory(weights, min_kv_bytes, dtype)
        return
    if device.type != "cuda":
        return
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    budget = int(total_bytes * utilization) - (total_bytes - free_bytes)
    if weights > budget:
        raise ValueError(
            f"the model's weights need {weights / 1e9:.2f} GB in {dtype}"
            f"{'' if quant is None else ' with ' + quant.name + ' linears'} but "
            f"gpu_memory_utilization={utilization} of this {total_bytes / 1e9:.1f} GB device "
            f"leaves {budget / 1e9:.2f} GB ({(total_bytes - free_bytes) / 1e9:.2f} GB already "
            "in use); use a larger device, a smaller model or a higher gpu_memory_utilization"
        )


def _check_host_memory(weights: float, min_kv_bytes: int, dtype: torch.dtype) -> None:
    available = available_memory_bytes()
    if available is None or weights + min_kv_bytes <= available:
        return
    total = total_memory_bytes()
    kv = f" plus {min_kv_bytes / 1e9:.2f} GB of KV cache for one request" if min_kv_bytes else ""
    smaller = (f", --dtype bfloat16 ({weights / 2 / 1e9:.2f} GB of weights)"
               if dtype == torch.float32 else "")
    raise ValueError(
        f"the model's weights need {weights / 1e9:.2f} GB in {dtype}{kv}, but this machine "
        f"has {available / 1e9:.2f} GB of memory available"
        f"{f' ({total / 1e9:.1f} GB in all)' if total else ''}; use a smaller model"
        f"{smaller}, a lower --max-model-len, or a machine with more memory"
    )


def cpu_kv_budget_bytes(
    model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
    dtype: torch.dtype,
) -> int:
    """The CPU KV pool's bytes when ``num_kv_blocks`` is unset (module docstring)."""
    if cache_config.cpu_kv_cache_bytes is not None:
        return cache_config.cpu_kv_cache_bytes
    request_bytes = (-(-scheduler_config.max_model_len // cache_config.block_size)
                     * kv_bytes_per_block(model_config, cache_config.block_size, dtype))
    min_requests = min(CPU_KV_MIN_REQUESTS, scheduler_config.max_num_seqs)
    budget = max(int(weights_bytes(model_config, dtype)), min_requests * request_bytes)
    available = available_memory_bytes()
    if available is not None:
        budget = min(budget, int(available * CPU_KV_MEMORY_SHARE))
    return budget


def determine_num_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    reserved_bytes: int = 0,
) -> int:
    """Usable blocks (the null block not counted); ``reserved_bytes`` is the
    profiled transient memory of the largest step, kept out of the pool."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    block_bytes = kv_bytes_per_block(model_config, cache_config.block_size, dtype)
    blocks_per_request = -(-scheduler_config.max_model_len // cache_config.block_size)
    max_useful = blocks_per_request * scheduler_config.max_num_seqs
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used_bytes = total_bytes - free_bytes
        budget = int(total_bytes * cache_config.gpu_memory_utilization) - used_bytes
        budget -= reserved_bytes
    else:
        budget = cpu_kv_budget_bytes(model_config, cache_config, scheduler_config, dtype)
    num_blocks = min(budget // block_bytes, max_useful)
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"the KV cache budget ({budget / 1e9:.2f} GB) holds {max(num_blocks, 0)} blocks "
            f"of {cache_config.block_size} tokens; one request of max_model_len="
            f"{scheduler_config.max_model_len} needs {blocks_per_request}. Lower max_model_len "
            f"to at most {max(num_blocks, 0) * cache_config.block_size} or give more memory"
        )
    return int(num_blocks)


def min_kv_cache_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """The KV cache one request of ``max_model_len`` needs (or ``num_kv_blocks`` when set)."""
    cache = config.cache_config
    blocks = (cache.num_kv_blocks if cache.num_kv_blocks is not None
              else -(-config.scheduler_config.max_model_len // cache.block_size))
    return blocks * kv_bytes_per_block(config.model_config, cache.block_size, dtype)


def allocate_kv_caches(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    reserved_bytes: int = 0,
) -> tuple[list[torch.Tensor], int]:
    """Per-layer KV tensors and the number of usable blocks."""
    num_blocks = determine_num_blocks(model_config, cache_config, scheduler_config, device, dtype,
                                      reserved_bytes)
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
