"""``LoRAManager``: the adapters one model runner can serve, which of them are
kept in host memory (at most ``max_cpu_loras``) and which sit in the
``max_loras`` device slots.

Built once per runner, it wraps every LoRA-capable linear of each decoder
layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``: the HF
projections q/k/v/o/gate/up/down) in a ``LoRALinear``. ``add_lora`` reads a
PEFT adapter, checks it against the model and keeps it on the host in the
slots' layout (B pre-multiplied by ``lora_alpha / r``, pinned on CUDA), the
least recently used host copy dropped beyond ``max_cpu_loras``.
``prefetch`` reads dropped adapters again on a loader thread, so the steps
go on meanwhile (the scheduler holds back the requests whose adapter is not
back yet); only a running request whose adapter lost both its slot and its
host copy still waits for a read inside a step. ``set_batch``, called once per
step with each request's adapter id and token count, makes the step's
adapters resident (evicting the least recently used adapter the step does
not use; the copy into the slot is queued on the stream, the host does not
wait for it) and tells the wrapped linears which tokens use which slot.
``remove_lora`` forgets an adapter. The scheduler guarantees that one step
uses at most ``max_loras`` adapters. The base weights are never modified.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.config import LoRAConfig
from kvserve.host_copy import to_device
from kvserve.kernels.lora import TILE_M
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

logger = logging.getLogger(__name__)

_LAYER_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")

# (layer index, HF module name)
ModuleKey = tuple[int, str]


@dataclass
class HostAdapter:
    """An adapter read from disk, in the slots' layout, ready to be copied into one."""

    request: LoRARequest
    # per wrapped linear (``LoRAManager.linears`` order): LoRALinear.pack's output
    packed: list[tuple[torch.Tensor, torch.Tensor] | None]


def write_segments(token_slots: np.ndarray, max_loras: int, sorted_ids: np.ndarray,
                   tiles: np.ndarray) -> int:
    """Write the segmented form of ``token_slots`` (``kernels/lora.py``): the
    tokens with an adapter grouped by slot into ``sorted_ids``, each slot's
    run cut into tiles of ``TILE_M`` into ``tiles [3, max_tiles]`` (first,
    end, slot; -1 after the last tile). Returns the tokens with an adapter."""
    adapted = np.flatnonzero(token_slots >= 0)
    sorted_ids[:len(adapted)] = adapted[np.argsort(token_slots[adapted], kind="stable")]
    counts = np.bincount(token_slots[adapted], minlength=max_loras)
    starts = np.cumsum(counts) - counts
    tiles_per_slot = -(-counts // TILE_M)
    tile_slot = np.repeat(np.arange(len(counts)), tiles_per_slot)
    num = len(tile_slot)
    within = np.arange(num) - np.repeat(np.cumsum(tiles_per_slot) - tiles_per_slot,
                                        tiles_per_slot)
    tiles[0, :num] = starts[tile_slot] + TILE_M * within
    tiles[1, :num] = starts[tile_slot] + counts[tile_slot]
    tiles[2, :num] = tile_slot
    tiles[2, num:] = -1
    return len(adapted)


class LoRAManager:
    """Known adapters, their host copies and device slots (two LRUs), and the
    step's tokens per slot."""

    def __init__(self, model: CausalLM, lora_config: LoRAConfig, device: torch.device,
                 max_num_tokens: int = 0, use_kernels: bool = False) -> None:
        """``use_kernels``: compute with the batched Triton kernels over buffers
        for steps of up to ``max_num_tokens`` tokens (else the torch path)."""
        self.config = lora_config
        self.device = device
        self.batch = LoRABatch(use_kernels)
        self.requests: dict[int, LoRARequest] = {}  # every adapter added and not removed
        # lora_int_id -> its host copy, least recently used first; guarded by
        # _lock (the server's thread adds adapters while the engine's steps)
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()
        self._lock = threading.Lock()
        # lora_int_id -> slot, least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(lora_config.max_loras - 1, -1, -1))
        self.linears: list[tuple[int, LoRALinear]] = []  # (layer index, wrapped linear)
        # the model's decoder layers (this process holds some of them with pipeline parallelism)
        self.num_layers = model.config.num_layers
        # (layer, HF module) -> (in_features, out_features) an adapter's tensors must fit
        self.module_shapes: dict[ModuleKey, tuple[int, int]] = {}
        self._wrap_linears(model)
        # copies into a slot, and reads from disk (the first, and after a host eviction)
        self.num_slot_loads = self.num_disk_loads = 0
        # reads made inside a step (a running request's adapter had neither a
        # slot nor a host copy, or its read had not finished)
        self.num_blocking_reads = 0
        # lora_int_id -> its read again on the loader thread (started lazily)
        self._reads: dict[int, Future[HostAdapter]] = {}
        self._loader: ThreadPoolExecutor | None = None
        # CUDA: slots are loaded on a side stream; per slot, the end of the last
        # step that read it; the slots of the step being prepared; the loads'
        # end (the step waits for it)
        self._load_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last_use: dict[int, torch.cuda.Event] = {}
        self._used_slots: set[int] = set()
        self._loaded: torch.cuda.Event | None = None
        if use_kernels:
            max_slices = max(len(linear.slices) for _, linear in self.linears)
            self.batch.allocate(max_num_tokens, lora_config.max_loras, max_slices,
                                lora_config.max_lora_rank, device)
            self._host_indices = torch.zeros(self.batch.packed.shape, dtype=torch.int32,
                                             pin_memory=device.type == "cuda")
            # the last index copy: the pinned host side may be rewritten once it is done
            self._copied = torch.cuda.Event() if device.type == "cuda" else None

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
        known = self.requests.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(
                    f"lora_request: lora_int_id={lora_request.lora_int_id} is already used by "
                    f"'{known.lora_name}' ({known.lora_path}); give each adapter its own id"
                )
            return
        self._read(lora_request)
        self.requests[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and its slot); False if unknown. The
        engine removes only adapters no unfinished request uses."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        read = self._reads.pop(lora_int_id, None)
        if read is not None and not read.cancel():
            read.exception()  # let the read under way land before forgetting its copy
        with self._lock:
            self.host.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return True

    def prefetch(self, lora_int_ids: Iterable[int]) -> set[int]:
        """Of ``lora_int_ids``, those a step cannot use without waiting for a
        read: neither in a slot nor in the host cache. Their reads start (or go
        on) on the loader thread; a read that failed is forgotten, so the step
        that needs the adapter reads it again and raises the error."""
        loading = set()
        for lora_id in lora_int_ids:
            if lora_id in self.slots or lora_id not in self.requests:
                continue
            with self._lock:
                if lora_id in self.host:
                    continue
            read = self._reads.get(lora_id)
            if read is not None and read.done():
                del self._reads[lora_id]
                if read.exception() is not None:
                    logger.warning("reading LoRA adapter %d again failed: %s", lora_id,
                                   read.exception())
                    continue
                if lora_id in self.host:
                    continue  # landed (else dropped again at once: read it once more)
            if lora_id not in self._reads:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-lora")
                self._reads[lora_id] = self._loader.submit(self._read, self.requests[lora_id])
            loading.add(lora_id)
        return loading

    def _read(self, lora_request: LoRARequest) -> HostAdapter:
        """Read, check and pack an adapter into the host cache (dropping the least
        recently used copy beyond ``max_cpu_loras``)."""
        path = Path(lora_request.lora_path)
        config = read_adapter_config(path, self.config.max_lora_rank)
        weights = self._read_weights(adapter_files(path)[1], config)
        pin = self.device.type == "cuda"
        packed = []
        for layer_idx, linear in self.linears:
            pieces = linear.pack({piece.name: weights[(layer_idx, piece.name)]
                                  for piece in linear.slices
                                  if (layer_idx, piece.name) in weights})
            packed.append(None if pieces is None else
                          (pieces[0].pin_memory(), pieces[1].pin_memory()) if pin else pieces)
        adapter = HostAdapter(lora_request, packed)
        with self._lock:
            self.num_disk_loads += 1
            self.host[lora_request.lora_int_id] = adapter
            while len(self.host) > self.config.cpu_loras:
                self.host.popitem(last=False)
        return adapter

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

    def set_batch(self, lora_int_ids: Sequence[int], num_tokens: Sequence[int],
                  num_padded_tokens: int | None = None) -> None:
        """Make the step's adapters resident and map its tokens to their slots.

        ``lora_int_ids[i]`` (0: none) and ``num_tokens[i]`` describe the i-th
        request of the flattened batch, whose tokens are consecutive; a CUDA
        graph's step runs ``num_padded_tokens`` tokens, the last ones padding."""
        step_ids = {lora_id for lora_id in lora_int_ids if lora_id}
        if len(step_ids) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(step_ids)} adapters but max_loras="
                               f"{self.config.max_loras}; the scheduler must cap them")
        self._mark_last_use()
        slot_of = {lora_id: self._activate(lora_id, step_ids) for lora_id in step_ids}
        self._used_slots = set(slot_of.values())
        if self._loaded is not None:  # the step waits for its slots' copies, nothing else
            torch.cuda.current_stream(self.device).wait_event(self._loaded)
            self._loaded = None
        if self.batch.use_kernels:
            self._set_indices([slot_of.get(i, -1) for i in lora_int_ids], num_tokens,
                              num_padded_tokens)
            return
        rows: dict[int, list[int]] = {}
        start = 0
        for lora_id, count in zip(lora_int_ids, num_tokens, strict=True):
            if lora_id:
                rows.setdefault(slot_of[lora_id], []).extend(range(start, start + count))
            start += count
        self.batch.slot_rows = [(slot, to_device(r, torch.int64, self.device))
                                for slot, r in rows.items()]

    def _set_indices(self, slots: list[int], num_tokens: Sequence[int],
                     num_padded_tokens: int | None) -> None:
        """Write the kernels' token-to-slot tensors (both forms) with one copy."""
        batch = self.batch
        counts = np.asarray(num_tokens, dtype=np.int64)
        token_slots = np.repeat(np.asarray(slots, dtype=np.int32), counts)
        total = len(token_slots)
        padded = max(total, num_padded_tokens or 0)
        max_num_tokens = batch.token_slots.shape[0]
        if padded > max_num_tokens:
            raise RuntimeError(f"a step of {padded} tokens exceeds the LoRA buffers' "
                               f"{max_num_tokens}")
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host_indices.numpy()
        host[:total] = token_slots
        host[total:padded] = -1
        num_adapted = write_segments(token_slots, self.config.max_loras,
                                     host[max_num_tokens:2 * max_num_tokens],
                                     host[2 * max_num_tokens:].reshape(3, -1))
        batch.packed.copy_(self._host_indices, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        batch.active = bool(num_adapted)

    def _activate(self, lora_id: int, step_ids: set[int]) -> int:
        """The slot holding ``lora_id``, loading it (and evicting) if needed."""
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        with self._lock:
            adapter = self.host.get(lora_id)
            if adapter is not None:
                self.host.move_to_end(lora_id)
        if adapter is None:  # dropped from the host cache: wait for (or make) a read
            self.num_blocking_reads += 1
            read = self._reads.pop(lora_id, None)
            adapter = read.result() if read is not None else self._read(self.requests[lora_id])
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slots if i not in step_ids)
            slot = self.slots.pop(victim)
        self._load_slot(slot, adapter)
        self.slots[lora_id] = slot
        self.num_slot_loads += 1
        return slot

    def _mark_last_use(self) -> None:
        """Record, on the compute stream, the end of the step queued last: the
        point after which the slots it used may be overwritten."""
        if self._load_stream is None or not self._used_slots:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for slot in self._used_slots:
            self._last_use[slot] = event

    def _load_slot(self, slot: int, adapter: HostAdapter) -> None:
        """Copy an adapter into ``slot``. On CUDA the copies run on a side stream
        once the last step that read the slot is done, so they overlap the
        steps still running (the least recently used slot is taken, usually
        one no queued step reads); the next step waits for them."""
        if self._load_stream is None:
            for (_, linear), packed in zip(self.linears, adapter.packed, strict=True):
                linear.load_slot(slot, packed)
            return
        last_use = self._last_use.pop(slot, None)
        if last_use is not None:
            self._load_stream.wait_event(last_use)
        with torch.cuda.stream(self._load_stream):
            for (_, linear), packed in zip(self.linears, adapter.packed, strict=True):
                linear.load_slot(slot, packed)
            self._loaded = torch.cuda.Event()
            self._loaded.record(self._load_stream)
