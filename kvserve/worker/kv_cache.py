"""Sizing and allocating the KV cache tensors, and the memory checks of start-up.

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V), in the model's dtype or, with ``kv_cache_dtype`` fp8_e4m3 or
int8, quantised (``kernels/kv_quant.py``), with one float32 scales tensor
per layer beside it: ``[2, num_kv_heads]`` for fp8 (the checkpoint's, else
1.0), ``[2, num_blocks, block_size, num_kv_heads]`` for int8 (per token,
counted in the block's bytes). The number of blocks comes from ``num_kv_blocks`` when given,
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
from collections.abc import Sequence

import torch

from kvserve.attention.kv_quant import KV_CACHE_DTYPES
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig

logger = logging.getLogger(__name__)

SCALE_DTYPE = torch.float32


def kv_cache_dtype(cache_config: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's ``dtype`` for "auto", else quantised."""
    if cache_config.kv_cache_dtype == "auto":
        return dtype
    return KV_CACHE_DTYPES[cache_config.kv_cache_dtype]


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block over all layers in a cache of ``dtype``, an int8
    cache's per-token scales included."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    per_token_head = model_config.head_dim * element_bytes
    if dtype == torch.int8:
        per_token_head += SCALE_DTYPE.itemsize
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * per_token_head


def check_weights_fit(
    model_config: ModelConfig, dtype: torch.dtype, device: torch.device, utilization: float
) -> None:
    """Fail before loading when the weights alone exceed the memory budget."""
    if device.type != "cuda":
        return
    from kvserve.param_count import count_params

    element_bytes = torch.empty((), dtype=dtype).element_size()
    params = count_params(model_config)
    weights = float(params.total * element_bytes)
    quant = model_config.quantization
    if quant is not None:
        quantized = quant.num_quantized(params.linear, params.lm_head)
        weights -= quantized * (
            element_bytes - quant.bytes_per_weight(model_config.hidden_size, element_bytes))
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
    model_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Per-layer KV tensors of ``dtype`` (the cache's) and the number of usable
    blocks; a quantised cache's log line compares it with ``model_dtype``'s."""
    num_blocks = determine_num_blocks(model_config, cache_config, scheduler_config, device, dtype,
                                      reserved_bytes)
    shape = (2, num_blocks + 1, cache_config.block_size, model_config.num_kv_heads,
             model_config.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device)
              for _ in range(model_config.num_layers)]
    block_bytes = kv_bytes_per_block(model_config, cache_config.block_size, dtype)
    max_tokens = num_blocks * cache_config.block_size
    gain = ""
    if model_dtype is not None and model_dtype != dtype:
        ratio = kv_bytes_per_block(model_config, 1, model_dtype) / kv_bytes_per_block(
            model_config, 1, dtype)
        gain = f", {ratio:.2f}x the tokens of {_describe(model_dtype)} in the same memory"
    logger.info(
        "KV cache: %d blocks of %d tokens in %s, %.2f GB, %d tokens at most "
        "(%.1f requests of max_model_len=%d at once%s)",
        num_blocks, cache_config.block_size, _describe(dtype), num_blocks * block_bytes / 1e9,
        max_tokens, max_tokens / scheduler_config.max_model_len, scheduler_config.max_model_len,
        gain,
    )
    return caches, num_blocks


def _describe(dtype: torch.dtype) -> str:
    return {torch.int8: "int8 (a float32 scale per token and KV head)",
            torch.float8_e4m3fn: "fp8_e4m3 (a float32 scale per layer and KV head)"}.get(
                dtype, str(dtype).removeprefix("torch."))


def allocate_kv_scales(
    model_config: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int,
    device: torch.device, checkpoint_scales: Sequence[torch.Tensor | None],
) -> list[torch.Tensor] | None:
    """Per-layer scales of a cache of ``dtype`` with ``num_blocks`` blocks (the
    null block included), or None for a 16- or 32-bit cache. fp8: each
    layer's ``checkpoint_scales`` ([2, num_kv_heads], from the loader), or
    1.0 where it has none; int8: zeros, written with the values."""
    if dtype == torch.int8:
        shape = (2, num_blocks, block_size, model_config.num_kv_heads)
        return [torch.zeros(shape, dtype=SCALE_DTYPE, device=device)
                for _ in range(model_config.num_layers)]
    if dtype == torch.float8_e4m3fn:
        ones = torch.ones((2, model_config.num_kv_heads), dtype=SCALE_DTYPE)
        return [(ones if scales is None else scales).to(device=device, dtype=SCALE_DTYPE)
                for scales in checkpoint_scales]
    return None


def allocate_scratch_kv_caches(
    model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One null block and one usable block per layer, for a profiling step."""
    shape = (2, 2, cache_config.block_size, model_config.num_kv_heads, model_config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(model_config.num_layers)]
