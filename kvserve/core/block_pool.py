"""The pool of fixed-size KV blocks: reference counts, an LRU free queue and
the map from block hash to cached block.

A block whose reference count drops to zero goes to the back of the free
queue but keeps its hash: a later request with the same prefix can take it
back (a prefix-cache hit) until it is evicted, which happens only when it
reaches the front of the queue and is handed out as a new block.

Block 0 is the null block: never handed out, so padded entries of block
tables and slot mappings can point at it without corrupting anyone's KV.
Pure Python: no torch here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

NULL_BLOCK_ID = 0


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0
    # hash of the full block's tokens chained over its prefix; None while partial
    block_hash: bytes | None = None


class BlockPool:
    """Hands out blocks, takes them back, and remembers full blocks by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks={num_blocks} must be >= 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # held forever
        # front = least recently freed = first to be evicted
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        # told (block id, hash) of each cached block just before it is evicted
        # (the host KV tier copies it out)
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, whether cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Share of usable blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def is_free(self, block: KVBlock) -> bool:
        return block.block_id in self._free

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the front of the free queue, evicting their hashes."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; unreferenced ones join the back of
        the queue in the order given (callers pass a request's tail first, so
        its tail is evicted before the prefix others are likelier to share)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a block that just became full. If an identical block is
        already cached, this one stays anonymous (the first copy wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
        block.block_hash = None
