"""DRY ("don't repeat yourself"): a penalty on the tokens that would extend a
repeat of earlier text, growing exponentially with the repeat's length
(llama.cpp's sampler and its parameter names).

For a sequence ``h`` (prompt and output) and each earlier position ``j``, let
``L(j)`` be the length of the longest common suffix of ``h[:j + 1]`` and
``h``: sampling ``h[j + 1]`` next would repeat ``L(j) + 1`` tokens. When
``L(j) >= allowed_length`` that token's logit loses
``multiplier * base ** (L(j) - allowed_length)`` (the largest over ``j``).
Sequence breakers end a match: a repeat never runs across a token whose text
holds one of them (llama.cpp matches breaker strings across tokens; this
matches them inside one token, the common case of one-character breakers).

The penalties are computed on the host, where the runner already keeps each
row's tokens, and reach the device as (row, token, penalty) triples, so a
verify row sees exactly the prefix a plain step would (its proposals
included) and nothing here synchronises with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# the exponent stops growing here, so the penalty stays finite (1.75 ** 48 is 5e11)
MAX_EXPONENT = 48


@dataclass(frozen=True)
class DrySettings:
    """One request's DRY settings, breakers resolved to token ids."""

    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int  # -1: the whole sequence
    breaker_ids: frozenset[int]


def dry_penalties(tokens: Sequence[int] | np.ndarray,
                  settings: DrySettings) -> tuple[np.ndarray, np.ndarray]:
    """The (token ids, penalties) DRY subtracts from the logits of the token
    that follows ``tokens``; each id once, with its largest penalty."""
    h = np.asarray(tokens, dtype=np.int64)
    if settings.penalty_last_n > 0:
        h = h[-settings.penalty_last_n:]
    n = len(h)
    empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    if n < 2 or settings.multiplier == 0 or settings.penalty_last_n == 0:
        return empty
    if settings.breaker_ids:
        breaks = np.isin(h, np.fromiter(settings.breaker_ids, dtype=np.int64))
        earlier, latest = np.where(breaks, -1, h), np.where(breaks, -2, h)
    else:
        earlier = latest = h
    # match[j]: L(j) so far, for j in [0, n - 2]; alive[j]: still matching
    match = np.zeros(n - 1, dtype=np.int64)
    alive = np.ones(n - 1, dtype=bool)
    longest = settings.allowed_length + MAX_EXPONENT
    for k in range(min(n - 1, longest)):
        # compare h[j - k] with h[n - 1 - k]; j < k has nothing left to compare
        alive[:k] = False
        alive[k:] &= earlier[: n - 1 - k] == latest[n - 1 - k]
        if not alive.any():
            break
        match += alive
    hits = np.flatnonzero(match >= settings.allowed_length)
    if not len(hits):
        return empty
    ids = h[hits + 1]
    exponent = np.minimum(match[hits] - settings.allowed_length, MAX_EXPONENT)
    values = settings.multiplier * np.power(settings.base, exponent, dtype=np.float64)
    order = np.lexsort((-values, ids))  # per id, its largest penalty first
    ids, values = ids[order], values[order]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids[first], values[first].astype(np.float32)


def dry_triples(rows: Sequence[tuple[int, DrySettings, Sequence[int]]]
                ) -> list[tuple[int, int, float]]:
    """(row, token, penalty) for every (row, settings, tokens) given."""
    triples = []
    for row, settings, tokens in rows:
        ids, values = dry_penalties(tokens, settings)
        triples += [(row, int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return triples

