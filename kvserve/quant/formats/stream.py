"""The loader's stream of quantised checkpoint tensors, in kvserve's names.

``quantized_stream`` sits between reading the safetensors shards and the
model's ``load_weights``: for every linear the ``QuantConfig`` quantises it
gathers that module's checkpoint tensors (they may come in any order and
from any shard; only incomplete modules are held), converts them with the
format's converter into ``QuantizedWeight`` and yields
``{module}.qweight``, ``{module}.scales``, ``{module}.zeros`` (asymmetric
only) and ``{module}.perm`` (act-order only); scales and zeros in the
model's dtype. Every other tensor passes through as it came (norms,
embeddings, biases, the 16-bit ``weight`` of ignored linears). A config
without a checkpoint format rounds each quantised linear's 16-bit
``weight`` to nearest here instead (FP8 / INT8 W8A8: e4m3 / int8 values
and float32 per-channel scales, ``quant/fp8.py`` / ``quant/int8.py``). A
W8A8 checkpoint's linears keep their 8-bit ``weight`` as ``qweight`` and
their ``weight_scale`` as float32 ``scales [N, 1]``. It knows module names only through
``is_linear``; it never touches the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvserve.quant import fp8, int8
from kvserve.quant.config import W8A8_TYPES, QuantConfig
from kvserve.quant.formats.awq import AWQ
from kvserve.quant.formats.compressed_tensors import COMPRESSED_TENSORS
from kvserve.quant.formats.gptq import GPTQ
from kvserve.quant.formats.tensors import CheckpointFormat, Parts
from kvserve.quant.packing import QuantizedWeight, quantize_rtn

FORMATS: dict[str, CheckpointFormat] = {
    "gptq": GPTQ,
    "gptq_v2": GPTQ,
    "awq": AWQ,
    "compressed-tensors": COMPRESSED_TENSORS,
}

Weights = Iterator[tuple[str, torch.Tensor]]


def quantized_stream(
    config: QuantConfig,
    weights: Weights,
    is_linear: Callable[[str], bool],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> Weights:
    """``weights`` (HF names) with every quantised linear's tensors replaced by
    kvserve's packed ones (see the module docstring). ``device``, if given,
    is where conversion runs and the packed tensors are yielded.

    Raises ValueError naming the tensor for a wrong shape or dtype, a 16-bit
    ``weight`` where the config expects a quantised linear, a tensor given
    twice, and at the end every module left with missing parts."""
    if config.checkpoint_format is None:
        yield from _round_to_nearest(config, weights, is_linear, dtype, device)
        return
    if config.weight_type in W8A8_TYPES:
        yield from _w8a8_checkpoint(config, weights, is_linear, device)
        return
    fmt = FORMATS[config.checkpoint_format]
    needed = set(fmt.required(config))
    pending: dict[str, Parts] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if not module or not is_linear(module) or not config.quantizes(module):
            yield name, tensor
            continue
        if part == "weight":
            raise ValueError(
                f"checkpoint tensor '{name}' is a 16-bit weight, but the quantization_config "
                f"({config.checkpoint_format}) quantises '{module}': the checkpoint should hold "
                f"its {', '.join(sorted(needed))} (is the module missing from the ignore list?)")
        if part not in fmt.parts:
            yield name, tensor  # a bias, or a tensor the model will judge
            continue
        if device is not None:
            tensor = tensor.to(device)
        if part not in needed:
            fmt.check_alone(part, tensor, config, name)
            continue
        parts = pending.setdefault(module, {})
        if part in parts:
            raise ValueError(f"checkpoint tensor '{name}' appears twice")
        parts[part] = tensor
        if len(parts) == len(needed):
            qw = fmt.convert(pending.pop(module), config, module)
            yield from packed_tensors(module, qw, config, dtype)
    if pending:
        missing = [f"{module} (missing {', '.join(sorted(needed - set(parts)))})"
                   for module, parts in pending.items()]
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks parts of {len(missing)} quantised linear(s): "
                         f"{'; '.join(missing[:5])}{more}")


def packed_tensors(
    module: str, qw: QuantizedWeight, config: QuantConfig, dtype: torch.dtype
) -> Weights:
    """The canonical tensors of one quantised linear; an act-order config
    yields a ``perm`` for every linear (the identity where it has none)."""
    yield f"{module}.qweight", qw.qweight
    yield f"{module}.scales", qw.scales.to(dtype)
    if not config.symmetric:
        if qw.zeros is None:
            raise AssertionError(f"{module}: an asymmetric config converted without zeros")
        yield f"{module}.zeros", qw.zeros.to(dtype)
    if config.act_order:
        k = qw.shape[1]
        perm = qw.perm if qw.perm is not None else torch.arange(k, device=qw.qweight.device)
        yield f"{module}.perm", perm


def _round_to_nearest(
    config: QuantConfig, weights: Weights, is_linear: Callable[[str], bool],
    dtype: torch.dtype, device: torch.device | str | None,
) -> Weights:
    """Each quantised linear's 16-bit ``weight`` rounded to nearest at load."""
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part != "weight" or not module or not is_linear(module) \
                or not config.quantizes(module):
            yield name, tensor
            continue
        if device is not None:
            tensor = tensor.to(device)
        if config.weight_type in W8A8_TYPES:  # 8-bit values and float32 per-channel scales
            quantize = fp8.quantize_weight if config.weight_type == "fp8" else int8.quantize_weight
            qweight, scales = quantize(tensor)
            yield f"{module}.qweight", qweight
            yield f"{module}.scales", scales
            continue
        qw = quantize_rtn(tensor, config.bits, config.group_size, config.symmetric,
                          scale_dtype=dtype)
        yield from packed_tensors(module, qw, config, dtype)


W8A8_PARTS = ("weight", "weight_scale")
W8A8_WEIGHT_DTYPES = {"fp8": torch.float8_e4m3fn, "w8a8-int8": torch.int8}


def _w8a8_checkpoint(
    config: QuantConfig, weights: Weights, is_linear: Callable[[str], bool],
    device: torch.device | str | None,
) -> Weights:
    """A W8A8 checkpoint's linears (compressed-tensors ``float-quantized`` or
    ``int-quantized``, HF fp8): the 8-bit ``weight`` as ``qweight`` and its
    ``weight_scale`` (one per tensor or per output channel) as float32
    ``scales [N, 1]``; a static ``input_scale`` (and a symmetric scheme's
    all-zero ``input_zero_point``) is checked and dropped (activations are
    quantised per token as the model runs)."""
    weight_dtype = W8A8_WEIGHT_DTYPES[config.weight_type]
    pending: dict[str, Parts] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if not module or not is_linear(module) or not config.quantizes(module):
            yield name, tensor
            continue
        if part == "input_scale":
            if not bool(torch.isfinite(tensor.float()).all()):
                raise ValueError(f"checkpoint tensor '{name}': a non-finite input scale")
            continue
        if part in ("input_zero_point", "weight_zero_point"):
            if bool((tensor != 0).any()):
                raise ValueError(f"checkpoint tensor '{name}': the scheme is symmetric, so "
                                 "its zero point must be 0; found non-zero values")
            continue
        if part not in W8A8_PARTS:
            yield name, tensor  # a bias
            continue
        if part == "weight" and tensor.dtype != weight_dtype:
            raise ValueError(
                f"checkpoint tensor '{name}' is {tensor.dtype}, but the quantization_config "
                f"({config.checkpoint_format}, {config.name}) quantises '{module}': expected "
                f"{str(weight_dtype).removeprefix('torch.')} (is the module missing from the "
                "ignore list?)")
        parts = pending.setdefault(module, {})
        if part in parts:
            raise ValueError(f"checkpoint tensor '{name}' appears twice")
        parts[part] = tensor if device is None else tensor.to(device)
        if len(parts) == len(W8A8_PARTS):
            yield from _w8a8_tensors(module, pending.pop(module))
    if pending:
        missing = [f"{module} (missing {', '.join(sorted(set(W8A8_PARTS) - set(parts)))})"
                   for module, parts in pending.items()]
        raise ValueError(f"checkpoint lacks parts of {len(missing)} {config.name} linear(s): "
                         f"{'; '.join(missing[:5])}")


def _w8a8_tensors(module: str, parts: Parts) -> Weights:
    weight, scale = parts["weight"], parts["weight_scale"].float()
    n = weight.shape[0]
    if weight.dim() != 2 or scale.numel() not in (1, n):
        raise ValueError(f"checkpoint tensor '{module}.weight_scale': shape "
                         f"{tuple(scale.shape)}; expected one value or one per output channel "
                         f"({n}) of '{module}.weight' {tuple(weight.shape)}")
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError(f"checkpoint tensor '{module}.weight_scale': scales must be finite "
                         "and >= 0")
    yield f"{module}.qweight", weight
    yield f"{module}.scales", scale.reshape(-1, 1).expand(n, 1).contiguous()
