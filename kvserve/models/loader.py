"""From a ``ModelConfig`` to a ready ``nn.Module``: dtype and weights.

Owns choosing the dtype, building the model on its device in its dtype, and
filling it either with seeded random weights (``load_format="dummy"``) or by streaming tensors from
``model.safetensors`` / the shards of ``model.safetensors.index.json`` (its
KV-cache scales, if any, to the attention layers: ``kv_scales.py``); then
each linear's method finishes its weights (``process_weights_after_loading``).
A quantised model's linears hold kvserve's packed layout from the start, so
a 16-bit copy of its weights is never built on the device.
It never downloads: it reads a local directory (a hub id is resolved to its
snapshot directory before, by ``kvserve/models/source.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import ModelConfig
from kvserve.layers.norm import RMSNorm
from kvserve.models.kv_scales import KVScaleReader
from kvserve.models.registry import CausalLM, get_model_class
from kvserve.quant.formats.stream import quantized_stream
from kvserve.quant.methods import LinearMethod

LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(name: str, config: ModelConfig, device: torch.device | str) -> torch.dtype:
    """``"auto"``: on CUDA the checkpoint's 16-bit dtype (a float32 checkpoint
    runs in bfloat16, as vLLM downcasts it), float32 elsewhere; or an explicit name."""
    if name == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        checkpoint_dtype = _DTYPES.get(config.dtype.removeprefix("torch."), torch.bfloat16)
        return torch.bfloat16 if checkpoint_dtype == torch.float32 else checkpoint_dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype='{name}' is not supported; allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    config: ModelConfig,
    path: Path | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> CausalLM:
    """Build ``config``'s model directly on ``device`` in ``dtype`` and fill its weights."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format='{load_format}' is not supported; allowed: {', '.join(LOAD_FORMATS)}"
        )
    if load_format == "auto" and path is None:
        raise ValueError(
            f"load_format='auto' needs a checkpoint directory but model '{config.architecture}' "
            "is a preset without weights; use load_format='dummy'"
        )
    device = torch.device(device)
    model_cls = get_model_class(config.architecture)
    files = _checkpoint_files(path) if load_format == "auto" and path is not None else []
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        kv_scales = KVScaleReader(model, config)  # an FP8 checkpoint's KV-cache scales
        weights = kv_scales.filter(iter_safetensors(files))
        if config.quantization is not None:  # converted into kvserve's packed layout
            weights = quantized_stream(config.quantization, weights,
                                       model.linear_module_names().__contains__, dtype, device)
        model.load_weights(weights)
        kv_scales.finish()
    for module in model.modules():
        method: LinearMethod | None = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    model.eval()
    return model


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded small random weights (normal, std ``DUMMY_STD``); norm scales set
    to 1; a quantised linear draws its weight and rounds it (its method's
    ``init_dummy``)."""
    seen: set[int] = set()
    generators: dict[torch.device, torch.Generator] = {}

    def generator_on(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    with torch.no_grad():
        for module in model.modules():
            method: LinearMethod | None = getattr(module, "quant_method", None)
            if method is not None and method.quantized:
                params = [getattr(module, name) for name in method.weight_names]
                seen.update(id(p) for p in params if p is not None)
                method.init_dummy(module, generator_on(params[0].device), DUMMY_STD)
            for param in module.parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if isinstance(module, RMSNorm):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, DUMMY_STD, generator=generator_on(param.device))


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files to read, all checked to exist before any is read."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AttributeError) as e:
            raise ValueError(f"model: {index} is not a valid safetensors index ({e!r})") from e
        files = [path / name for name in names]
    elif single.is_file():
        files = [single]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"model: no model.safetensors, model.safetensors.index.json or *.safetensors "
                f"in {path} (only the safetensors format is supported)"
            )
    for file in files:
        if not file.is_file():
            raise ValueError(f"model: checkpoint shard {file} (listed in {index.name}) not found")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` from each file, one tensor in memory at a time."""
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"model: {file} is not a readable safetensors file ({e})") from e
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"model: {file} is corrupt: tensor '{name}' ({e})") from e
            yield name, tensor
