"""A checkpoint's KV-cache scales: taken out of the weight stream, checked,
and kept on the attention layers (``Attention.checkpoint_kv_scales``) for
the worker to bind beside an fp8 KV cache (``--kv-cache-dtype fp8_e4m3``).

For decoder layer N, under ``model.layers.N.self_attn.``, the spellings
vLLM reads: ``k_scale`` / ``v_scale`` (compressed-tensors, HF fp8),
``kv_scale`` (one for both: older FP8 checkpoints),
``k_proj.output_scale`` / ``v_proj.output_scale`` (older compressed-tensors,
Quark), ``k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt) and
``attn.k_scale`` / ``attn.v_scale`` (vLLM's own). ``q_scale`` and
``prob_scale`` in the same places scale FP8 attention arithmetic, which
kvserve does not do (q and the probabilities stay 16-bit): they are dropped.

A scale is one value (per tensor) or one per KV head of the checkpoint,
finite and > 0; with tensor parallelism each rank keeps its KV heads'
(``split_heads``), with pipeline parallelism each stage its layers'. Either
every layer has both its K and V scales or none has any; anything else is a
ValueError naming the tensor. Owns no policy: whether the scales
are used is the KV cache dtype's business (``worker/kv_cache.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import building_state
from kvserve.distributed.sharding import split_heads
from kvserve.layers.attention import Attention

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# suffix after ``self_attn.`` -> the scales it gives: "k", "v", both, or none (dropped)
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"),
    "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",),
    "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
    "attn.k_scale": ("k",), "attn.v_scale": ("v",),
    "q_scale": (), "prob_scale": (), "attn.q_scale": (), "attn.prob_scale": (),
}


class KVScaleReader:
    """Takes the KV-cache scales out of a checkpoint's ``(name, tensor)`` stream
    (``filter``) and, once the stream is read, checks and attaches them
    (``finish``)."""

    def __init__(self, model: nn.Module, config: ModelConfig) -> None:
        # the checkpoint's layer index -> this process's attention layer of it
        self.layers: dict[int, Attention] = {}
        for name, module in model.named_modules():
            match = _LAYER.match(name)
            if isinstance(module, Attention) and match is not None:
                self.layers[int(match.group(1))] = module
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads  # the checkpoint's
        tp = building_state().tp
        split = split_heads(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        self.kv_heads = slice(split.kv_head_start, split.kv_head_start + split.num_kv_heads)
        # (layer, "k" or "v") -> (the checkpoint tensor's name, [num_kv_heads] float32)
        self.scales: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of ``weights`` but the KV-cache scales, which it keeps."""
        for name, tensor in weights:
            match = _NAME.match(name)
            if match is None or match.group(2) not in _SUFFIXES:
                yield name, tensor
                continue
            layer = int(match.group(1))
            for kind in _SUFFIXES[match.group(2)]:
                self._keep(name, layer, kind, tensor)

    def _keep(self, name: str, layer: int, kind: str, tensor: torch.Tensor) -> None:
        if layer >= self.num_layers:
            raise ValueError(f"checkpoint tensor '{name}': layer {layer} does not exist "
                             f"(the model has {self.num_layers})")
        if tensor.numel() not in (1, self.num_kv_heads) or not tensor.is_floating_point():
            raise ValueError(
                f"checkpoint tensor '{name}': a KV-cache scale of shape {tuple(tensor.shape)} "
                f"and dtype {tensor.dtype}; expected one floating-point value or one per KV "
                f"head ({self.num_kv_heads})"
            )
        values = tensor.detach().float().reshape(-1).expand(self.num_kv_heads).clone()
        if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
            raise ValueError(f"checkpoint tensor '{name}': KV-cache scale {values.tolist()}; "
                             "every scale must be finite and > 0")
        if (layer, kind) in self.scales:
            raise ValueError(f"checkpoint tensor '{name}': layer {layer}'s {kind.upper()} "
                             f"scale is also given by '{self.scales[layer, kind][0]}'")
        self.scales[layer, kind] = (name, values)

    def finish(self) -> None:
        """Check that every layer has both scales (or none has any) and attach
        them to the attention layers."""
        if not self.scales:
            return
        first_name = next(iter(self.scales.values()))[0]
        for layer in range(self.num_layers):
            for kind in ("k", "v"):
                if (layer, kind) not in self.scales:
                    raise ValueError(
                        f"checkpoint lacks 'model.layers.{layer}.self_attn.{kind}_scale' (or "
                        f"another spelling of it): it has KV-cache scales ('{first_name}') "
                        "but not for every layer"
                    )
        for layer, attention in self.layers.items():  # this rank's layers and KV heads
            attention.checkpoint_kv_scales = torch.stack(
                [self.scales[layer, kind][1][self.kv_heads] for kind in ("k", "v")])
