"""Sizing and allocating the KV cache tensors, and the memory checks of start-up.

One tensor per attention layer the process holds, ``[2, num_blocks,
block_size, num_kv_heads, head_dim]`` (K then V; with tensor or pipeline
parallelism, this rank's layers and KV heads: ``KVCacheSpec``), in the
model's dtype or, with ``kv_cache_dtype`` fp8_e4m3 or int8, quantised
(``kernels/kv_quant.py``) with one float32 scales tensor per layer beside it:
``[2, num_kv_heads]`` for fp8 (the checkpoint's, else 1.0), ``[2,
num_blocks, block_size, num_kv_heads]`` for int8 (per token, counted in the
block's bytes). The number
of blocks comes from ``num_kv_blocks`` when given, else from a memory
budget: on CUDA the share ``gpu_memory_utilization`` of the card minus what
is already used (weights, context, other processes) and the peak step the
model runner profiled; on the CPU ``cpu_kv_cache_bytes`` when set, else one
the model's size: as many bytes as its weights, at least
``CPU_KV_MIN_REQUESTS`` requests of ``max_model_len``, at most
``CPU_KV_MEMORY_SHARE`` of the memory still available. Either is capped at
what the sequence budget could ever use; parallel ranks then agree on the
smallest count. Block 0 is the null block and comes on top of the usable
ones. When the model or one request of ``max_model_len`` cannot fit (on CUDA
or in the host's memory), start-up fails at once with the numbers and what
would fit (with several ranks: the smallest tensor / pipeline sizes that
would).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.attention.kv_quant import KV_CACHE_DTYPES
from kvserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvserve.distributed.sharding import (
    describe_sizes,
    max_rank_bytes,
    smallest_fitting_sizes,
)
from kvserve.layers.attention import get_attention_layers
from kvserve.worker.cpu_host import available_memory_bytes, total_memory_bytes

logger = logging.getLogger(__name__)

# the CPU KV pool, when sized for the model: at least this many requests of
# max_model_len (fewer if max_num_seqs is lower), at most this share of the
# memory available once the weights are loaded
CPU_KV_MIN_REQUESTS = 4
CPU_KV_MEMORY_SHARE = 0.5
SCALE_DTYPE = torch.float32  # a quantised cache's scales


def kv_cache_dtype(cache_config: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's ``dtype`` for "auto", else quantised."""
    if cache_config.kv_cache_dtype == "auto":
        return dtype
    return KV_CACHE_DTYPES[cache_config.kv_cache_dtype]


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache one process holds: its attention layers, and their KV heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: nn.Module) -> KVCacheSpec:
        """The spec of a built model's attention layers (this rank's)."""
        layers = get_attention_layers(model)
        if not layers:
            raise ValueError("the model has no attention layers")
        first = layers[0]
        return cls(len(layers), first.num_kv_heads, first.head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block over this process's layers in a cache of ``dtype``,
        an int8 cache's per-token scales included."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        per_token_head = self.head_dim * element_bytes
        if dtype == torch.int8:
            per_token_head += SCALE_DTYPE.itemsize
        return 2 * self.num_layers * block_size * self.num_kv_heads * per_token_head


def _budget_bytes(device: torch.device, utilization: float) -> tuple[int, int, int]:
    """(budget, total, in use) of a CUDA device at ``utilization``."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used = total_bytes - free_bytes
    return int(total_bytes * utilization) - used, total_bytes, used


def check_weights_fit(
    model_config: ModelConfig, dtype: torch.dtype, device: torch.device, utilization: float,
    parallel: ParallelConfig | None = None, max_model_len: int = 0,
) -> None:
    """Fail before loading when this rank's weights (with ``parallel``: its share)
    exceed the memory budget, naming the smallest tensor / pipeline sizes at
    which the weights and one request of ``max_model_len`` would fit. On the
    CPU the weights and that request's KV must fit the memory available."""
    parallel = parallel or ParallelConfig()
    element_bytes = torch.empty((), dtype=dtype).element_size()
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    weights = weights_bytes(model_config, dtype, parallel)
    if device.type == "cpu":
        kv = max_rank_bytes(model_config, element_bytes, tp, pp, max_model_len) - weights
        _check_host_memory(weights, kv, dtype)
        return
    if device.type != "cuda":
        return
    budget, total_bytes, used = _budget_bytes(device, utilization)
    if weights <= budget:
        return
    quant = model_config.quantization
    where = ("" if parallel.world_size == 1 else
             f" per rank at tensor_parallel_size={tp} x pipeline_parallel_size={pp}")
    fits = smallest_fitting_sizes(model_config, element_bytes, budget, max_model_len)
    raise ValueError(
        f"the model's weights need {weights / 1e9:.2f} GB{where} in {dtype}"
        f"{'' if quant is None else ' with ' + quant.name + ' linears'} but "
        f"gpu_memory_utilization={utilization} of this {total_bytes / 1e9:.1f} GB device "
        f"leaves {budget / 1e9:.2f} GB ({used / 1e9:.2f} GB already in use). "
        + (f"With one request of max_model_len={max_model_len} it would fit at "
           f"{describe_sizes(fits)} on such devices; or use" if fits else "Use")
        + " a larger device, a smaller model or a higher gpu_memory_utilization"
    )


def _check_host_memory(weights: float, kv_bytes: float, dtype: torch.dtype) -> None:
    available = available_memory_bytes()
    if available is None or weights + kv_bytes <= available:
        return
    total = total_memory_bytes()
    kv = f" plus {kv_bytes / 1e9:.2f} GB of KV cache for one request" if kv_bytes else ""
    smaller = (f", --dtype bfloat16 ({weights / 2 / 1e9:.2f} GB of weights)"
               if dtype == torch.float32 else "")
    raise ValueError(
        f"the model's weights need {weights / 1e9:.2f} GB in {dtype}{kv}, but this machine "
        f"has {available / 1e9:.2f} GB of memory available"
        f"{f' ({total / 1e9:.1f} GB in all)' if total else ''}; use a smaller model"
        f"{smaller}, a lower --max-model-len, or a machine with more memory"
    )


def weights_bytes(model_config: ModelConfig, dtype: torch.dtype,
                  parallel: ParallelConfig | None = None) -> float:
    """The weights the most loaded rank holds, counted from the config
    (quantised linears: their packed values, scales and zeros)."""
    parallel = parallel or ParallelConfig()
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return max_rank_bytes(model_config, element_bytes, parallel.tensor_parallel_size,
                          parallel.pipeline_parallel_size, 0)


def cpu_kv_budget_bytes(
    weights: float, spec: KVCacheSpec, cache_config: CacheConfig,
    scheduler_config: SchedulerConfig, dtype: torch.dtype,
) -> int:
    """The CPU KV pool's bytes when ``num_kv_blocks`` is unset (module
    docstring); ``weights``: the bytes of this process's weights."""
    if cache_config.cpu_kv_cache_bytes is not None:
        return cache_config.cpu_kv_cache_bytes
    request_bytes = (-(-scheduler_config.max_model_len // cache_config.block_size)
                     * spec.bytes_per_block(cache_config.block_size, dtype))
    min_requests = min(CPU_KV_MIN_REQUESTS, scheduler_config.max_num_seqs)
    budget = max(int(weights), min_requests * request_bytes)
    available = available_memory_bytes()
    if available is not None:
        budget = min(budget, int(available * CPU_KV_MEMORY_SHARE))
    return budget


def determine_num_blocks(
    spec: KVCacheSpec,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    reserved_bytes: int = 0,
    weights: float = 0.0,
    extra_block_bytes: int = 0,
) -> int:
    """Usable blocks the budget holds (the null block not counted; possibly too
    few for one request: ``check_num_blocks`` says so); ``reserved_bytes`` is
    the profiled transient memory of the largest step, kept out of the pool;
    ``weights`` the bytes of this process's weights (the CPU pool's size);
    ``extra_block_bytes`` what each block costs beyond the model's KV (a
    speculative proposer's KV at the same block ids)."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    block_bytes = spec.bytes_per_block(cache_config.block_size, dtype) + extra_block_bytes
    blocks_per_request = -(-scheduler_config.max_model_len // cache_config.block_size)
    max_useful = blocks_per_request * scheduler_config.max_num_seqs
    if device.type == "cuda":
        budget, _, _ = _budget_bytes(device, cache_config.gpu_memory_utilization)
        budget -= reserved_bytes
    else:
        budget = cpu_kv_budget_bytes(weights, spec, cache_config, scheduler_config, dtype)
    return int(max(0, min(budget // block_bytes, max_useful)))


def check_num_blocks(num_blocks: int, spec: KVCacheSpec, cache_config: CacheConfig,
                     scheduler_config: SchedulerConfig, dtype: torch.dtype) -> None:
    """ValueError when ``num_blocks`` cannot hold one request of ``max_model_len``."""
    blocks_per_request = -(-scheduler_config.max_model_len // cache_config.block_size)
    if num_blocks >= blocks_per_request:
        return
    block_bytes = spec.bytes_per_block(cache_config.block_size, dtype)
    raise ValueError(
        f"the KV cache budget ({num_blocks * block_bytes / 1e9:.2f} GB) holds {num_blocks} "
        f"blocks of {cache_config.block_size} tokens; one request of max_model_len="
        f"{scheduler_config.max_model_len} needs {blocks_per_request}. Lower max_model_len "
        f"to at most {num_blocks * cache_config.block_size} or give more memory (or more "
        "tensor / pipeline-parallel ranks, which split the KV cache)"
    )


def allocate_kv_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    model_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Per-layer KV tensors of ``dtype`` (the cache's) with ``num_blocks`` usable
    blocks (plus the null block); a quantised cache's log line compares its
    capacity with ``model_dtype``'s."""
    shape = (2, num_blocks + 1, cache_config.block_size, spec.num_kv_heads, spec.head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    block_bytes = spec.bytes_per_block(cache_config.block_size, dtype)
    max_tokens = num_blocks * cache_config.block_size
    gain = ""
    if model_dtype is not None and model_dtype != dtype:
        ratio = spec.bytes_per_block(1, model_dtype) / spec.bytes_per_block(1, dtype)
        gain = f", {ratio:.2f}x the tokens of {_describe(model_dtype)} in the same memory"
    logger.info(
        "KV cache: %d blocks of %d tokens in %s, %.2f GB, %d tokens at most "
        "(%.1f requests of max_model_len=%d at once%s)",
        num_blocks, cache_config.block_size, _describe(dtype), num_blocks * block_bytes / 1e9,
        max_tokens, max_tokens / scheduler_config.max_model_len, scheduler_config.max_model_len,
        gain,
    )
    return caches


def _describe(dtype: torch.dtype) -> str:
    return {torch.int8: "int8 (a float32 scale per token and KV head)",
            torch.float8_e4m3fn: "fp8_e4m3 (a float32 scale per layer and KV head)"}.get(
                dtype, str(dtype).removeprefix("torch."))


def allocate_kv_scales(
    spec: KVCacheSpec, model: nn.Module, dtype: torch.dtype, num_blocks: int, block_size: int,
    device: torch.device,
) -> list[torch.Tensor] | None:
    """Per-layer scales of a cache of ``dtype`` with ``num_blocks`` blocks (the
    null block included), or None for a 16- or 32-bit cache. fp8: each
    attention layer's ``checkpoint_kv_scales`` ([2, num_kv_heads], from the
    loader), or 1.0 where it has none; int8: zeros, written with the values."""
    if dtype == torch.int8:
        shape = (2, num_blocks, block_size, spec.num_kv_heads)
        return [torch.zeros(shape, dtype=SCALE_DTYPE, device=device)
                for _ in range(spec.num_layers)]
    if dtype == torch.float8_e4m3fn:
        ones = torch.ones((2, spec.num_kv_heads), dtype=SCALE_DTYPE)
        return [(ones if layer.checkpoint_kv_scales is None else layer.checkpoint_kv_scales)
                .to(device=device, dtype=SCALE_DTYPE) for layer in get_attention_layers(model)]
    return None


def log_kv_scales(model: nn.Module, dtype: torch.dtype) -> None:
    """Say where an fp8 cache's scales come from, or that a checkpoint's go unused."""
    has_scales = any(layer.checkpoint_kv_scales is not None
                     for layer in get_attention_layers(model))
    if dtype == torch.float8_e4m3fn:
        logger.info("fp8 KV cache scales: %s", "the checkpoint's k/v scales"
                    if has_scales else "1.0 (the checkpoint has none)")
    elif has_scales:
        logger.info("the checkpoint's k/v scales are unused: they serve kv_cache_dtype="
                    "'fp8_e4m3', not a %s cache", _describe(dtype))


def allocate_scratch_kv_caches(
    spec: KVCacheSpec, cache_config: CacheConfig, device: torch.device, dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One null block and one usable block per layer, for a profiling step."""
    shape = (2, 2, cache_config.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
