"""The host KV tier's memory and its copies: a pool of host blocks (pinned on
CUDA, ordinary memory on the CPU) and the copies the scheduler lists with
each step (``SchedulerOutput.kv_offloads`` / ``kv_onloads``), run in the
order listed. It decides nothing: which block goes where is the core's
(``core/kv_manager.py``, ``core/host_pool.py``).

A host block is one row of bytes holding a device block of every pool
tensor (each layer's K and V, a proposer's KV, per-block scales: whatever
tensors are handed in, with their block dimension), so the copies do not
care about dtypes: they move bytes.

On CUDA the copies run on a side stream, which first waits for every step
queued before (a block's KV may still be being written). Copies out gather
the evicted blocks into a device staging buffer, then copy it to the host;
the step waits only for the gather (the step may overwrite those blocks),
not for the copy to the host. Copies in go host -> staging -> their blocks;
the step after waits for them (or this one, with ``wait_for_onloads``).
Everything on the host pool and the staging buffer happens on that one
stream, in order: a host block is never overwritten before an earlier copy
has read it. On the CPU the copies run at once, in the same order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

import torch

from kvserve.distributed.parallel_state import ParallelState
from kvserve.worker.cpu_host import available_memory_bytes, total_memory_bytes

logger = logging.getLogger(__name__)

# byte alignment of each pool tensor's part of a host block
BLOCK_ALIGN_BYTES = 16
# the device staging buffer: blocks for one step's worth of tokens, at most this
STAGING_MAX_BYTES = 1 << 30


def host_block_bytes(tensors: Sequence[tuple[torch.Tensor, int]]) -> int:
    """Bytes of one host block for pool tensors given as (tensor, block dim)."""
    total = 0
    for tensor, block_dim in tensors:
        total += _aligned(tensor.select(block_dim, 0).numel() * tensor.element_size())
    return total


def staging_buffer_bytes(max_step_blocks: int, block_bytes: int) -> int:
    """Device memory of the staging buffer: one step's blocks, at most
    ``STAGING_MAX_BYTES`` (kept out of the KV pool on CUDA)."""
    return min(max_step_blocks * block_bytes, STAGING_MAX_BYTES)


def num_host_blocks(kv_offload_gb: float, block_bytes: int, world_size: int = 1) -> int:
    """Host blocks of ``block_bytes`` (one rank's) that ``kv_offload_gb`` (all
    ranks together) holds."""
    return int(kv_offload_gb * 1e9) // (block_bytes * world_size)


def check_host_memory(kv_offload_gb: float, num_blocks: int, block_bytes: int) -> None:
    """ValueError when this process's host pool exceeds the memory available."""
    needed = num_blocks * block_bytes
    available = available_memory_bytes()
    if available is None or needed <= available:
        return
    total = total_memory_bytes()
    raise ValueError(
        f"kv_offload_gb={kv_offload_gb} needs {needed / 1e9:.2f} GB of host memory for "
        f"{num_blocks} KV blocks of {block_bytes / 1e6:.2f} MB, but this machine has "
        f"{available / 1e9:.2f} GB available{f' ({total / 1e9:.1f} GB in all)' if total else ''}"
        f"; use --kv-offload-gb {available * 0.8 / 1e9:.1f} or less"
    )


def create_kv_offloader(tensors: Sequence[tuple[torch.Tensor, int]], kv_offload_gb: float,
                        parallel: ParallelState, device: torch.device,
                        max_step_blocks: int) -> KVOffloader:
    """The host tier of ``kv_offload_gb`` over the pool tensors given as
    (tensor, block dim); parallel ranks agree on its block count. ValueError
    when it holds no block or does not fit the host's memory."""
    block_bytes = host_block_bytes(tensors)
    num_blocks = parallel.min_over_ranks(
        num_host_blocks(kv_offload_gb, block_bytes, parallel.layout.world_size))
    if num_blocks < 1:
        raise ValueError(f"kv_offload_gb={kv_offload_gb} holds no KV block of "
                         f"{block_bytes / 1e6:.2f} MB; give at least one block's worth, or 0 "
                         "to turn the host tier off")
    check_host_memory(kv_offload_gb, num_blocks, block_bytes)
    offloader = KVOffloader(tensors, num_blocks, device, max_step_blocks)
    logger.info("host KV tier: %d blocks of %.2f MB, %.2f GB%s", num_blocks, block_bytes / 1e6,
                num_blocks * block_bytes / 1e9, " pinned" if device.type == "cuda" else "")
    return offloader


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // BLOCK_ALIGN_BYTES) * BLOCK_ALIGN_BYTES


class KVOffloader:
    """The host pool and the copies between it and the device's pool tensors."""

    def __init__(self, tensors: Sequence[tuple[torch.Tensor, int]], num_blocks: int,
                 device: torch.device, max_step_blocks: int) -> None:
        self.device = device
        # per pool tensor: a byte view with blocks first, its offset and size in a host block
        self.layout: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for tensor, block_dim in tensors:
            view = tensor.view(torch.uint8).movedim(block_dim, 0)  # [num_blocks, ...] bytes
            size = view[0].numel()
            self.layout.append((view, offset, size))
            offset += _aligned(size)
        self.block_bytes = offset
        cuda = device.type == "cuda"
        # [num_blocks, block_bytes]
        self.host = torch.zeros((num_blocks, self.block_bytes), dtype=torch.uint8,
                                pin_memory=cuda)
        num_staging = max(1, min(max_step_blocks, STAGING_MAX_BYTES // self.block_bytes))
        self.staging = torch.empty((num_staging, self.block_bytes), dtype=torch.uint8,
                                   device=device)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._onloaded: torch.cuda.Event | None = None  # the last copies in, not waited for
        # CUDA timing events (start, copies out done, copies in done) not read yet
        self._timings: deque[tuple[torch.cuda.Event, ...]] = deque()
        self.bytes_to_host = self.bytes_to_device = 0
        self.to_host_s = self.to_device_s = 0.0

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    def transfer(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]],
                 wait_for_onloads: bool) -> None:
        """Queue one step's copies (before its forward): out as (device block,
        host block), then in as (host block, device block); make the step
        wait for what it must (module docstring)."""
        if self.stream is None:
            start = time.perf_counter()
            self._copy_out(offloads)
            middle = time.perf_counter()
            self._copy_in(onloads)
            self.to_host_s += middle - start
            self.to_device_s += time.perf_counter() - middle
            self._count(offloads, onloads)
            return
        main = torch.cuda.current_stream(self.device)
        if self._onloaded is not None:  # the copies in of an earlier step land first
            main.wait_event(self._onloaded)
            self._onloaded = None
        if not offloads and not onloads:
            return
        self.stream.wait_stream(main)
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(self.stream):
            events[0].record()
            gathered = self._copy_out(offloads)
            events[1].record()
            self._copy_in(onloads)
            events[2].record()
        if gathered is not None:
            main.wait_event(gathered)
        if onloads:
            if wait_for_onloads:
                main.wait_event(events[2])
            else:
                self._onloaded = events[2]
        self._timings.append(events)
        self._count(offloads, onloads)
        self._read_timings()

    def _count(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        self.bytes_to_host += len(offloads) * self.block_bytes
        self.bytes_to_device += len(onloads) * self.block_bytes

    def _copy_out(self, offloads: list[tuple[int, int]]) -> torch.cuda.Event | None:
        """Device blocks -> staging -> host blocks, a staging buffer at a time;
        on CUDA the event after the last gather (the blocks may be reused then)."""
        gathered = None
        pairs = sorted(offloads, key=lambda pair: pair[1])
        for chunk in _chunks(pairs, len(self.staging)):
            ids = self._ids([block_id for block_id, _ in chunk])
            num = len(chunk)
            for view, offset, size in self.layout:
                self.staging[:num, offset:offset + size].copy_(
                    view.index_select(0, ids).reshape(num, size))
            if self.stream is not None:
                gathered = torch.cuda.Event()
                gathered.record()
            for row, host_id, length in _runs([host_id for _, host_id in chunk]):
                self.host[host_id:host_id + length].copy_(self.staging[row:row + length],
                                                          non_blocking=True)
        return gathered

    def _copy_in(self, onloads: list[tuple[int, int]]) -> None:
        """Host blocks -> staging -> device blocks, a staging buffer at a time."""
        pairs = sorted(onloads)
        for chunk in _chunks(pairs, len(self.staging)):
            num = len(chunk)
            for row, host_id, length in _runs([host_id for host_id, _ in chunk]):
                self.staging[row:row + length].copy_(self.host[host_id:host_id + length],
                                                     non_blocking=True)
            ids = self._ids([block_id for _, block_id in chunk])
            for view, offset, size in self.layout:
                source = self.staging[:num, offset:offset + size].view(num, *view.shape[1:])
                view.index_copy_(0, ids, source)

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the device, copied without waiting for the stream
        (a plain copy would wait for every step queued before)."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.stream is None:
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _read_timings(self) -> None:
        """Add the copy times of finished steps (CUDA events, never waited for)."""
        while self._timings and self._timings[0][2].query():
            start, middle, end = self._timings.popleft()
            self.to_host_s += start.elapsed_time(middle) / 1e3
            self.to_device_s += middle.elapsed_time(end) / 1e3

    def stats(self) -> dict[str, float]:
        """Bytes copied each way and the time the copies took (CUDA: of the
        copies finished so far)."""
        self._read_timings()
        return {"kv_host_block_bytes": self.block_bytes,
                "kv_host_bytes_to_host": self.bytes_to_host,
                "kv_host_bytes_to_device": self.bytes_to_device,
                "kv_host_copy_to_host_s": self.to_host_s,
                "kv_host_copy_to_device_s": self.to_device_s}


def _chunks(pairs: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


def _runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(row, first host id, length) of each run of consecutive ids in ``host_ids``."""
    runs: list[tuple[int, int, int]] = []
    for row, host_id in enumerate(host_ids):
        if runs and runs[-1][1] + runs[-1][2] == host_id:
            first_row, first_id, length = runs[-1]
            runs[-1] = (first_row, first_id, length + 1)
        else:
            runs.append((row, host_id, 1))
    return runs
