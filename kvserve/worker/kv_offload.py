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
the evicted blocks into a device staging buffer; then the copies in run
(host -> a second staging buffer -> their blocks: a block evicted and
refilled in one step is gathered first); then the gathered blocks go to
the host. The step waits only for the gathers (it may overwrite those
blocks), not for the copies to the host; the step after waits for the
copies in (or this one, with ``wait_for_onloads``). Everything on the host
pool and the staging buffers happens on that one stream, in order: a host
block is never overwritten before an earlier copy has read it, and a copy
in never reads a host block a copy out of the same step writes (the core
lists none). On the CPU the copies run at once, in the same order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvserve.distributed.parallel_state import ParallelState
from kvserve.worker.cpu_host import available_memory_bytes, total_memory_bytes

logger = logging.getLogger(__name__)

# byte alignment of each pool tensor's part of a host block
BLOCK_ALIGN_BYTES = 16
# the device staging buffers: blocks for one step's worth of tokens each, at most this
STAGING_MAX_BYTES = 1 << 30


def host_block_bytes(tensors: Sequence[tuple[torch.Tensor, int]]) -> int:
    """Bytes of one host block for pool tensors given as (tensor, block dim)."""
    total = 0
    for tensor, block_dim in tensors:
        total += _aligned(tensor.select(block_dim, 0).numel() * tensor.element_size())
    return total


def staging_buffer_bytes(max_step_blocks: int, block_bytes: int) -> int:
    """Device memory of the two staging buffers (out and in): one step's
    blocks each, at most ``STAGING_MAX_BYTES`` together (kept out of the KV
    pool on CUDA)."""
    return min(2 * max_step_blocks * block_bytes, STAGING_MAX_BYTES)


def num_host_blocks(kv_offload_gb: float, block_bytes: int, world_size: int = 1) -> int:
    """Host blocks of ``block_bytes`` (one rank's) that ``kv_offload_gb`` (all
    ranks together) holds."""
    return int(kv_offload_gb * 1e9) // (block_bytes * world_size)


def check_host_memory(kv_offload_gb: float, num_blocks: int, block_bytes: int,
                      num_ranks: int = 1) -> None:
    """ValueError when the host pools of ``num_ranks`` processes like this one
    (counted as if all on this machine) exceed the memory available."""
    needed = num_blocks * block_bytes * num_ranks
    available = available_memory_bytes()
    if available is None or needed <= available:
        return
    total = total_memory_bytes()
    raise ValueError(
        f"kv_offload_gb={kv_offload_gb} needs {needed / 1e9:.2f} GB of host memory for "
        f"{num_blocks} KV blocks of {block_bytes / 1e6:.2f} MB"
        f"{f' on each of {num_ranks} ranks' if num_ranks > 1 else ''}, but this machine has "
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
    check_host_memory(kv_offload_gb, num_blocks, block_bytes, parallel.layout.world_size)
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
        # [num_blocks, block_bytes]; read only where written
        self.host = torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8,
                                pin_memory=cuda)
        # [num_staging, block_bytes] each: blocks going out, blocks coming in
        num_staging = max(1, min(max_step_blocks, STAGING_MAX_BYTES // 2 // self.block_bytes))
        self.staging_out, self.staging_in = (
            torch.empty((num_staging, self.block_bytes), dtype=torch.uint8, device=device)
            for _ in range(2))
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._onloaded: torch.cuda.Event | None = None  # the last copies in, not waited for
        # the marks of ``_copy`` on CUDA (timing events) not read yet
        self._timings: deque[tuple[Any, ...]] = deque()
        self.bytes_to_host = self.bytes_to_device = 0
        self.to_host_s = self.to_device_s = 0.0

    def transfer(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]],
                 wait_for_onloads: bool) -> None:
        """Queue one step's copies (before its forward): out as (device block,
        host block), in as (host block, device block); make the step wait for
        what it must (module docstring)."""
        if self.stream is None:
            marks = self._copy(offloads, onloads)
            self._add_times(*marks)
            self._count(offloads, onloads)
            return
        main = torch.cuda.current_stream(self.device)
        if self._onloaded is not None:  # the copies in of an earlier step land first
            main.wait_event(self._onloaded)
            self._onloaded = None
        if not offloads and not onloads:
            return
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            marks = self._copy(offloads, onloads)
        if offloads:  # marks[1]: every block copied out is gathered: the step may reuse them
            main.wait_event(marks[1])
        if onloads:
            if wait_for_onloads:
                main.wait_event(marks[2])
            else:
                self._onloaded = marks[2]
        self._timings.append(marks)
        self._count(offloads, onloads)
        self._read_timings()

    def _copy(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]
              ) -> tuple[Any, Any, Any, Any]:
        """Gather the blocks going out into the out staging buffer, copy the
        blocks coming in, then copy the gathered blocks to the host: a copy in
        waits for no copy to the host of the same step (the core never lists
        one that reads a host block the same step writes). More blocks out
        than the buffer holds go out a buffer at a time first. Marks on the
        stream (CUDA events, or host clock times on the CPU) before, after the
        gathers, after the copies in, at the end."""
        chunks = _chunks(sorted(offloads, key=lambda pair: pair[1]), len(self.staging_out))
        start = self._mark()
        for chunk in chunks[:-1]:
            self._gather(chunk)
            self._write_out(chunk)
        if chunks:
            self._gather(chunks[-1])
        gathered = self._mark()
        self._copy_in(onloads)
        landed = self._mark()
        if chunks:
            self._write_out(chunks[-1])
        return start, gathered, landed, self._mark()

    def _mark(self) -> Any:
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add_times(self, start: Any, gathered: Any, landed: Any, end: Any) -> None:
        if self.stream is None:
            self.to_host_s += (gathered - start) + (end - landed)
            self.to_device_s += landed - gathered
            return
        self.to_host_s += (start.elapsed_time(gathered) + landed.elapsed_time(end)) / 1e3
        self.to_device_s += gathered.elapsed_time(landed) / 1e3

    def _count(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        self.bytes_to_host += len(offloads) * self.block_bytes
        self.bytes_to_device += len(onloads) * self.block_bytes

    def _gather(self, chunk: list[tuple[int, int]]) -> None:
        """Device blocks -> the out staging buffer's first rows."""
        ids = self._ids([block_id for block_id, _ in chunk])
        num = len(chunk)
        for view, offset, size in self.layout:
            self.staging_out[:num, offset:offset + size].copy_(
                view.index_select(0, ids).reshape(num, size))

    def _write_out(self, chunk: list[tuple[int, int]]) -> None:
        """The out staging buffer's rows -> their host blocks (runs of
        consecutive host blocks in one copy each)."""
        for row, host_id, length in _runs([host_id for _, host_id in chunk]):
            self.host[host_id:host_id + length].copy_(self.staging_out[row:row + length],
                                                      non_blocking=True)

    def _copy_in(self, onloads: list[tuple[int, int]]) -> None:
        """Host blocks -> the in staging buffer -> device blocks, a buffer at a time."""
        for chunk in _chunks(sorted(onloads), len(self.staging_in)):
            num = len(chunk)
            for row, host_id, length in _runs([host_id for host_id, _ in chunk]):
                self.staging_in[row:row + length].copy_(self.host[host_id:host_id + length],
                                                        non_blocking=True)
            ids = self._ids([block_id for _, block_id in chunk])
            for view, offset, size in self.layout:
                source = self.staging_in[:num, offset:offset + size].view(num, *view.shape[1:])
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
        while self._timings and self._timings[0][-1].query():
            self._add_times(*self._timings.popleft())

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
