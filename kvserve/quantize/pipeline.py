"""One ``kvserve quantize`` run: checks, calibration data, the model walked
layer by layer, the checkpoint written.

The forward is Hugging Face transformers' model class of the checkpoint
(decision record "kvserve-quantize"), loaded on the CPU in the checkpoint's
dtype. The inputs of the first decoder layer are caught once per batch of
calibration windows; then each layer in turn is moved to ``--device`` in
float32, quantised (RTN needs no inputs; GPTQ per group of linears sharing
an input, each group's Hessian taken with the earlier groups already
quantised; AWQ per layer; SmoothQuant per layer, its scales folded into the
norms before int8 rounding), its linears replaced by their dequantised
weights, and run to give the next layer's inputs, so every layer is fitted
to what the quantised layers before it produce. Every check that needs no
model runs before the model is loaded (``options.py``, ``data.py``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from kvserve.config import ModelConfig
from kvserve.quant.packing import QuantizedWeight, dequantize
from kvserve.quantize import awq, smoothquant
from kvserve.quantize.data import (
    calibration_windows,
    load_tokenizer,
    read_calibration_texts,
)
from kvserve.quantize.gptq import HessianAccumulator, gptq_quantize
from kvserve.quantize.layer_runner import LayerRunner, weight_of
from kvserve.quantize.options import (
    QuantizeOptions,
    check_against_model,
    check_output,
    read_model_config,
)
from kvserve.quantize.rtn import WeightScheme, rtn_quantize
from kvserve.quantize.writer import write_checkpoint

# the linears of a decoder layer, grouped by shared input, in the order the layer runs them
LINEAR_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
LINEARS = tuple(name for group in LINEAR_GROUPS for name in group)
NORMS = ("input_layernorm", "post_attention_layernorm")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class QuantizeResult:
    """What a run produced: the written directory and every linear's layout
    (by HF module name), as written."""

    options: QuantizeOptions
    quantized: dict[str, QuantizedWeight]
    seconds: float
    checkpoint_bytes: int


class _LayerInputsCaught(Exception):
    """Raised by the hook on the first decoder layer once it has its inputs."""


def quantize_checkpoint(options: QuantizeOptions) -> QuantizeResult:
    """The whole run; ``ValueError`` before any work for every input it can check."""
    start = time.perf_counter()
    hf_config, config = read_model_config(options.model)
    check_against_model(options, config)
    check_output(options.output)
    windows = None
    if options.uses_calibration:
        assert options.calib is not None  # QuantizeOptions checks it
        texts = read_calibration_texts(options.calib)
        windows = calibration_windows(texts, load_tokenizer(options.model),
                                      options.num_samples, options.seq_len, options.seed)
    device = _device(options.device)
    dtype = _DTYPES.get(config.dtype.removeprefix("torch."), torch.float32)
    scheme = WeightScheme(options.bits, options.group_size, options.is_symmetric, dtype)
    torch.manual_seed(options.seed)
    model = _load_model(options, dtype)
    layers = _decoder_layers(model)
    if windows is None:
        quantized = _quantize_rtn(layers, scheme)
    else:
        quantized = _calibrate(model, layers, windows, options, scheme, config, device)
    size = write_checkpoint(options, hf_config, model, quantized)
    return QuantizeResult(options, quantized, time.perf_counter() - start, size)


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here; use --device cpu")
    return device


def _load_model(options: QuantizeOptions, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(options.model), dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    return model.eval().requires_grad_(False)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers``, each with the linears and norms this module knows."""
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    for name in (*LINEARS, *NORMS):
        module = layers[0].get_submodule(name)
        weight_of(layers[0], name)
        if name in LINEARS and not isinstance(module, nn.Linear):
            raise ValueError(f"model: {name} of layer 0 is a {type(module).__name__}, not a "
                             "linear; this architecture cannot be calibrated")
    return layers


def _quantize_rtn(layers: nn.ModuleList, scheme: WeightScheme) -> dict[str, QuantizedWeight]:
    quantized = {}
    for i, layer in enumerate(tqdm(layers, desc=f"rtn {_label(scheme)}", unit="layer")):
        for name in LINEARS:
            weight = weight_of(layer, name).detach()
            quantized[f"model.layers.{i}.{name}"] = rtn_quantize(weight, scheme)
    return quantized


def _label(scheme: WeightScheme) -> str:
    group = "" if scheme.group_size == -1 else f"-g{scheme.group_size}"
    return f"int{scheme.bits}{group}{'' if scheme.symmetric else '-asym'}"


def _calibrate(
    model: nn.Module, layers: nn.ModuleList, windows: torch.Tensor, options: QuantizeOptions,
    scheme: WeightScheme, config: ModelConfig, device: torch.device,
) -> dict[str, QuantizedWeight]:
    """Every layer quantised in order on the outputs of the quantised layers before it."""
    inputs, kwargs = _catch_layer_inputs(model, windows, options.batch_size, device)
    quantized: dict[str, QuantizedWeight] = {}
    label = options.quant_config.name if options.method == "smoothquant" else _label(scheme)
    progress = tqdm(layers, desc=f"{options.method} {label}", unit="layer")
    for i, layer in enumerate(progress):
        dtype = next(layer.parameters()).dtype
        layer.to(device, torch.float32)
        runner = LayerRunner(layer, inputs, kwargs)
        if options.method == "gptq":
            layer_weights = _gptq_layer(runner, scheme, options, f"model.layers.{i}")
        elif options.method == "smoothquant":
            layer_weights = smoothquant.smooth_and_quantize(runner, LINEARS, NORMS,
                                                            options.alpha, dtype)
        else:
            layer_weights = _awq_layer(runner, scheme, options, config, dtype)
        for name, qw in layer_weights.items():
            weight_of(layer, name).data.copy_(dequantize(qw))
            quantized[f"model.layers.{i}.{name}"] = _to_cpu(qw)
        inputs = runner.forward()
        layer.to("cpu", dtype)
    return quantized


def _to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.qweight.cpu(), qw.scales.cpu(),
                           None if qw.zeros is None else qw.zeros.cpu(), qw.bits, qw.group_size,
                           None if qw.perm is None else qw.perm.cpu())


@torch.no_grad()
def _catch_layer_inputs(
    model: nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The first decoder layer's hidden states (float32, on ``device``) and
    keyword arguments, per batch of windows; only the embedding runs."""
    body = model.get_submodule("model")
    first_layer = body.get_submodule("layers.0")
    caught: dict[str, Any] = {}

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kwargs = dict(kwargs)
        caught["x"] = args[0] if args else kwargs.pop("hidden_states")
        caught["kwargs"] = kwargs
        raise _LayerInputsCaught

    handle = first_layer.register_forward_pre_hook(hook, with_kwargs=True)
    stay = [m for n, m in body.named_children() if n != "layers"]
    for module in stay:
        module.to(device)
    inputs, all_kwargs = [], []
    try:
        for batch in windows.split(batch_size):
            with contextlib.suppress(_LayerInputsCaught):
                body(input_ids=batch.to(device), use_cache=False)
            inputs.append(caught["x"].float())
            all_kwargs.append({k: _float32(v) for k, v in caught["kwargs"].items()})
    finally:
        handle.remove()
        for module in stay:
            module.to("cpu")
    return inputs, all_kwargs


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, tuple):
        return tuple(_float32(v) for v in value)
    return value


def _gptq_layer(
    runner: LayerRunner, scheme: WeightScheme, options: QuantizeOptions, prefix: str
) -> dict[str, QuantizedWeight]:
    """GPTQ per group of linears; each group's Hessian from a forward in which
    the groups before it are already quantised."""
    out: dict[str, QuantizedWeight] = {}
    for group in LINEAR_GROUPS:
        first = runner.weight(group[0])
        accumulator = HessianAccumulator(first.shape[1], first.device)
        with runner.observing({group[0]: accumulator.add}):
            runner.forward()
        hessian = accumulator.hessian()
        for name in group:
            weight = runner.weight(name)
            qw, damp = gptq_quantize(weight, hessian, scheme, options.act_order,
                                     options.dampening)
            if damp != options.dampening:
                tqdm.write(f"kvserve quantize: {prefix}.{name}: the Hessian was not positive "
                           f"definite with dampening {options.dampening:g}; used {damp:g}")
            weight.data.copy_(dequantize(qw))
            out[name] = qw
    return out


def _awq_layer(
    runner: LayerRunner, scheme: WeightScheme, options: QuantizeOptions, config: ModelConfig,
    dtype: torch.dtype,
) -> dict[str, QuantizedWeight]:
    """AWQ's scales folded (norm weights rounded to the checkpoint's dtype, as
    they will be stored), the optional clipping search, then rounding."""
    sharing = awq.HeadSharing(config.num_heads, config.num_kv_heads, config.head_dim)
    for mapping in awq.MAPPINGS:
        mapping_sharing = sharing if mapping.prev == "self_attn.v_proj" else None
        scales = awq.search_scales(runner, mapping, scheme, mapping_sharing)
        awq.fold_scales(runner.layer, mapping, scales, mapping_sharing)
    for name in NORMS:
        weight = runner.weight(name)
        weight.data.copy_(weight.to(dtype).float())
    if options.awq_clip:
        awq.apply_clip(runner, list(LINEARS), scheme)
    return {name: rtn_quantize(runner.weight(name).detach(), scheme) for name in LINEARS}
