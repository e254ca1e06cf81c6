"""``LoRALinear``: a base linear plus the LoRA deltas of the adapters resident
on the device, and ``LoRABatch``, which tokens of a step use which adapter slot.

The base weights stay unmerged, so every request of a batch can use its own
adapter, or none. A wrapped linear holds stacked, zero-padded buffers with
one slot per resident adapter; its output is split into slices (q, k, v of
a packed ``qkv_proj``; gate, up of ``gate_up_proj``; else the whole output),
each with its own A and B:

- ``lora_a`` ``[num_slices, max_loras, max_rank, input_size]``;
- ``lora_b`` ``[max_loras, output_size, max_rank]``, slice ``s`` in its rows;
  the adapter's scaling is folded into B when it is written.

Two paths compute the same delta:

- the batched kernels (``kernels/lora.py``, on CUDA with the Triton ops):
  one shrink and one expand launch per linear for all slices and adapters,
  reading the step's token-to-slot tensors from ``LoRABatch``'s fixed
  device buffers, so CUDA graphs capture them and replay with any adapters;
- the torch reference (the oracle, and the CPU path): for each slot used
  in the step, ``(x[rows] @ A[s, slot].T) @ B[slot, slice s].T`` added to
  the base output's rows with ``index_select`` / ``index_add_``.

The buffers are written only by ``LoRAManager`` (``load_slot``).

With tensor parallelism an adapter is split as its base linear is: a
column-parallel base keeps A whole and its rows of each slice's B; a
row-parallel base keeps its input columns of A and B whole, and adds its
partial delta before the base's all-reduce, which sums the deltas too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

from kvserve.kernels.lora import SPLIT_K, lora_expand, lora_shrink, num_tiles
from kvserve.layers.linear import Linear

# steps of at most this many tokens run the gathered form of the kernels, larger
# ones the segmented form; a captured graph size, so that a step and the graph
# it replays pick the same form (and do the same arithmetic)
GATHER_MAX_TOKENS = 16


class LoRABatch:
    """Which tokens of the step use which adapter slot; shared by every
    ``LoRALinear`` and set once per step by ``LoRAManager.set_batch``.

    The torch path reads ``slot_rows``. The kernel path reads int32 device
    tensors, views of one buffer written by one copy per step:
    ``token_slots [max_num_tokens]`` (-1: no adapter; padding tokens too),
    ``sorted_ids`` (the tokens with an adapter, grouped by slot) and
    ``tiles [3, max_tiles]`` (``kernels/lora.py``); its shrink writes
    ``shrunk [SPLIT_K, max_slices, max_num_tokens, max_rank]`` float32.
    """

    def __init__(self, use_kernels: bool = False) -> None:
        # (slot, row indices [num_rows] int64 on the device) per slot used this step
        self.slot_rows: list[tuple[int, torch.Tensor]] = []
        self.use_kernels = use_kernels
        # whether the kernels run: an eager step without adapters skips them; a
        # CUDA graph is captured with them and replays them whatever this says
        self.active = False
        self.packed = torch.zeros(0, dtype=torch.int32)
        self.token_slots = self.sorted_ids = self.packed
        self.tiles = self.packed.view(1, 0)
        self.shrunk = torch.zeros(0, 0, 0, 0)

    def allocate(self, max_num_tokens: int, max_loras: int, max_slices: int, max_rank: int,
                 device: torch.device) -> None:
        """The kernels' fixed device buffers (once, before any graph is captured)."""
        max_tiles = num_tiles(max_num_tokens, max_loras)
        self.packed = torch.full((2 * max_num_tokens + 3 * max_tiles,), -1, dtype=torch.int32,
                                 device=device)
        self.token_slots = self.packed[:max_num_tokens]
        self.sorted_ids = self.packed[max_num_tokens:2 * max_num_tokens]
        self.tiles = self.packed[2 * max_num_tokens:].view(3, max_tiles)
        self.shrunk = torch.zeros(SPLIT_K, max_slices, max_num_tokens, max_rank,
                                  dtype=torch.float32, device=device)

    def indices(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """The index tensors of a ``num_tokens`` step's form, as the kernels take them."""
        if num_tokens <= GATHER_MAX_TOKENS:
            return {"token_slots": self.token_slots}
        return {"sorted_ids": self.sorted_ids, "tiles": self.tiles}


class LoRASlice(NamedTuple):
    """One slice of a wrapped linear's output, with its own A and B."""

    name: str  # the HF module whose adapter weights it takes
    offset: int  # its first row in this rank's output
    size: int  # its rows on this rank
    b_start: int = 0  # where those rows start in the adapter's B
    a_start: int = 0  # where this rank's input columns start in the adapter's A


class LoRALinear(nn.Module):
    """``base(x)`` plus, for each row, the delta of the adapter in its slot."""

    def __init__(
        self,
        base: Linear,
        slices: Sequence[LoRASlice | tuple[str, int, int]],
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
    ) -> None:
        """``slices`` in output order: ``LoRASlice`` or ``(HF module name, offset,
        size)`` of a linear one process holds whole."""
        super().__init__()
        self.base = base
        self.slices = [LoRASlice(*piece) for piece in slices]
        self.batch = batch
        dtype, device = base.params_dtype, base.device
        self.lora_a: torch.Tensor  # [num_slices, max_loras, max_rank, input_size]
        self.register_buffer("lora_a", torch.zeros(
            len(self.slices), max_loras, max_rank, base.input_size, dtype=dtype, device=device,
        ), persistent=False)
        self.lora_b: torch.Tensor  # [max_loras, output_size, max_rank]
        self.register_buffer("lora_b", torch.zeros(
            max_loras, base.output_size, max_rank, dtype=dtype, device=device,
        ), persistent=False)
        # slots whose adapter has weights for this linear; the torch path skips the others
        self.loaded_slots: set[int] = set()
        # [2, num_slices] int32: each slice's first row and rows, for the expand kernel
        self.slice_table = torch.tensor(
            [[piece.offset for piece in self.slices], [piece.size for piece in self.slices]],
            dtype=torch.int32, device=device)
        self.max_slice_size = max(piece.size for piece in self.slices)

    def pack(self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An adapter's weights for this linear in a slot's layout, on the host
        and in the buffers' dtype: ``(A [num_slices, max_rank, input_size], B
        [output_size, max_rank])``, from the whole ``A [rank, in_features]`` and
        ``scaling * B [out_features, rank]`` per HF module name (this rank takes
        its part; slices the adapter lacks stay zero). None: it has none."""
        if not any(piece.name in weights for piece in self.slices):
            return None
        num_slices, _, max_rank, input_size = self.lora_a.shape
        packed_a = torch.zeros(num_slices, max_rank, input_size, dtype=self.lora_a.dtype)
        packed_b = torch.zeros(self.lora_b.shape[1], max_rank, dtype=self.lora_b.dtype)
        for index, piece in enumerate(self.slices):
            if piece.name not in weights:
                continue
            lora_a, lora_b = weights[piece.name]
            rank = lora_a.shape[0]
            packed_a[index, :rank] = lora_a[:, piece.a_start:piece.a_start + input_size]
            packed_b[piece.offset:piece.offset + piece.size, :rank] = \
                lora_b[piece.b_start:piece.b_start + piece.size]
        return packed_a, packed_b

    def load_slot(self, slot: int, packed: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy ``pack``'s output into ``slot`` (None: zeros), queued on the
        current stream without waiting (pinned host memory)."""
        self.loaded_slots.discard(slot)
        if packed is None:
            self.lora_a[:, slot].zero_()
            self.lora_b[slot].zero_()
            return
        self.lora_a[:, slot].copy_(packed[0], non_blocking=True)
        self.lora_b[slot].copy_(packed[1], non_blocking=True)
        self.loaded_slots.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.forward_local(x)  # [num_tokens, output_size]
        batch = self.batch
        if batch.use_kernels:
            if batch.active:
                indices = batch.indices(x.shape[0])
                lora_shrink(x, self.lora_a, batch.shrunk, **indices)
                lora_expand(batch.shrunk, self.lora_b, out, self.slice_table,
                            self.max_slice_size, **indices)
            return self.base.reduce(out)
        for slot, rows in batch.slot_rows:
            if slot not in self.loaded_slots:
                continue
            rows_x = x.index_select(0, rows)  # [num_rows, input_size]
            deltas = [
                (rows_x @ self.lora_a[index, slot].T)
                @ self.lora_b[slot, piece.offset:piece.offset + piece.size].T
                for index, piece in enumerate(self.slices)
            ]  # each [num_rows, size]
            out.index_add_(0, rows, torch.cat(deltas, dim=1))
        return self.base.reduce(out)

    def extra_repr(self) -> str:
        names = ", ".join(piece.name for piece in self.slices)
        max_loras, _, max_rank = self.lora_b.shape
        return f"slices=[{names}], max_loras={max_loras}, max_rank={max_rank}"
