"""KV cache manager: which blocks each request owns, prefix-cache lookups,
and slot allocation for each step.

It decides nothing about scheduling; the scheduler asks it whether a request
can get room for ``num_new_tokens`` more tokens and it answers yes (and
allocates) or no (and changes nothing). Pure Python: no torch here.
"""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.prefix_cache import update_block_hashes
from kvserve.core.request import Request


class KVCacheManager:
    """Per-request block lists on top of one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # how many leading blocks of each request are already registered by hash
        self._num_hashed_blocks: dict[str, int] = {}
        # the most tokens each request may reach with no new block and no newly
        # full block to register: a step within it changes nothing here
        self._room: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks for a request not yet holding any.

        At least one token is always left to compute, so the step that
        follows produces the logits for the next token. A request that wants
        prompt logprobs not all in yet reads nothing (``awaits_prompt_logprobs``).
        """
        if not self.enable_caching or request.awaits_prompt_logprobs:
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` beyond what the request has computed
        (plus the cache-hit blocks, for a request being admitted). Returns the
        newly allocated blocks, or None when the pool is too small (nothing
        changes then)."""
        request_id = request.request_id
        if (not new_computed_blocks
                and request.num_computed_tokens + num_new_tokens <= self._room.get(request_id, -1)):
            return []  # the common decode step (15 in 16 with blocks of 16)
        computed = new_computed_blocks or []
        held = self.req_to_blocks.get(request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        end = num_computed + num_new_tokens
        if not computed and end <= len(held) * self.block_size:
            self._cache_full_blocks(request, end)  # a block fills up: register it
            return []
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens) - len(held) - len(
            computed
        )
        # cache-hit blocks sitting in the free queue stop being free once touched
        num_reclaimed = sum(1 for block in computed if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks = self.req_to_blocks.setdefault(request_id, [])
        blocks.extend(computed)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Register the blocks this step fills with known tokens, then update
        the request's room."""
        request_id = request.request_id
        num_slots = len(self.req_to_blocks[request_id]) * self.block_size
        if not self.enable_caching:
            self._room[request_id] = num_slots
            return
        num_full = min(num_tokens_after_step, len(request.all_token_ids)) // self.block_size
        num_done = self._num_hashed_blocks.get(request_id, 0)
        if num_full > num_done:
            hashes = update_block_hashes(request, self.block_size)
            blocks = self.req_to_blocks[request_id]
            for i in range(num_done, num_full):
                self.pool.cache_full_block(blocks[i], hashes[i])
            self._num_hashed_blocks[request_id] = num_done = num_full
        # the next block to register fills at (num_done + 1) * block_size tokens
        self._room[request_id] = min(num_slots, (num_done + 1) * self.block_size - 1)

    def free_tail(self, request: Request) -> None:
        """Release the request's whole blocks past its computed tokens: the
        slots of rejected proposals and of a proposer's lookahead. Such
        blocks never hold a registered hash (only blocks full of accepted
        tokens are registered, and those lie within the computed tokens)."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        keep = self.num_blocks_needed(request.num_computed_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(list(reversed(tail)))
        num_done = self._num_hashed_blocks.get(request_id, 0)
        num_slots = len(blocks) * self.block_size
        self._room[request_id] = (num_slots if not self.enable_caching
                                  else min(num_slots, (num_done + 1) * self.block_size - 1))

    def free(self, request: Request) -> None:
        """Release every block of a request, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        self._room.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def usage(self) -> float:
        return self.pool.usage()
