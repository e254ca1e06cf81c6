"""``LoRAManager``: the adapters one model runner can serve, and which of them
sit in the ``max_loras`` device slots.

Built once per runner, it wraps every LoRA-capable linear of each decoder
layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``: the HF
projections q/k/v/o/gate/up/down) in a ``LoRALinear``. ``add_lora`` reads a
PEFT adapter, checks it against the model and keeps it on the host (B
pre-multiplied by ``lora_alpha / r``). ``set_batch``, called once per step
with each request's adapter id and token count, makes the step's adapters
resident (evicting the least recently used adapter the step does not use)
and tells the wrapped linears which rows use which slot. The scheduler
guarantees that one step uses at most ``max_loras`` adapters. The base
weights are never modified.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import LoRAConfig
from kvserve.host_copy import to_device
from kvserve.layers.linear import ColumnLinear, Linear, RowLinear, ShardId
from kvserve.lora.layers import LoRABatch, LoRALinear, LoRASlice
from kvserve.lora.peft import (
    SUPPORTED_TARGET_MODULES,
    WEIGHTS_FILE,
    AdapterConfig,
    adapter_files,
    parse_tensor_name,
    read_adapter_config,
)
from kvserve.lora.request import LoRARequest
from kvserve.models.loader import iter_safetensors
from kvserve.models.registry import CausalLM

_LAYER_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")

# (layer index, HF module name)
ModuleKey = tuple[int, str]


@dataclass
class LoadedAdapter:
    """An adapter read from disk, ready to be copied into a slot."""

    request: LoRARequest
    # (layer, HF module) -> (A [rank, in_features], scaling * B [out_features, rank]), float32
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    """Loaded adapters, their slots (an LRU), and the step's rows per slot."""

    def __init__(self, model: CausalLM, lora_config: LoRAConfig, device: torch.device) -> None:
        self.config = lora_config
        self.device = device
        self.batch = LoRABatch()
        self.adapters: dict[int, LoadedAdapter] = {}
        # lora_int_id -> slot, least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(lora_config.max_loras - 1, -1, -1))
        self.linears: list[tuple[int, LoRALinear]] = []  # (layer index, wrapped linear)
        # the model's decoder layers (this process holds some of them with pipeline parallelism)
        self.num_layers = model.config.num_layers
        # (layer, HF module) -> (in_features, out_features) an adapter's tensors must fit
        self.module_shapes: dict[ModuleKey, tuple[int, int]] = {}
        self._wrap_linears(model)

    def _wrap_linears(self, model: CausalLM) -> None:
        packed: dict[str, tuple[tuple[str, ShardId], ...]] = getattr(
            model, "packed_modules_mapping", {})
        for name, module in list(model.named_modules()):
            match = _LAYER_MODULE_RE.match(name)
            if match is None or not isinstance(module, Linear):
                continue
            layer_idx, child = int(match.group(1)), match.group(3)
            # (HF module, slice on this rank, the adapter's (in, out) features)
            parts: list[tuple[LoRASlice, tuple[int, int]]] = []
            if child in packed and isinstance(module, ColumnLinear):
                for hf, shard_id in packed[child]:
                    shard = module.shards[shard_id]
                    parts.append((LoRASlice(hf, shard.offset, shard.size, shard.start),
                                  (module.input_size, shard.full_size)))
            elif child in SUPPORTED_TARGET_MODULES and isinstance(module, RowLinear):
                a_start = module.tp.rank * module.input_size
                parts.append((LoRASlice(child, 0, module.output_size, 0, a_start),
                              (module.full_input_size, module.output_size)))
            elif child in SUPPORTED_TARGET_MODULES and isinstance(module, ColumnLinear):
                shard = module.shards[None]
                parts.append((LoRASlice(child, 0, shard.size, shard.start),
                              (module.input_size, shard.full_size)))
            else:
                continue
            wrapped = LoRALinear(module, [piece for piece, _ in parts], self.config.max_loras,
                                 self.config.max_lora_rank, self.batch)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, wrapped)
            self.linears.append((layer_idx, wrapped))
            for piece, features in parts:
                self.module_shapes[(layer_idx, piece.name)] = features

    # ------------------------------------------------------------ loading

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (once per ``lora_int_id``); ValueError naming
        the file, field or tensor that does not fit."""
        known = self.adapters.get(lora_request.lora_int_id)
        if known is not None:
            if known.request != lora_request:
                raise ValueError(
                    f"lora_request: lora_int_id={lora_request.lora_int_id} is already used by "
                    f"'{known.request.lora_name}' ({known.request.lora_path}); give each "
                    "adapter its own id"
                )
            return
        path = Path(lora_request.lora_path)
        config = read_adapter_config(path, self.config.max_lora_rank)
        weights = self._read_weights(adapter_files(path)[1], config)
        self.adapters[lora_request.lora_int_id] = LoadedAdapter(lora_request, weights)

    def _read_weights(
        self, file: Path, config: AdapterConfig
    ) -> dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]:
        # (layer, HF module) -> "A" / "B" -> (tensor name, tensor)
        pairs: dict[ModuleKey, dict[str, tuple[str, torch.Tensor]]] = {}
        local_layers = {layer for layer, _ in self.module_shapes}
        num_tensors = 0
        for name, tensor in iter_safetensors([file]):
            layer_idx, module, kind = parse_tensor_name(name)
            num_tensors += 1
            if layer_idx < self.num_layers and layer_idx not in local_layers:
                continue  # another pipeline stage's layer
            if (layer_idx, module) not in self.module_shapes:
                num_layers = self.num_layers
                raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' targets layer {layer_idx} "
                                 f"but the base model has {num_layers} layers: an adapter for "
                                 "another base model?")
            pairs.setdefault((layer_idx, module), {})[kind] = (name, tensor.to(torch.float32))
        if not num_tensors:
            raise ValueError(f"{file} holds no LoRA tensors")
        weights = {}
        for key, pair in pairs.items():
            if set(pair) != {"A", "B"}:
                name = next(iter(pair.values()))[0]
                raise ValueError(f"{WEIGHTS_FILE}: tensor '{name}' has no lora_A/lora_B partner")
            in_features, out_features = self.module_shapes[key]
            expected = {"A": (config.rank, in_features), "B": (out_features, config.rank)}
            for kind, (name, tensor) in pair.items():
                if tuple(tensor.shape) != expected[kind]:
                    raise ValueError(
                        f"{WEIGHTS_FILE}: tensor '{name}' has shape {tuple(tensor.shape)}; the "
                        f"base model needs {expected[kind]} (r={config.rank}, {key[1]} of layer "
                        f"{key[0]} maps {in_features} -> {out_features} features): an adapter "
                        "for another base model?"
                    )
            weights[key] = (pair["A"][1], pair["B"][1] * config.scaling)
        return weights

    # ------------------------------------------------------------ per step

    def set_batch(self, lora_int_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """Make the step's adapters resident and map its rows to their slots.

        ``lora_int_ids[i]`` (0: none) and ``num_tokens[i]`` describe the i-th
        request of the flattened batch, whose rows are consecutive."""
        step_ids = {lora_id for lora_id in lora_int_ids if lora_id}
        if len(step_ids) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(step_ids)} adapters but max_loras="
                               f"{self.config.max_loras}; the scheduler must cap them")
        slot_of = {lora_id: self._activate(lora_id, step_ids) for lora_id in step_ids}
        rows: dict[int, list[int]] = {}
        start = 0
        for lora_id, count in zip(lora_int_ids, num_tokens, strict=True):
            if lora_id:
                rows.setdefault(slot_of[lora_id], []).extend(range(start, start + count))
            start += count
        self.batch.slot_rows = [(slot, to_device(r, torch.int64, self.device))
                                for slot, r in rows.items()]

    def _activate(self, lora_id: int, step_ids: set[int]) -> int:
        """The slot holding ``lora_id``, loading it (and evicting) if needed."""
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        adapter = self.adapters[lora_id]
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slots if i not in step_ids)
            slot = self.slots.pop(victim)
        for layer_idx, linear in self.linears:
            linear.set_slot(slot, {
                piece.name: adapter.weights[(layer_idx, piece.name)] for piece in linear.slices
                if (layer_idx, piece.name) in adapter.weights
            })
        self.slots[lora_id] = slot
        return slot

