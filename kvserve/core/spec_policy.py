"""When speculative decoding pays, and how it did: the per-step choice of k
and the acceptance counters.

A speculative step over a decode batch of ``B`` requests runs the target on
``B * (1 + k)`` tokens and the proposer for ``k`` positions; each request
then gains ``E(k) = 1 + sum_{j < k} P(the first j + 1 proposals are
accepted)`` tokens instead of one. So, per unit of device time,

    gain(k) = E(k) * c(B) / (c(B * (1 + k)) + k * d(B))

where ``c(N)`` is the measured device time of a target step of ``N`` tokens
and ``d(B)`` the measured proposer time per proposed position at batch
``B``. Each step takes the ``k' <= k`` with the largest gain, and none
(a plain decode) unless that gain exceeds 1 by ``MIN_GAIN``: at batch 1 the
target step is bound by reading the weights, so ``c(1 + k) ~ c(1)`` and
speculation pays whenever ``E > 1``; at batch 256 the step is bound by
compute, ``c(B * (1 + k)) ~ (1 + k) c(B)``, and it never pays.

The costs are learnt online from every step (``observe_step``): ``c`` as
an exponential moving average per power-of-two bucket of token counts,
interpolated linearly between measured buckets and proportional to ``N``
outside them (bound by compute: the side on which speculation does not
pay, so an unmeasured size is never a reason to speculate); ``d`` per
power-of-two bucket of batch sizes, 0 until measured. Before anything is
measured every step speculates. ``P`` are the measured acceptance counters
with ``PRIOR_STEPS`` pseudo-steps at ``PRIOR_ALPHA`` so the first steps
have a guess. While speculation is off for want of acceptance, every
``EXPLORE_EVERY``-th step speculates anyway so the estimate follows the
traffic; where it would not pay even if every proposal were accepted
(compute-bound batches) it never does.

``disable_by_batch_size`` replaces the rule with a fixed threshold;
``auto_disable=False`` speculates in every step. Pure Python: no torch.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvserve.config import SpeculativeConfig

MIN_GAIN = 1.02
PRIOR_STEPS = 8.0
PRIOR_ALPHA = 0.6
EXPLORE_EVERY = 64
EMA_WEIGHT = 0.2


def _bucket(n: int) -> int:
    """Power-of-two bucket of a positive count: 1 -> 0, 2 -> 1, 3..4 -> 2, ..."""
    return max(n - 1, 0).bit_length()


class _CostTable:
    """Moving averages of a cost by power-of-two bucket of a count, with the
    mean count seen in each bucket (for interpolation)."""

    def __init__(self) -> None:
        self.cost: dict[int, float] = {}
        self.count: dict[int, float] = {}

    def observe(self, n: int, cost_s: float) -> None:
        b = _bucket(n)
        if b not in self.cost:
            self.cost[b], self.count[b] = cost_s, float(n)
            return
        self.cost[b] += EMA_WEIGHT * (cost_s - self.cost[b])
        self.count[b] += EMA_WEIGHT * (n - self.count[b])

    def predict(self, n: int) -> float | None:
        """The cost at ``n`` (None until anything is measured)."""
        if not self.cost:
            return None
        points = sorted((self.count[b], self.cost[b]) for b in self.cost)
        if n <= points[0][0]:
            return points[0][1] * n / points[0][0]
        if n >= points[-1][0]:
            return points[-1][1] * n / points[-1][0]
        for (n0, c0), (n1, c1) in itertools.pairwise(points):
            if n0 <= n <= n1:
                return c0 + (c1 - c0) * (n - n0) / max(n1 - n0, 1e-9)
        return points[-1][1]


class SpecDecodePolicy:
    """Chooses each step's k and keeps the acceptance counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        # per position j: verifications that proposed a token at j, and those
        # whose proposals 0..j were all accepted
        self.num_drafted_at = [0] * self.max_k
        self.num_accepted_at = [0] * self.max_k
        self.num_drafts = 0  # verifications (one request, one step, >= 1 proposal)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0
        self.num_plain_steps = 0  # steps with speculation switched off
        self._steps_off = 0
        self._target = _CostTable()  # target step time by tokens
        self._proposer = _CostTable()  # proposer time per position by batch size

    # ------------------------------------------------------------ choice

    def num_spec_tokens(self, batch_size: int) -> int:
        """How many tokens to propose per request in a step whose decode batch
        has ``batch_size`` requests (0: speculation off for this step)."""
        if batch_size < 1:
            return 0
        config = self.config
        if config.disable_by_batch_size is not None:
            return self.max_k if batch_size < config.disable_by_batch_size else 0
        if not config.auto_disable:
            return self.max_k
        k = self.best_k(batch_size)
        if k == 0 and self.best_k(batch_size, perfect=True):  # off for want of acceptance
            self._steps_off += 1
            if self._steps_off >= EXPLORE_EVERY:
                self._steps_off = 0
                return self.max_k
        else:
            self._steps_off = 0
        return k

    def best_k(self, batch_size: int, perfect: bool = False) -> int:
        """The ``k`` of largest expected gain (0 when none beats ``MIN_GAIN``);
        with ``perfect``, as if every proposal were accepted."""
        plain = self._target.predict(batch_size)
        if plain is None:
            return self.max_k  # nothing measured yet
        per_position = self._proposer.predict(batch_size) or 0.0
        best_k, best_gain = 0, MIN_GAIN
        expected = 1.0
        for k in range(1, self.max_k + 1):
            expected += 1.0 if perfect else self.acceptance(k - 1)
            spec = self._target.predict(batch_size * (1 + k))
            assert spec is not None
            gain = expected * plain / max(spec + k * per_position, 1e-12)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k

    def acceptance(self, position: int) -> float:
        """Estimated probability that proposals 0..``position`` are all accepted."""
        prior = PRIOR_ALPHA ** (position + 1)
        return ((self.num_accepted_at[position] + PRIOR_STEPS * prior)
                / (self.num_drafted_at[position] + PRIOR_STEPS))

    # ------------------------------------------------------------ observations

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verified proposals in one step."""
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(min(num_drafted, self.max_k)):
            self.num_drafted_at[j] += 1
            if j < num_accepted:
                self.num_accepted_at[j] += 1

    def observe_step(self, num_tokens: int, batch_size: int, num_proposed: int,
                     device_s: float, proposer_s: float, speculative: bool) -> None:
        """A finished step: its target tokens, decode batch, positions proposed
        per request, device time and the proposer's share of it."""
        if num_tokens <= 0 or device_s <= 0.0:
            return
        if speculative:
            self.num_spec_steps += 1
        else:
            self.num_plain_steps += 1
        self._target.observe(num_tokens, max(device_s - proposer_s, 0.0))
        if num_proposed > 0 and batch_size > 0:
            self._proposer.observe(batch_size, proposer_s / num_proposed)

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters (vLLM's names), the acceptance rate (accepted / proposed
        tokens) and the mean accepted length (tokens per verification: the
        accepted proposals plus the token the target adds)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_at),
            "spec_decode_num_drafted_tokens_per_pos": list(self.num_drafted_at),
            "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                            if self.num_draft_tokens else 0.0),
            "spec_decode_mean_accepted_length": (1.0 + self.num_accepted_tokens
                                                 / self.num_drafts if self.num_drafts else 0.0),
            "spec_decode_num_spec_steps": self.num_spec_steps,
            "spec_decode_num_plain_steps": self.num_plain_steps,
        }
