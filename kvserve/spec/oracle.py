"""An oracle proposer for benchmarks: the target's own greedy continuation,
recorded from earlier requests with the same prompt, replayed with a chosen
share of proposals corrupted.

With random weights (the benchmark presets) real proposals are worthless,
so the verifier's and the bookkeeping's cost at a known acceptance rate is
measured this way: run a set of prompts once (nothing is proposed; each
finished request's output is recorded under its prompt), then again (the
recording is proposed; each proposed token is replaced by a wrong one with
probability ``1 - acceptance_rate``, independently, so a greedy request
accepts the first ``j`` of ``k`` proposals with probability ``alpha^j``,
the i.i.d. model of the theoretical speed-up). Host-side, no device work.
"""

from __future__ import annotations

import numpy as np


class OracleProposer:
    """Replays recorded continuations (registered as ``"oracle"``)."""

    def __init__(self, acceptance_rate: float, vocab_size: int, seed: int = 0) -> None:
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        # prompt -> the longest output recorded for it
        self.recordings: dict[tuple[int, ...], list[int]] = {}

    def record(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Remember a finished request's output (the longest one per prompt)."""
        key = tuple(prompt_token_ids)
        if len(output_token_ids) > len(self.recordings.get(key, ())):
            self.recordings[key] = list(output_token_ids)

    def propose(self, prompt_token_ids: list[int], output_token_ids: list[int],
                num_draft: int) -> list[int]:
        """The recorded tokens after ``output_token_ids``, if the recording of
        the prompt agrees with them; each corrupted with probability
        ``1 - acceptance_rate``."""
        recording = self.recordings.get(tuple(prompt_token_ids))
        num_outputs = len(output_token_ids)
        if recording is None or recording[:num_outputs] != output_token_ids:
            return []
        proposals = np.array(recording[num_outputs:num_outputs + num_draft], dtype=np.int64)
        wrong = self.rng.random(len(proposals)) >= self.acceptance_rate
        # a token the target does not produce there: the next id
        proposals[wrong] = (proposals[wrong] + 1) % self.vocab_size
        return proposals.tolist()
