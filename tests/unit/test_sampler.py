"""Sampler: exact masks, greedy, seeded reproducibility, penalties, logprobs,
min_tokens, and a statistical check of temperature sampling."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.sampling.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRows,
    apply_min_p_,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)

PROBS = [0.5, 0.3, 0.15, 0.05]


def _build(
    params: Sequence[SamplingParams],
    vocab_size: int,
    outputs: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        vocab_size=vocab_size,
        device="cpu",
        eos_token_ids=eos_token_ids,
    )


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, [0]),
        (0.5, [0]),
        (0.5001, [0, 1]),
        (0.8, [0, 1]),
        (0.8001, [0, 1, 2]),
        (0.95, [0, 1, 2]),
        (0.96, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_exact(top_p: float, expected: list[int]) -> None:
    # the vocab is shuffled so the sort/scatter-back path is exercised
    order = [2, 0, 3, 1]
    logits = torch.log(torch.tensor([[PROBS[i] for i in order]]))
    masked = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    assert sorted(order[j] for j in _kept(masked)[0]) == expected


def test_top_k_exact() -> None:
    logits = torch.log(torch.tensor([PROBS[::-1], PROBS, PROBS]))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 1, 4]), None)
    assert _kept(masked) == [[2, 3], [0], [0, 1, 2, 3]]


def test_top_k_then_top_p() -> None:
    # top_k=2 renormalises [0.5, 0.3] to [0.625, 0.375]; top_p 0.6 then keeps 1
    logits = torch.log(torch.tensor([PROBS, PROBS]))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([0.6, 0.6]))
    assert _kept(masked) == [[0], [0, 1]]


def test_min_p_exact() -> None:
    logits = torch.log(torch.tensor([PROBS, PROBS, PROBS]))
    apply_min_p_(logits, torch.tensor([0.2, 0.7, 0.0]))
    # thresholds 0.1, 0.35, 0 (times the top probability 0.5)
    assert _kept(logits) == [[0, 1, 2], [0], [0, 1, 2, 3]]


def test_masks_through_the_sampler() -> None:
    """Many copies of each row in one batch: sampled sets equal the kept sets."""
    settings = [
        (SamplingParams(top_p=0.8), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_k=-1, top_p=0.96), {0, 1, 2, 3}),
    ]
    copies = 2000
    params = [p for p, _ in settings for _ in range(copies)]
    logits = torch.log(torch.tensor([PROBS])).repeat(len(params), 1)
    torch.manual_seed(0)
    sampled = Sampler()(logits, _build(params, 4)).sampled_token_ids.view(len(settings), copies)
    for row, (_, expected) in zip(sampled, settings, strict=True):
        assert set(row.tolist()) == expected


def test_greedy_is_argmax_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=5) for i in range(6)]
    batch = _build(params, 50)
    assert not batch.all_greedy and not batch.all_random
    sampled = Sampler()(logits, batch).sampled_token_ids
    assert sampled.dtype == torch.int64 and sampled.shape == (6,)
    assert torch.equal(sampled[0::2], logits.argmax(dim=-1)[0::2])
    all_greedy = _build([SamplingParams(temperature=0.0)] * 6, 50)
    assert all_greedy.all_greedy
    assert torch.equal(Sampler()(logits, all_greedy).sampled_token_ids, logits.argmax(dim=-1))


def _run_seeded(
    seed: int, logits_steps: list[torch.Tensor], row: int, batch_size: int
) -> list[int]:
    """Tokens of one seeded request at ``row`` of a batch, over several steps."""
    generator = make_generator(seed, "cpu")
    tokens = []
    for logits in logits_steps:
        params = [SamplingParams(temperature=0.9) for _ in range(batch_size)]
        params[row] = SamplingParams(temperature=0.9, seed=seed)
        generators: list[torch.Generator | None] = [None] * batch_size
        generators[row] = generator
        full = torch.randn(batch_size, logits.shape[0])
        full[row] = logits
        sampled = Sampler()(full, _build(params, logits.shape[0], generators=generators))
        tokens.append(int(sampled.sampled_token_ids[row]))
    return tokens


def test_same_seed_same_tokens_alone_or_batched() -> None:
    torch.manual_seed(2)
    steps = [torch.randn(1000) for _ in range(8)]
    alone = _run_seeded(1234, steps, row=0, batch_size=1)
    assert _run_seeded(1234, steps, row=0, batch_size=1) == alone
    torch.manual_seed(99)  # the global generator's state must not matter
    assert _run_seeded(1234, steps, row=3, batch_size=5) == alone
    assert _run_seeded(1234, steps, row=1, batch_size=7) == alone
    assert _run_seeded(4321, steps, row=0, batch_size=1) != alone


def _reference_penalties(
    logits: torch.Tensor,
    prompts: list[list[int]],
    outputs: list[list[int]],
    params: list[SamplingParams],
) -> torch.Tensor:
    out = logits.clone()
    for r, p in enumerate(params):
        for t in range(out.shape[1]):
            if t in prompts[r] or t in outputs[r]:
                x = out[r, t].item()
                out[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[r].count(t)
            out[r, t] -= p.frequency_penalty * count
            out[r, t] -= p.presence_penalty * (count > 0)
    return out


def test_penalties_match_reference() -> None:
    vocab = 12
    torch.manual_seed(3)
    logits = torch.randn(4, vocab) * 3
    prompts = [[1, 2, 2], [], [5], [0, 11]]
    outputs = [[3, 3, 3, 2], [4, 4, 7], [], [11, 11, 6]]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, presence_penalty=1.0),
        SamplingParams(
            temperature=0.0, repetition_penalty=1.5, frequency_penalty=-1.0, presence_penalty=2.0
        ),
    ]
    expected = _reference_penalties(logits, prompts, outputs, params)
    batch = _build(params, vocab, outputs=outputs, prompts=prompts)
    assert not batch.no_penalties
    torch.testing.assert_close(apply_penalties(logits, batch), expected)
    sampled = Sampler()(logits, batch).sampled_token_ids
    assert torch.equal(sampled, expected.argmax(dim=-1))
    assert _build([SamplingParams()], vocab).no_penalties


def test_logprobs_are_raw_and_ranks_correct() -> None:
    torch.manual_seed(4)
    vocab = 30
    logits = torch.randn(3, vocab) * 2
    original = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    batch = _build(params, vocab, outputs=[[1, 2], [], [3]])
    assert batch.max_num_logprobs == 5
    out = Sampler()(logits, batch)
    assert torch.equal(logits, original), "the sampler must not modify its input"
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.sampled_token_ranks is not None
    assert out.logprobs.shape == (3, 6) and out.logprob_token_ids.shape == (3, 6)
    raw = torch.log_softmax(original, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top_lp, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_lp)
    for r in range(3):
        order = raw[r].argsort(descending=True).tolist()
        assert int(out.sampled_token_ranks[r]) == order.index(int(sampled[r])) + 1
    no_logprobs = Sampler()(logits, _build([SamplingParams()] * 3, vocab))
    assert no_logprobs.logprobs is None and no_logprobs.sampled_token_ranks is None


def test_temperature_frequencies_match_softmax() -> None:
    num_samples = 20_000
    temperature = 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    expected = torch.softmax(logits / temperature, dim=-1) * num_samples
    params = [SamplingParams(temperature=temperature)] * num_samples
    torch.manual_seed(5)
    sampled = Sampler()(logits.repeat(num_samples, 1), _build(params, 5)).sampled_token_ids
    observed = torch.bincount(sampled, minlength=5).float()
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001
    assert chi_square < 18.47, (observed.tolist(), expected.tolist())


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    vocab = 10
    logits = torch.zeros(4, vocab)
    logits[:, 2] = 10.0  # eos is by far the most likely token
    logits[:, 7] = 9.0  # then a stop token id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3).with_eos_token_ids([2]),
    ]
    outputs = [[5], [5, 5, 5], [5], []]
    batch = _build(params, vocab, outputs=outputs, eos_token_ids=[2])
    sampled = Sampler()(logits, batch).sampled_token_ids.tolist()
    assert sampled[0] not in (2, 7)
    assert sampled[1] == 2  # min_tokens reached: eos allowed again
    assert sampled[2] == 2  # ignore_eos: eos is an ordinary token, not masked
    assert sampled[3] != 2  # eos bound through the params
    random_rows = [SamplingParams(min_tokens=2)] * 500
    batch = _build(random_rows, vocab, eos_token_ids=[2])
    assert 2 not in Sampler()(logits[:1].repeat(500, 1), batch).sampled_token_ids.tolist()


def test_rejects_mismatched_shapes() -> None:
    batch = _build([SamplingParams()] * 2, 8)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, 8), batch)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(2, 9), batch)
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build([SamplingParams()], [[]], [[], []], [None], 8, "cpu")


def test_fast_path_flags() -> None:
    batch = _build([SamplingParams(), SamplingParams(temperature=0.0, top_k=2)], 8)
    assert batch.no_top_k and batch.no_top_p and batch.no_min_p and batch.no_penalties
    assert batch.max_num_logprobs is None and batch.all_random is False
    batch = _build([SamplingParams(top_k=2, top_p=0.9, min_p=0.1)], 8)
    assert not (batch.no_top_k or batch.no_top_p or batch.no_min_p)
    assert math.isclose(float(batch.temperature[0]), 1.0)


def test_argmax_only_rows_are_plain_greedy_and_sample_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5),  # top-k/p mean nothing greedy
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8),
        SamplingParams(temperature=0.7),
    ]
    rows = SamplingRows.of(params, 16)
    assert rows.argmax_only.tolist() == [True, True, False, False, False, False, False]
    assert rows.take(np.array([1, 0])).argmax_only.all()
    rows.set(0, SamplingParams(temperature=0.0, frequency_penalty=0.1))  # a reused row
    assert not rows.argmax_only[0]
    logits = torch.randn(2, 16)
    sampler = Sampler()
    batch = _build([greedy, params[1]], 16)
    assert torch.equal(sampler.argmax(logits), sampler(logits, batch).sampled_token_ids)
