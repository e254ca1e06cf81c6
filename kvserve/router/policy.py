"""Routing policies of ``kvserve router``: which backend gets a request.

Pure decisions over plain values: a policy sees the backends a request may
still go to (healthy, not yet tried), each with its load, and the request's
``PrefixKey``; it returns one backend and the reason. No I/O here (the
backends' health and load are ``backends.py``'s, the HTTP is ``app.py``'s).

- ``round_robin``: the next backend in the configured order.
- ``least_load``: the smallest load (running + waiting, KV usage breaking ties).
- ``prefix``: the backend that most probably holds the longest cached prefix
  of the prompt. A table maps each routed block-chain hash to the backends it
  went to (LRU-bounded); the deepest hash found picks among its backends the
  least loaded one, when it covers at least ``min_match`` of the prompt's
  blocks (a shorter match, such as a system prompt alone, is worth less than
  balance: the least-loaded backend gets it). A prompt seen nowhere goes where
  a consistent-hash ring puts the hash of its first block (adding a backend
  moves about 1/N of the new prefixes). Either choice yields to the
  least-loaded backend when it is more than ``balance_threshold`` requests
  busier than that one.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

DEFAULT_BLOCK_SIZE = 16
DEFAULT_BALANCE_THRESHOLD = 16.0
DEFAULT_MIN_MATCH = 0.5
DEFAULT_MAX_PREFIX_ENTRIES = 200_000
DEFAULT_MAX_PREFIX_BLOCKS = 1024
VIRTUAL_NODES = 64


@dataclass(frozen=True)
class Candidate:
    """A backend a request may go to now, and how busy it is."""

    url: str
    load: float


@dataclass(frozen=True)
class PrefixKey:
    """The chain hashes of a prompt's full leading blocks (``block_hashes[i]``
    covers blocks 0..i) and a hash of the whole prompt's start for prompts
    shorter than one block."""

    block_hashes: tuple[bytes, ...] = ()
    short_hash: bytes = b""

    @property
    def ring_hash(self) -> bytes:
        return self.block_hashes[0] if self.block_hashes else self.short_hash


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _packed(token_ids: Sequence[int]) -> bytes:
    return token_ids if isinstance(token_ids, bytes) else array("q", token_ids).tobytes()


def prefix_key(token_ids: Sequence[int], block_size: int,
               max_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS) -> PrefixKey:
    """The ``PrefixKey`` of a prompt's token ids (or its UTF-8 bytes)."""
    hashes: list[bytes] = []
    previous = b""
    num_blocks = min(len(token_ids) // block_size, max_blocks)
    for index in range(num_blocks):
        block = token_ids[index * block_size:(index + 1) * block_size]
        previous = _digest(previous + _packed(block))
        hashes.append(previous)
    short = b"" if hashes else _digest(_packed(token_ids))
    return PrefixKey(tuple(hashes), short)


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why (``reason`` labels the router's metrics):
    round_robin, least_load, prefix_hit, prefix_new, load_fallback."""

    url: str
    reason: str
    matched_blocks: int = 0


class RoutingPolicy(ABC):
    """Chooses one of the candidates (never an empty list) for a request."""

    name: ClassVar[str]

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate], key: PrefixKey) -> Decision:
        """The backend for a request with ``key`` among ``candidates``."""

    def forget(self, url: str) -> None:
        """``url`` lost its state (it restarted): drop what is known about it
        (nothing, for policies that keep no per-backend state)."""
        return None


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """The least-loaded candidate; the first of equals (configured order)."""
    return min(candidates, key=lambda c: c.load)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__(urls)
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], key: PrefixKey) -> Decision:
        available = {c.url for c in candidates}
        start = next(self._counter)
        for offset in range(len(self.urls)):
            url = self.urls[(start + offset) % len(self.urls)]
            if url in available:
                return Decision(url, "round_robin")
        return Decision(candidates[0].url, "round_robin")


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def choose(self, candidates: Sequence[Candidate], key: PrefixKey) -> Decision:
        return Decision(least_loaded(candidates).url, "least_load")


@dataclass
class HashRing:
    """Consistent hashing: ``VIRTUAL_NODES`` points per backend on a ring."""

    urls: Sequence[str]
    _points: list[tuple[bytes, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._points = sorted((_digest(f"{url}#{i}".encode()), url)
                              for url in self.urls for i in range(VIRTUAL_NODES))

    def walk(self, key: bytes) -> list[str]:
        """The backends in ring order from ``key`` clockwise, each once."""
        start = bisect.bisect(self._points, (key, ""))
        seen: dict[str, None] = {}
        for offset in range(len(self._points)):
            seen.setdefault(self._points[(start + offset) % len(self._points)][1], None)
            if len(seen) == len(self.urls):
                break
        return list(seen)


class PrefixAwarePolicy(RoutingPolicy):
    name = "prefix"

    def __init__(self, urls: Sequence[str], balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
                 max_entries: int = DEFAULT_MAX_PREFIX_ENTRIES,
                 min_match: float = DEFAULT_MIN_MATCH) -> None:
        super().__init__(urls)
        if not balance_threshold >= 0:
            raise ValueError(f"balance_threshold={balance_threshold} is invalid: must be >= 0")
        if not 0 <= min_match <= 1:
            raise ValueError(f"min_match={min_match} is invalid: must be in [0, 1]")
        self.min_match = min_match
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} is invalid: must be >= 1")
        self.balance_threshold = balance_threshold
        self.max_entries = max_entries
        self.ring = HashRing(self.urls)
        # block-chain hash -> the backends that were sent a prompt with that prefix
        self._table: OrderedDict[bytes, set[str]] = OrderedDict()

    def choose(self, candidates: Sequence[Candidate], key: PrefixKey) -> Decision:
        decision = self._choose(candidates, key)
        self._record(key, decision.url)
        return decision

    def _choose(self, candidates: Sequence[Candidate], key: PrefixKey) -> Decision:
        loads = {c.url: c.load for c in candidates}
        lightest = least_loaded(candidates)
        if not key.ring_hash:  # a request without a prompt to key on
            return Decision(lightest.url, "least_load")

        def fits(url: str) -> bool:
            return loads[url] <= lightest.load + self.balance_threshold

        for depth in range(len(key.block_hashes), 0, -1):
            owners = [c for c in candidates
                      if c.url in self._table.get(key.block_hashes[depth - 1], ())]
            if owners:
                if depth < self.min_match * len(key.block_hashes):
                    return Decision(lightest.url, "least_load")
                best = least_loaded(owners)
                if fits(best.url):
                    return Decision(best.url, "prefix_hit", depth)
                return Decision(lightest.url, "load_fallback")
        for url in self.ring.walk(key.ring_hash):
            if url in loads:
                if fits(url):
                    return Decision(url, "prefix_new")
                break
        return Decision(lightest.url, "load_fallback")

    def _record(self, key: PrefixKey, url: str) -> None:
        for block_hash in key.block_hashes:
            owners = self._table.get(block_hash)
            if owners is None:
                self._table[block_hash] = {url}
            else:
                owners.add(url)
                self._table.move_to_end(block_hash)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def forget(self, url: str) -> None:
        for block_hash in list(self._table):
            owners = self._table[block_hash]
            owners.discard(url)
            if not owners:
                del self._table[block_hash]

    @property
    def num_entries(self) -> int:
        return len(self._table)


POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobinPolicy, LeastLoadPolicy, PrefixAwarePolicy)}


def make_policy(name: str, urls: Sequence[str], balance_threshold: float,
                max_entries: int, min_match: float = DEFAULT_MIN_MATCH) -> RoutingPolicy:
    """The policy called ``name``; ValueError listing the names otherwise."""
    if name == PrefixAwarePolicy.name:
        return PrefixAwarePolicy(urls, balance_threshold, max_entries, min_match)
    if name not in POLICIES:
        raise ValueError(f"--policy={name!r} is invalid: choose one of {', '.join(POLICIES)}")
    return POLICIES[name](urls)
