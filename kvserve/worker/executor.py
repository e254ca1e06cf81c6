"""Builds the in-process executor (one ``ModelRunner`` on one device) from an
``EngineConfig``: picks the device and dtype, loads the model, sizes the KV
cache. Tensor/pipeline-parallel executors will live beside it."""

from __future__ import annotations

import logging
import time

import torch

from kvserve.config import EngineConfig
from kvserve.models.loader import resolve_dtype
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid: no CUDA device is available; use 'cpu'")
    return torch.device(name)


def create_model_runner(config: EngineConfig) -> ModelRunner:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, config.model_config, device)
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    runner = ModelRunner.create(
        config.model_config,
        config.cache_config,
        config.scheduler_config,
        config.model_path,
        config.load_format,
        device,
        dtype,
        config.seed,
        config.attention_backend,
        config.lora_config,
    )
    logger.info("model %s loaded on %s in %s in %.1f s", config.model, device, dtype,
                time.perf_counter() - start)
    return runner
