"""Model definitions, the architecture registry and the checkpoint loader.

Models import only ``kvserve.layers``, ``kvserve.attention`` (metadata type)
and ``kvserve.config``; they know nothing of scheduling or the KV allocator.
"""

from __future__ import annotations

from kvserve.models.loader import (
    init_dummy_weights,
    iter_safetensors,
    load_model,
    resolve_dtype,
    resolve_model_config,
)
from kvserve.models.registry import CausalLM, get_model_class, supported_architectures

__all__ = [
    "CausalLM",
    "get_model_class",
    "init_dummy_weights",
    "iter_safetensors",
    "load_model",
    "resolve_dtype",
    "resolve_model_config",
    "supported_architectures",
]
