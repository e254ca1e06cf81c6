"""Prompt-lookup proposals: the request's own tokens predict its next ones.

For each request, the last ``n`` tokens (``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``) are looked up among its earlier tokens,
prompt and output; the latest earlier occurrence followed by at least one
token wins, and up to ``k`` tokens after it are proposed. Code, templates
and quoted text repeat themselves, so this costs nothing on the device and
is often right. Host-side numpy, run when the step's tokens are read.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes continuations of a repeated n-gram (registered as ``"ngram"``)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, num_draft: int) -> list[int]:
        """Up to ``num_draft`` proposals after ``token_ids`` (one request's
        tokens, ``[num_tokens]``); none when no n-gram repeats."""
        num_tokens = len(token_ids)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[num_tokens - n:]
            # windows starting at 0 .. num_tokens - n - 1: every earlier
            # occurrence, each followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(token_ids[:num_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start:start + num_draft].tolist()
        return []
