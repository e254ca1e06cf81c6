"""The host tier of the prefix cache: which host-memory block holds the KV
of which block hash, in least-recently-used order.

Blocks the device pool evicts are stored here under the same chained hash
(LoRA adapter and cache key included), so a later request whose prefix
misses on the device and hits here gets its KV copied back instead of
recomputed. The tier is inclusive: a block copied back stays here too.
A full pool evicts its least recently used block; storing never fails
except when every block is the source of a copy queued in the step being
planned (``end_step`` lifts that), and then the block is simply not kept.

It only keeps the books: the copies themselves are the worker's
(``worker/kv_offload.py``), in the order the scheduler lists them. Pure
Python: no torch here.
"""

from __future__ import annotations

from collections import OrderedDict


class HostBlockPool:
    """Block hash -> host block id, least recently used first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_host_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._free_ids = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, ...
        # host blocks that copies queued in this step read: not evicted before they run
        self._protected: set[int] = set()
        self.num_evictions = 0

    @property
    def num_used_blocks(self) -> int:
        return len(self._blocks)

    def lookup(self, block_hash: bytes) -> int | None:
        """The host block holding ``block_hash``; a hit becomes the most
        recently used and is kept until the step's copies are queued."""
        block_id = self._blocks.get(block_hash)
        if block_id is not None:
            self._blocks.move_to_end(block_hash)
            self._protected.add(block_id)
        return block_id

    def store(self, block_hash: bytes) -> int | None:
        """The host block to copy a block with ``block_hash`` into, or None
        when no copy is needed (already here: made most recent) or none can
        be made (every block is read by this step's copies)."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return None
        if self._free_ids:
            block_id = self._free_ids.pop()
        else:
            victim = next((h for h, b in self._blocks.items() if b not in self._protected), None)
            if victim is None:
                return None
            block_id = self._blocks.pop(victim)
            self.num_evictions += 1
        self._blocks[block_hash] = block_id
        return block_id

    def end_step(self) -> None:
        """The step's copies are queued: every block may be evicted again."""
        self._protected.clear()
