"""An oracle proposer for benchmarks: the target's own greedy continuation,
recorded from earlier requests with the same prompt, replayed with a chosen
share of proposals corrupted.

With random weights (the benchmark presets) real proposals are worthless,
so the verifier's and the bookkeeping's cost at a known acceptance rate is
measured this way: run a set of prompts once (nothing is proposed; each
finished request's output is recorded under its prompt), then again (the
recording is proposed; a proposal the coin below calls wrong is replaced by
a wrong token, so a greedy request accepts the first ``j`` of ``k``
proposals with probability ``alpha^j``, the i.i.d. model of the
theoretical speed-up). Host-side, no device work.

The coin is quasi-random (``PrefixCoin``): a verification's proposals
share one number ``u`` of a golden-ratio Weyl sequence, and proposal ``i``
(from 0) is correct when ``u < alpha^(i + 1)``. A verification accepts at
least ``j`` proposals with probability ``alpha^j``, as with independent
coins; what it would do after its first wrong proposal never counts (the
verifier stops there). One low-discrepancy number a verification puts
each acceptance length's share within ``1 / n`` of its probability after
``n`` verifications; a seeded pseudo-random coin's verifications at k = 6,
alpha = 0.8 took 5% fewer tokens than alpha^j predicts over a benchmark's
thousand (decision 0048).
"""

from __future__ import annotations

import math

import numpy as np


class PrefixCoin:
    """Which of a verification's proposals count as correct, each with
    probability ``rate`` given the ones before it (see the module docstring)."""

    STEP = (math.sqrt(5.0) - 1.0) / 2.0  # the golden ratio's fractional part

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.point = float(np.random.default_rng(seed).random())

    def draw(self, num: int) -> np.ndarray:
        """The next verification's first ``num`` coins: True where correct."""
        u = self.point
        self.point = (self.point + self.STEP) % 1.0
        return u < self.rate ** np.arange(1, num + 1)


class OracleProposer:
    """Replays recorded continuations (registered as ``"oracle"``)."""

    def __init__(self, acceptance_rate: float, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.coin = PrefixCoin(acceptance_rate, seed)
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
        the prompt agrees with them; those the coin calls wrong corrupted."""
        recording = self.recordings.get(tuple(prompt_token_ids))
        num_outputs = len(output_token_ids)
        if recording is None or recording[:num_outputs] != output_token_ids:
            return []
        proposals = np.array(recording[num_outputs:num_outputs + num_draft], dtype=np.int64)
        wrong = ~self.coin.draw(len(proposals))
        # a token the target does not produce there: the next id
        proposals[wrong] = (proposals[wrong] + 1) % self.vocab_size
        return proposals.tolist()

    def forced_coins(self, num_draft: int) -> list[bool]:
        """Whether each of ``num_draft`` placeholder proposals counts as
        correct (``forced_acceptance`` mode; the runner proposes the last
        token repeated, on the device)."""
        return self.coin.draw(num_draft).tolist()
