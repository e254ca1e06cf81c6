"""KV cache manager: which blocks each request owns, prefix-cache lookups,
and slot allocation for each step.

It decides nothing about scheduling; the scheduler asks it whether a request
can get room for ``num_new_tokens`` more tokens and it answers yes (and
allocates) or no (and changes nothing).

With a host tier (``num_host_blocks``) it also keeps the books of the copies
between the tiers, which the scheduler hands to the runner with each step
(``take_transfers``): a cached block the pool evicts is copied out to the
host (``HostBlockPool``); a request whose prefix goes on past its device
hits with host hits gets fresh blocks that the host's copies are written
into (``start_onload``), and runs from the next step on, once they have
landed (``landing``); a preempted request's computed blocks can be copied
out first (``swap_out``). The runner gathers the blocks going out before it
writes the blocks coming in (a block evicted and refilled in the same step
is read before it is overwritten) and copies in before it copies out to
the host, so no copy in may read a host block written in the same step.
Pure Python: no torch here.
"""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.host_pool import HostBlockPool
from kvserve.core.prefix_cache import partial_block_hash, update_block_hashes
from kvserve.core.request import Request


class KVCacheManager:
    """Per-request block lists on top of one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host = HostBlockPool(num_host_blocks) if num_host_blocks and enable_caching else None
        if self.host is not None:
            self.pool.on_evict = self._offload
        # this step's copies: host block -> device block out (a host block
        # reused within the step keeps its last), (host, device) block in
        self._offloads: dict[int, int] = {}
        self._onloads: list[tuple[int, int]] = []
        # requests whose blocks are being copied in -> the tokens they will hold
        self.landing: dict[str, int] = {}
        # device blocks whose copies in were queued this step, and whether a
        # request admitted this step reads one (its step must wait for them)
        self._landing_block_ids: set[int] = set()
        self._reads_landing = False
        self.host_cache_hits = 0  # tokens found on the host
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0
        self.num_swapped_blocks = 0
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
            if self._landing_block_ids and block.block_id in self._landing_block_ids:
                self._reads_landing = True
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

    def free_tail(self, request: Request, num_tokens: int) -> int | None:
        """Release the request's whole blocks past its first ``num_tokens``
        slots (its computed tokens, and the lookahead of a step in flight):
        the slots of rejected proposals and of a proposer's lookahead. Such
        blocks never hold a registered hash (only blocks full of accepted
        tokens are registered, and those lie within the computed tokens).
        Returns how many blocks it keeps, or None when none was freed."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        keep = self.num_blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return None
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(list(reversed(tail)))
        num_done = self._num_hashed_blocks.get(request_id, 0)
        num_slots = len(blocks) * self.block_size
        self._room[request_id] = (num_slots if not self.enable_caching
                                  else min(num_slots, (num_done + 1) * self.block_size - 1))
        return keep

    def free(self, request: Request) -> None:
        """Release every block of a request, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.landing.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        self._room.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def usage(self) -> float:
        return self.pool.usage()

    # ---------------------------------------------------------------- host tier

    def _offload(self, block_id: int, block_hash: bytes) -> None:
        """The pool evicts a cached block: copy it to the host, unless it is there."""
        assert self.host is not None
        host_id = self.host.store(block_hash)
        if host_id is not None:
            self._offloads[host_id] = block_id
            self.num_offloaded_blocks += 1

    def start_onload(self, request: Request, computed: list[KVBlock],
                     max_landing: int) -> bool:
        """Queue copies of the host's blocks that continue a waiting request's
        device hits ``computed`` (and of its swapped-out partial block): the
        request then holds those blocks and fresh ones for the copies, and is
        in ``landing`` until the next step. False (nothing changes) without
        host hits, with ``max_landing`` requests landing already, or when the
        pool has no room."""
        if self.host is None or request.awaits_prompt_logprobs or len(self.landing) >= max_landing:
            return False
        block_size = self.block_size
        hashes = request.block_hashes  # get_computed_blocks brought them up to date
        max_hit_blocks = (request.num_tokens - 1) // block_size
        host_ids = []
        for block_hash in hashes[len(computed):max_hit_blocks]:
            host_id = self._host_lookup(block_hash)
            if host_id is None:
                break
            host_ids.append(host_id)
        num_full = len(computed) + len(host_ids)
        num_tokens = num_full * block_size
        if num_full == max_hit_blocks and request.num_tokens - 1 > num_tokens:
            partial_id = self._host_lookup(
                partial_block_hash(request, block_size, request.num_tokens - 1))
            if partial_id is not None:
                host_ids.append(partial_id)
                num_tokens = request.num_tokens - 1
        num_reclaimed = sum(1 for block in computed if block.ref_cnt == 0)
        if not host_ids or len(host_ids) > self.pool.num_free_blocks - num_reclaimed:
            return False
        self.pool.touch(computed)
        new_blocks = self.pool.get_new_blocks(len(host_ids))  # evictions queue copies out
        for i, (block, host_id) in enumerate(zip(new_blocks, host_ids, strict=True)):
            if len(computed) + i < num_full:
                self.pool.cache_full_block(block, hashes[len(computed) + i])
            self._onloads.append((host_id, block.block_id))
            self._landing_block_ids.add(block.block_id)
        self.req_to_blocks[request.request_id] = computed + new_blocks
        self._num_hashed_blocks[request.request_id] = num_full
        self.landing[request.request_id] = num_tokens
        self.host_cache_hits += num_tokens - len(computed) * block_size
        self.num_onloaded_blocks += len(new_blocks)
        return True

    def allocate_for_receive(self, request: Request, computed: list[KVBlock],
                             num_tokens: int) -> list[KVBlock] | None:
        """Hold the blocks that a request's first ``num_tokens`` tokens' KV
        will be received into (disaggregated decode), after its prefix hits
        ``computed``: the fresh ones are returned, and registered by hash
        only once the request is admitted (``landing``), as their KV is not
        there before. None (nothing changes) when the pool has no room."""
        num_needed = self.num_blocks_needed(num_tokens) - len(computed)
        num_reclaimed = sum(1 for block in computed if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return None
        self.pool.touch(computed)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        self.req_to_blocks[request.request_id] = computed + new_blocks
        self._num_hashed_blocks[request.request_id] = len(computed)
        return new_blocks

    def _host_lookup(self, block_hash: bytes) -> int | None:
        """A host block to copy in, unless this step's copies out write it (the
        runner copies in before it copies out: the block is still on the
        device then, but its hash no longer is)."""
        assert self.host is not None
        host_id = self.host.lookup(block_hash)
        return None if host_id is None or host_id in self._offloads else host_id

    def swap_out(self, request: Request, num_tokens: int) -> None:
        """Queue copies to the host of a request about to be freed: its first
        ``num_tokens`` tokens' KV, its full registered blocks under their
        hashes and a partly filled last one under ``partial_block_hash``."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.host is None or not blocks or request.awaits_prompt_logprobs:
            return
        num_full = min(num_tokens // self.block_size,
                       self._num_hashed_blocks.get(request.request_id, 0))
        keys = list(request.block_hashes[:num_full])
        num_rest = num_tokens - num_full * self.block_size
        if 0 < num_rest < self.block_size and num_full < len(blocks):
            keys.append(partial_block_hash(request, self.block_size, num_tokens))
        for block, key in zip(blocks, keys, strict=False):
            host_id = self.host.store(key)
            if host_id is not None:
                self._offloads[host_id] = block.block_id
                self.num_swapped_blocks += 1

    def begin_step(self) -> None:
        """A new step is planned: the copies in queued by earlier ones have landed."""
        self._landing_block_ids.clear()
        self._reads_landing = False

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], bool]:
        """This step's copies: out as (device block, host block), in as
        (host block, device block), and whether the step reads blocks whose
        copies in it queues itself. The host may evict again afterwards."""
        offloads = [(block_id, host_id) for host_id, block_id in self._offloads.items()]
        onloads = self._onloads
        self._offloads, self._onloads = {}, []
        if self.host is not None:
            self.host.end_step()
        return offloads, onloads, self._reads_landing
