"""``SpecDecodePolicy``: the per-step k from measured step costs and
acceptance (weight-bound steps: speculate; compute-bound large batches:
don't; poor acceptance or a costly proposer: don't), the fixed threshold,
forcing, exploration, and the acceptance counters."""

from __future__ import annotations

from kvserve.config import SpeculativeConfig
from kvserve.core.spec_policy import EXPLORE_EVERY, SpecDecodePolicy


def policy(k: int = 4, **kwargs: object) -> SpecDecodePolicy:
    return SpecDecodePolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                              **kwargs))  # type: ignore[arg-type]


def feed_costs(p: SpecDecodePolicy, cost_s: object) -> None:
    """Steps of 1 .. 4096 tokens costing ``cost_s(tokens)``."""
    for tokens in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        for _ in range(3):
            p.observe_step(tokens, tokens, 0, cost_s(tokens), 0.0, False)  # type: ignore[operator]


def feed_acceptance(p: SpecDecodePolicy, alpha: float, num: int = 400) -> None:
    """Verifications of k proposals where each is kept with probability alpha (expected counts)."""
    for j in range(p.max_k):
        p.num_drafted_at[j] += num
        p.num_accepted_at[j] += round(num * alpha ** (j + 1))


def test_speculates_before_anything_is_measured() -> None:
    assert policy().num_spec_tokens(1) == 4
    assert policy().num_spec_tokens(0) == 0


def test_an_unmeasured_size_is_no_reason_to_speculate() -> None:
    p = policy()
    p.observe_step(8192, 256, 0, 0.2, 0.0, False)  # only a big prefill step measured
    feed_acceptance(p, 0.8)
    assert p.best_k(256) == 0  # 256 and 1280 tokens: both scaled down from 8192
    p.observe_step(1, 1, 0, 5e-3, 0.0, False)  # now a batch-1 decode step
    assert p.best_k(1) == 4


def test_weight_bound_small_batches_speculate_compute_bound_large_ones_do_not() -> None:
    p = policy()
    # a GPU-like step: 5 ms reading the weights, compute-bound past 256 tokens
    feed_costs(p, lambda n: 5e-3 * max(1.0, n / 256))
    feed_acceptance(p, 0.8)
    assert p.num_spec_tokens(1) == 4
    assert p.num_spec_tokens(32) == 4
    assert p.num_spec_tokens(256) == 0  # 1 + k tokens each: k times the compute for E(k)
    # at batch 128 the step of 640 tokens costs 2.5x; E(4) = 3.36 still pays a little,
    # and a smaller k pays more
    assert 0 < p.best_k(128) <= 4


def test_poor_acceptance_or_a_costly_proposer_switches_off() -> None:
    p = policy()
    # weights read once per step (5 ms), and a little per token on top
    feed_costs(p, lambda n: 5e-3 + 5e-5 * n)
    feed_acceptance(p, 0.01)
    assert p.best_k(1) == 0
    q = policy()
    feed_costs(q, lambda n: 5e-3 * max(1.0, n / 256))
    feed_acceptance(q, 0.6)
    assert q.best_k(1) == 4
    q.observe_step(5, 1, 4, 5e-3 + 4 * 4e-3, 4 * 4e-3, True)  # 4 ms per proposed position
    assert q.best_k(1) < 4


def test_threshold_forcing_and_exploration() -> None:
    fixed = policy(disable_by_batch_size=8)
    assert fixed.num_spec_tokens(7) == 4 and fixed.num_spec_tokens(8) == 0
    forced = policy(auto_disable=False)
    feed_costs(forced, lambda n: 1e-3 * n)
    assert forced.num_spec_tokens(512) == 4
    compute_bound = policy()
    feed_costs(compute_bound, lambda n: 1e-3 * n)  # would not pay even at full acceptance
    assert [compute_bound.num_spec_tokens(64) for _ in range(2 * EXPLORE_EVERY)] == [0] * (
        2 * EXPLORE_EVERY)
    p = policy()
    feed_costs(p, lambda n: 5e-3 + 5e-5 * n)  # weight-bound, but nothing is accepted
    feed_acceptance(p, 0.0)
    chosen = [p.num_spec_tokens(1) for _ in range(EXPLORE_EVERY)]
    assert chosen[:-1] == [0] * (EXPLORE_EVERY - 1) and chosen[-1] == 4


def test_counters() -> None:
    p = policy(k=3)
    p.observe_verification(3, 2)
    p.observe_verification(2, 0)
    p.observe_verification(0, 0)  # no proposals: not a verification
    stats = p.stats()
    assert stats["spec_decode_num_drafts"] == 2
    assert stats["spec_decode_num_draft_tokens"] == 5
    assert stats["spec_decode_num_accepted_tokens"] == 2
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 0]
    assert stats["spec_decode_num_drafted_tokens_per_pos"] == [2, 2, 1]
    assert stats["spec_decode_acceptance_rate"] == 0.4
    assert stats["spec_decode_mean_accepted_length"] == 2.0
