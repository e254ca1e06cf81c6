"""Verification of speculative proposals (``sampling/rejection.py``).

Unit cases (greedy longest prefix + the target's token, certain accepts and
rejects, seeded rows reproducing), then the statistical test: on a tiny
random target and a different tiny random draft (transformers, vocabulary
24), 20,000 requests per setting generate two tokens with speculation
(k = 3, proposals drawn from the draft's distribution or its argmax,
several steps where a step emits fewer than two), and a chi-square test
compares the joint distribution of those two tokens with the exact
non-speculative one, ``p(x1) p(x2 | x1)`` after the same processing a plain
step applies. Plain temperature, top-k, top-p and min-p must give
p > 0.01; the same test with the acceptance rule or the residual
distribution broken must give p < 1e-6 (a test of the test). Everything is
vectorised over the 20,000 requests and seeded.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.sampling import rejection
from kvserve.sampling.rejection import verify_proposals
from kvserve.sampling.sampler import Sampler, SamplingBatch, SamplingRows, make_generator

VOCAB = 24
PROMPT = [1, 5, 7, 3]
NUM_SAMPLES = 20_000
K = 3


def test_greedy_keeps_the_longest_matching_prefix_then_the_target_token() -> None:
    # three requests: 3 proposals (2 right), 2 proposals (both right), none
    target_ids = torch.tensor([4, 5, 9, 9, 1, 2, 3, 7])  # rows 0-3, 4-6, 7
    drafts = torch.tensor([[4, 5, 6], [1, 2, 0], [0, 0, 0]])
    tokens, counts = verify_proposals(drafts, torch.tensor([3, 2, 0]), torch.tensor([0, 4, 7]),
                                      target_ids, None)
    assert counts.tolist() == [3, 3, 1]
    assert tokens.tolist() == [[4, 5, 9, -1], [1, 2, 3, -1], [7, -1, -1, -1]]


def test_certain_accepts_and_rejects() -> None:
    probs = torch.zeros(4, VOCAB)
    probs[0, 3] = 1.0  # request 0: p(3) = 1 at its first position: the proposal 3 is kept
    probs[1, 8] = 1.0  # then 8 for sure
    probs[2, 5] = 0.5  # request 1: p(7) = 0 (rejected), resampled from p without 7
    probs[2, 6] = 0.5
    probs[3, 0] = 1.0
    drafts = torch.tensor([[3], [7]])
    for _ in range(20):
        tokens, counts = verify_proposals(drafts, torch.tensor([1, 1]), torch.tensor([0, 2]),
                                          None, probs)
        assert tokens[0].tolist() == [3, 8] and counts[0] == 2
        assert counts[1] == 1 and tokens[1, 0].item() in (5, 6)


def test_mixed_greedy_and_random_rows() -> None:
    probs = torch.zeros(4, VOCAB)
    probs[:, 2] = 1.0
    ids = torch.tensor([4, 4, 9, 9])
    tokens, counts = verify_proposals(torch.tensor([[4], [2]]), torch.tensor([1, 1]),
                                      torch.tensor([0, 2]), ids, probs,
                                      greedy_mask=torch.tensor([True, False]))
    # greedy request: 4 matches the argmax, then the argmax 4; random: p(2) = 1 twice
    assert tokens.tolist() == [[4, 4], [2, 2]] and counts.tolist() == [2, 2]


def test_seeded_rows_reproduce_whatever_the_other_rows() -> None:
    probs = torch.softmax(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)),
                          dim=-1)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    results = []
    for _ in range(3):
        torch.rand(7)  # the default generator moves; seeded rows must not care
        tokens, counts = verify_proposals(
            drafts, torch.tensor([3, 3]), torch.tensor([0, 4]), None, probs,
            generators={1: make_generator(1234, "cpu")})
        results.append((tokens[1].tolist(), int(counts[1])))
    assert results[0] == results[1] == results[2]


# ---------------------------------------------------------------- statistics


def tiny_lm(seed: int, scale: float) -> torch.nn.Module:
    """A tiny random Llama (transformers) with a 24-token vocabulary; ``scale``
    sharpens its distributions."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, scale if "lm_head" in name else 0.3)
    return model


@torch.no_grad()
def next_logits(model: torch.nn.Module, token_ids: torch.Tensor, last: int) -> torch.Tensor:
    """Logits of the last ``last`` positions of ``[B, L]`` sequences: ``[B, last, V]``
    (each distinct sequence run once: the 20,000 requests share most prefixes)."""
    unique, inverse = torch.unique(token_ids, dim=0, return_inverse=True)
    return model(input_ids=unique).logits[:, -last:].float()[inverse]


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a plain step samples from: ``Sampler.process`` on every row."""
    flat = logits.reshape(-1, VOCAB)
    rows = SamplingRows.of([params], VOCAB).take(torch.zeros(len(flat), dtype=torch.long)
                                                  .numpy())
    batch = SamplingBatch.from_rows(rows, None, None, [], {}, "cpu")
    _, probs = Sampler().process(flat, batch)
    assert probs is not None
    return probs.reshape(logits.shape)


def exact_joint(target: torch.nn.Module, params: SamplingParams) -> torch.Tensor:
    """``p(x1) p(x2 | x1)`` of plain sampling: ``[V * V]``."""
    prompt = torch.tensor([PROMPT])
    p1 = process(next_logits(target, prompt, 1), params)[0, 0]  # [V]
    contexts = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB).unsqueeze(1)], dim=1)
    p2 = process(next_logits(target, contexts, 1), params)[:, 0]  # [V, V]
    return (p1.unsqueeze(1) * p2).reshape(-1)


def speculative_pairs(target: torch.nn.Module, draft: torch.nn.Module, params: SamplingParams,
                      sampled_drafts: bool, seed: int) -> torch.Tensor:
    """The first two tokens of ``NUM_SAMPLES`` requests decoded speculatively:
    each step the draft proposes ``K`` tokens (drawn from its distribution,
    or its argmax), the target verifies them; requests that emitted fewer
    than two tokens go again. Returns ``[NUM_SAMPLES]`` indices ``x1 * V + x2``."""
    torch.manual_seed(seed)
    emitted = torch.full((NUM_SAMPLES, 2), -1, dtype=torch.long)
    count = torch.zeros(NUM_SAMPLES, dtype=torch.long)
    while bool((count < 2).any()):
        active = torch.nonzero(count < 2).flatten()
        context = torch.tensor(PROMPT).repeat(len(active), 1)
        if bool((count[active] == 1).any()):  # a round's active rows all have one token
            context = torch.cat([context, emitted[active, :1]], dim=1)
        proposals, q = [], []
        for _ in range(K):
            dist = torch.softmax(next_logits(draft, torch.cat([context, *proposals], 1), 1)[:, 0],
                                 dim=-1)
            token = (torch.multinomial(dist, 1) if sampled_drafts
                     else dist.argmax(dim=-1, keepdim=True))
            proposals.append(token)
            q.append(dist)
        drafts = torch.cat(proposals, dim=1)  # [A, K]
        probs = process(next_logits(target, torch.cat([context, drafts], 1), K + 1), params)
        tokens, num = verify_proposals(
            drafts, torch.full((len(active),), K), torch.arange(len(active)) * (K + 1), None,
            probs.reshape(-1, VOCAB), draft_probs=torch.stack(q, 1) if sampled_drafts else None)
        for j in range(2):  # append the step's tokens after those the request has
            slot = count[active] + j
            take = (j < num) & (slot < 2)
            emitted[active[take], slot[take]] = tokens[take, j]
        count[active] = torch.clamp(count[active] + num, max=2)
    return emitted[:, 0] * VOCAB + emitted[:, 1]


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts to exact probabilities; outcomes expected
    fewer than 5 times are pooled into one bin."""
    expected = probs.double() * observed.sum()
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].sum().double().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # an outcome of probability 0 happened
        obs, exp = obs[:-1], exp[:-1]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2))


SETTINGS = {
    "temperature": SamplingParams(temperature=0.9),
    "top_k": SamplingParams(temperature=1.0, top_k=6),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.15),
}


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return tiny_lm(seed=0, scale=0.35), tiny_lm(seed=1, scale=0.35)


def run_setting(models: tuple[torch.nn.Module, torch.nn.Module], setting: str,
                sampled_drafts: bool) -> float:
    target, draft = models
    params = SETTINGS[setting]
    pairs = speculative_pairs(target, draft, params, sampled_drafts, seed=len(setting))
    observed = torch.bincount(pairs, minlength=VOCAB * VOCAB)
    return chi_square_p_value(observed, exact_joint(target, params))


@pytest.mark.slow
@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["draft-probs", "one-hot"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_samples_have_the_target_distribution(
        models: tuple[torch.nn.Module, torch.nn.Module], setting: str,
        sampled_drafts: bool) -> None:
    assert run_setting(models, setting, sampled_drafts) > 0.01


def _resample_from_p(p_at: torch.Tensor, q_at: torch.Tensor) -> torch.Tensor:
    return p_at


def _inverted_ratio(uniform: torch.Tensor, p_draft: torch.Tensor,
                    q_draft: torch.Tensor | None) -> torch.Tensor:
    return uniform * p_draft < (1.0 if q_draft is None else q_draft)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "broken"), [
    ("residual_distribution", _resample_from_p),
    ("accept", _inverted_ratio),
])
@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["draft-probs", "one-hot"])
def test_a_broken_rule_fails_the_same_test(
        models: tuple[torch.nn.Module, torch.nn.Module], monkeypatch: pytest.MonkeyPatch,
        name: str, broken: Callable[..., torch.Tensor], sampled_drafts: bool) -> None:
    monkeypatch.setattr(rejection, name, broken)
    assert run_setting(models, "temperature", sampled_drafts) < 1e-6
