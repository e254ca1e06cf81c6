"""``LoRALinear``: a base linear plus the LoRA deltas of the adapters resident
on the device, and ``LoRABatch``, which rows of a step use which adapter slot.

The base weights stay unmerged, so every request of a batch can use its own
adapter, or none. A wrapped linear holds stacked, zero-padded buffers with
one slot per resident adapter; its output is split into slices (q, k, v of
a packed ``qkv_proj``; gate, up of ``gate_up_proj``; else the whole output),
each with its own A and B:

- ``lora_a`` ``[num_slices, max_loras, max_rank, input_size]``;
- ``lora_b`` ``[max_loras, output_size, max_rank]``, slice ``s`` in its rows;
  the adapter's scaling is folded into B when it is written.

For each slot used in the step, the forward adds
``(x[rows] @ A[s, slot].T) @ B[slot, slice s].T`` to the base output's rows:
tokens grouped by slot, in plain torch (a punica-style Triton kernel is the
GPU path still to come). The buffers are written only by ``LoRAManager``.

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

from kvserve.layers.linear import Linear


class LoRABatch:
    """The step's rows grouped by adapter slot; shared by every ``LoRALinear``
    and set once per step by ``LoRAManager.set_batch``."""

    def __init__(self) -> None:
        # (slot, row indices [num_rows] int64 on the device) per slot used this step
        self.slot_rows: list[tuple[int, torch.Tensor]] = []


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
        # slots whose adapter has weights for this linear; the others add nothing
        self.loaded_slots: set[int] = set()

    def set_slot(self, slot: int, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter into ``slot``: per HF module name, the whole ``A [rank,
        in_features]`` and ``scaling * B [out_features, rank]`` (this rank takes
        its part); slices it lacks stay zero."""
        self.lora_a[:, slot].zero_()
        self.lora_b[slot].zero_()
        self.loaded_slots.discard(slot)
        input_size = self.lora_a.shape[-1]
        for index, piece in enumerate(self.slices):
            if piece.name not in weights:
                continue
            lora_a, lora_b = weights[piece.name]
            rank = lora_a.shape[0]
            self.lora_a[index, slot, :rank].copy_(
                lora_a[:, piece.a_start:piece.a_start + input_size])
            self.lora_b[slot, piece.offset:piece.offset + piece.size, :rank].copy_(
                lora_b[piece.b_start:piece.b_start + piece.size])
            self.loaded_slots.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.forward_local(x)  # [num_tokens, output_size]
        for slot, rows in self.batch.slot_rows:
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
