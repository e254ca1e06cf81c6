"""Quantised checkpoints as their producers write them: GPTQ (GPTQModel,
AutoGPTQ), AWQ gemm (AutoAWQ) and compressed-tensors (llm-compressor).

``parse`` reads a checkpoint's ``quantization_config`` (or ``--quantization``)
into a ``QuantConfig`` and imports no torch, so this package's root stays
light: it re-exports only that. ``stream.quantized_stream`` converts the
tensors while the loader streams them; ``gptq``, ``awq`` and
``compressed_tensors`` hold one converter each, ``tensors`` what they share.
"""

from __future__ import annotations

from kvserve.quant.formats.parse import (
    QUANTIZATION_CHOICES,
    method_of,
    parse_quantization_config,
    read_quantize_config,
    resolve_quantization,
)

__all__ = [
    "QUANTIZATION_CHOICES",
    "method_of",
    "parse_quantization_config",
    "read_quantize_config",
    "resolve_quantization",
]
