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

Replay needs the verify step to reproduce the recorded greedy tokens. On
random bf16 weights it does not: a verify step's ``1 + k``-row GEMMs and
attention round differently from the one-row decode step, random logits
have small margins, and the llama-3-8b preset's output left the recording
within a few steps on an H100. ``forced_acceptance`` mode therefore lets the
coin alone decide: any tokens are proposed, each marked correct with
probability ``acceptance_rate``, and the verifier (``SpecDecodeRunner``)
replaces a correct one by the target's own token before checking it. The
device work is that of real proposals at that acceptance; the outputs are
not the target's (a kept proposal's KV holds the proposed token), so it is
for timing only.
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

    def forced_coins(self, num_draft: int) -> list[bool]:
        """Whether each of ``num_draft`` placeholder proposals counts as
        correct (``forced_acceptance`` mode; the runner proposes the last
        token repeated, on the device)."""
        return (self.rng.random(num_draft) < self.acceptance_rate).tolist()
