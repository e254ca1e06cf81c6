"""Builds the in-process executor (one ``ModelRunner`` on one device) from an
``EngineConfig``: picks the device and dtype (and on the CPU torch's thread
count, ``cpu_host.py``), loads the model, sizes the KV cache. The tensor /
pipeline-parallel one is ``multiproc_executor.py``."""

from __future__ import annotations

import logging
import time

import torch

from kvserve.config import EngineConfig
from kvserve.models.loader import resolve_dtype
from kvserve.worker.cpu_host import configure_cpu_threads
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
    if device.type == "cpu":
        configure_cpu_threads(config.num_cpu_threads)
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    runner = ModelRunner.create(config, device, dtype)
    logger.info("model %s ready on %s in %s in %.1f s (%s attention, %s)", config.model, device,
                dtype, time.perf_counter() - start, config.attention_backend,
                f"CUDA graphs for {len(runner.cuda_graph_sizes)} decode sizes"
                if runner.cuda_graph_sizes else "eager")
    return runner
