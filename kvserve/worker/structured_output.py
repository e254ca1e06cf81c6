"""Grammar state of the runner's structured-output requests: one xgrammar
matcher per request, advanced by each token the host reads, and the step's
token bitmask (``[rows, ceil(vocab / 32)]`` int32, bit ``j`` of word ``i``
set when token ``32 i + j`` is allowed) that the sampler applies on the
device.

A matcher must have seen a request's last token before its next bitmask
is filled, so the runner reads a step in flight before preparing one that
carries such a request's token (as it does for penalties). Matchers live
as long as their request, preemption included (the tokens they have seen
stay the request's). Nothing here touches logits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GrammarMatchers:
    """The matchers of the requests with a grammar, by request id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self._matchers: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, grammar: Any) -> None:
        """Start matching a new request (a resumed one keeps its matcher)."""
        if request_id not in self._matchers:
            import xgrammar

            self._matchers[request_id] = xgrammar.GrammarMatcher(grammar)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def accept(self, sampled: dict[str, list[int]]) -> None:
        """Advance the matchers of the requests that sampled these tokens."""
        for request_id, token_ids in sampled.items():
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            for token_id in token_ids:
                if not matcher.is_terminated() and not matcher.accept_token(token_id):
                    logger.warning("request %s: token %d is outside its grammar", request_id,
                                   token_id)

    def bitmask(self, request_ids: list[str]) -> torch.Tensor:
        """``[len(request_ids), num_words]`` int32 on the host: each matcher's
        allowed next tokens, every token for a request without one or whose
        grammar has ended (its stop token is out: with async scheduling it
        may still run one step, whose token is dropped)."""
        mask = torch.full((len(request_ids), self.num_words), -1, dtype=torch.int32)
        for i, request_id in enumerate(request_ids):
            matcher = self._matchers.get(request_id)
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, i)
        return mask
