"""Verification of speculative proposals on the device: which proposed tokens
a request keeps, and the one token the target adds after them.

A request that proposed ``n`` tokens ``d_0 .. d_{n-1}`` after its last token
gets ``n + 1`` target distributions from one step, ``p_0 .. p_n`` (``p_j``
conditioned on the proposals before ``j``), each after exactly the
processing a plain step applies (``Sampler.process``: penalties counting
the proposals before ``j`` as outputs, masks, temperature, min-p, top-k,
top-p). Then:

- greedy rows keep the longest prefix of proposals equal to the target's
  argmax at their position, then add the argmax at the first mismatch (or
  after the last proposal): the plain greedy output, token for token;
- random rows run exact rejection sampling: ``d_j`` is kept with
  probability ``min(1, p_j(d_j) / q_j(d_j))`` until the first rejection;
  at a rejection the token is drawn from ``normalise(max(0, p_j - q_j))``,
  after ``n`` acceptances from ``p_n``. Each emitted token then has exactly
  the target's distribution (Leviathan et al. 2023, Chen et al. 2023).
  ``q`` is the proposer's distribution; a deterministic proposer (n-gram,
  a greedy draft, the oracle) has ``q_j = one_hot(d_j)``, so ``d_j`` is kept
  with probability ``p_j(d_j)`` and the resample excludes it.

Seeded rows draw their uniforms, then their exponential noise (the draw is
the sampler's exponential race, ``argmax(dist / E)``, scale-free so
``normalise`` is implicit), from their own generator, so their outputs
reproduce. Only one position of a row is ever drawn from, and which one is
decided by the uniforms alone, so one noise vector per row suffices.

No host synchronisation: every branch is on flags known on the host.
"""

from __future__ import annotations

import torch

from kvserve.sampling.sampler import row_argmax


def verify_proposals(
    draft_token_ids: torch.Tensor,  # [N, K] int64 (K: the most proposals of any row)
    num_draft: torch.Tensor,  # [N] int64 in [0, K]
    row_start: torch.Tensor,  # [N] int64: each request's first target row
    target_ids: torch.Tensor | None,  # [R] int64: processed argmax per target row
    target_probs: torch.Tensor | None,  # [R, V] float32: processed distribution per row
    greedy_mask: torch.Tensor | None = None,  # [N] bool; None: every row is of one kind
    generators: dict[int, torch.Generator] | None = None,  # request index -> generator
    draft_probs: torch.Tensor | None = None,  # [N, K, V] q; None: one-hot proposals
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verified tokens of ``N`` requests: ``[N, K + 1]`` int64 (the kept
    proposals, then the target's token, then -1) and ``[N]`` int64 counts.

    Request ``i``'s target rows are ``row_start[i] .. row_start[i] +
    num_draft[i]`` of ``target_ids`` / ``target_probs`` (``Sampler.process``
    over the step's verification rows). ``target_ids`` is needed unless
    every row is random, ``target_probs`` unless every row is greedy;
    ``greedy_mask`` says which rows are greedy when both kinds are present.
    """
    num_reqs, max_draft = draft_token_ids.shape
    device = draft_token_ids.device
    position = torch.arange(max_draft, device=device)
    valid = position.unsqueeze(0) < num_draft.unsqueeze(1)  # [N, K]
    # [N, K] rows of each proposal's target distribution (clamped where invalid)
    rows = (row_start.unsqueeze(1) + position.unsqueeze(0)).clamp_(
        max=_num_rows(target_ids, target_probs) - 1)
    greedy_accepted = greedy_token = random_accepted = random_token = None
    if target_ids is not None:
        match = (draft_token_ids == target_ids[rows]) & valid
        greedy_accepted = match.long().cumprod(dim=1).sum(dim=1)
        greedy_token = target_ids[row_start + greedy_accepted]
    if target_probs is not None:
        random_accepted, random_token = _rejection_sample(
            draft_token_ids, valid, rows, row_start, target_probs, draft_probs,
            generators or {}, use_triton)
    if random_accepted is None or random_token is None:
        assert greedy_accepted is not None and greedy_token is not None
        accepted, token = greedy_accepted, greedy_token
    elif greedy_accepted is None or greedy_token is None:
        accepted, token = random_accepted, random_token
    else:
        if greedy_mask is None:
            raise ValueError("verify_proposals: greedy_mask is needed when target_ids and "
                             "target_probs are both given")
        accepted = torch.where(greedy_mask, greedy_accepted, random_accepted)
        token = torch.where(greedy_mask, greedy_token, random_token)
    out = torch.full((num_reqs, max_draft + 1), -1, dtype=torch.int64, device=device)
    out[:, :max_draft] = torch.where(position.unsqueeze(0) < accepted.unsqueeze(1),
                                     draft_token_ids, -1)
    out.scatter_(1, accepted.unsqueeze(1), token.unsqueeze(1))
    return out, accepted + 1


def _num_rows(target_ids: torch.Tensor | None, target_probs: torch.Tensor | None) -> int:
    if target_probs is not None:
        return target_probs.shape[0]
    if target_ids is None:
        raise ValueError("verify_proposals: give target_ids, target_probs or both")
    return target_ids.shape[0]


def _rejection_sample(
    draft_token_ids: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
    row_start: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
    generators: dict[int, torch.Generator], use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted proposals [N], the drawn token [N]) of exact rejection sampling."""
    num_reqs, max_draft = draft_token_ids.shape
    uniform = torch.rand(num_reqs, max_draft, device=target_probs.device)
    noise = torch.empty(num_reqs, target_probs.shape[1], device=target_probs.device)
    noise.exponential_()
    for row, generator in generators.items():
        uniform[row] = torch.rand(max_draft, generator=generator, device=uniform.device)
        noise[row].exponential_(generator=generator)
    # p_j(d_j) and q_j(d_j) per proposal
    p_draft = target_probs[rows, draft_token_ids]  # [N, K]
    q_draft = (None if draft_probs is None
               else draft_probs.gather(2, draft_token_ids.unsqueeze(2)).squeeze(2))
    keep = accept(uniform, p_draft, q_draft)
    accepted = (keep & valid).long().cumprod(dim=1).sum(dim=1)  # [N]
    p_at = target_probs[row_start + accepted]  # [N, V]
    num_draft = valid.sum(dim=1)
    rejected = accepted < num_draft
    if max_draft == 0:
        return accepted, row_argmax(p_at / _floor(noise), use_triton)
    at = accepted.clamp(max=max_draft - 1).unsqueeze(1)  # the rejected position
    if draft_probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, draft_token_ids.gather(1, at), 1.0)
    else:
        q_at = draft_probs.gather(1, at.unsqueeze(2).expand(-1, 1, p_at.shape[1])).squeeze(1)
    dist = torch.where(rejected.unsqueeze(1), residual_distribution(p_at, q_at), p_at)
    return accepted, row_argmax(dist / _floor(noise), use_triton)


def accept(uniform: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor | None
           ) -> torch.Tensor:
    """Keep a proposal with probability ``min(1, p / q)``: ``u < p / q`` for
    ``u ~ U[0, 1)``, written without the division (``q`` is 1 for a one-hot
    proposal, None here)."""
    if q_draft is None:
        return uniform < p_draft
    return uniform * q_draft < p_draft


def residual_distribution(p_at: torch.Tensor, q_at: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` per row, unnormalised (the race does not need it);
    ``p`` where that is all zero (``p == q``, when a rejection had
    probability 0)."""
    residual = (p_at - q_at).clamp_(min=0.0)
    return torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_at)


def _floor(noise: torch.Tensor) -> torch.Tensor:
    """E == 0 would turn a masked token's 0 / 0 into NaN, which argmax picks."""
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
