"""Block hashes for prefix caching: a hash chained over the parent block's
hash, the block's token ids and extra keys (the request's cache key and its
LoRA adapter id: KV computed under an adapter differs from the base model's).

A swapped-out request's partly filled last block is keyed the same way,
with one more extra key (``partial_block_hash``). Two requests share a
cached block only if their whole prefix up to and
including that block is identical under the same extra keys. BLAKE2b is
used, not Python's ``hash``, so the value is stable across processes (for a
prefix-aware router later) and collisions are not a practical concern.
Pure Python: no torch here.
"""

from __future__ import annotations

import hashlib
from array import array

from kvserve.core.request import Request

ROOT_HASH = b"kvserve-root"


def hash_block(parent_hash: bytes, token_ids: list[int], extra_keys: tuple[int, ...]) -> bytes:
    """The chained hash of one full block."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    for key in extra_keys:
        digest.update(key.to_bytes(8, "little", signed=True))
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens."""
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    tokens = request.all_token_ids
    while len(hashes) < num_full_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, tokens[i * block_size:(i + 1) * block_size],
                                 (request.cache_key, request.lora_int_id)))
    return hashes


# extra key of a partly filled block's hash: such a block (a swapped-out
# request's last one) is never the parent of another and never shared on the
# device, only found again on the host by the request that left it there
PARTIAL_BLOCK_KEY = -1


def partial_block_hash(request: Request, block_size: int, num_tokens: int) -> bytes:
    """The hash of the request's block holding tokens ``num_full * block_size
    .. num_tokens`` (fewer than ``block_size``), chained over the full blocks
    before it (``request.block_hashes`` must cover them)."""
    num_full = num_tokens // block_size
    parent = request.block_hashes[num_full - 1] if num_full else ROOT_HASH
    tokens = request.all_token_ids[num_full * block_size:num_tokens]
    return hash_block(parent, tokens,
                      (request.cache_key, request.lora_int_id, PARTIAL_BLOCK_KEY))
