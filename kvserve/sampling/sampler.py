"""Turns the model's last-position logits into next tokens, on the device.

Per step the model runner builds one ``SamplingBatch`` (per-request settings
as device tensors plus host-side fast-path flags) and calls ``Sampler``.
The order of operations is:

    penalties (repetition, presence, frequency) -> min_tokens mask
    -> greedy rows: argmax
    -> temperature -> min_p -> top_k -> top_p -> exponential-race sample

Logprobs are of the raw model distribution (log_softmax of the logits as
given, before any of the above), as vLLM returns them by default.
Both argmaxes (greedy rows, the race) take ``kernels/argmax.py`` with ``use_triton``.

This module must not synchronise with the host: no ``.item()``, no
``.tolist()``, no branches on tensor values, no blocking host-to-device
copies (``to_device`` queues them). Every branch is on a flag that
``SamplingBatch.build`` computed from the Python-side params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.host_copy import to_device

# top_p rows keep tokens until the kept mass reaches top_p - this slack, so
# float32 rounding of softmax/cumsum does not add one more token on exact cuts
_TOP_P_SLACK = 1e-6


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device that samples."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of R rows (all on the device)."""

    sampled_token_ids: torch.Tensor  # [R] int64
    # sampled token first, then the top max_num_logprobs tokens by logprob
    logprob_token_ids: torch.Tensor | None = None  # [R, 1 + max_num_logprobs] int64
    logprobs: torch.Tensor | None = None  # [R, 1 + max_num_logprobs] float32
    # 1-based rank of the sampled token in the raw distribution
    sampled_token_ranks: torch.Tensor | None = None  # [R] int64


@dataclass
class SamplingBatch:
    """Per-request sampling settings of one step, as device tensors.

    A tensor is None when no row needs it; that is what the fast-path
    properties (``no_penalties``, ``no_top_k``, ...) read.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R] float32, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [R] int64, vocab_size where off
    top_p: torch.Tensor | None  # [R] float32, 1.0 where off
    min_p: torch.Tensor | None  # [R] float32, 0.0 where off
    presence_penalty: torch.Tensor | None  # [R] float32
    frequency_penalty: torch.Tensor | None  # [R] float32
    repetition_penalty: torch.Tensor | None  # [R] float32
    output_token_counts: torch.Tensor | None  # [R, vocab_size] int32
    prompt_token_mask: torch.Tensor | None  # [R, vocab_size] bool
    # (row, token) pairs forced to -inf: stop/EOS tokens of rows below min_tokens
    forbidden_row_idx: torch.Tensor | None  # [K] int64
    forbidden_token_ids: torch.Tensor | None  # [K] int64
    # row index -> that request's own generator (seeded, non-greedy rows only)
    generators: dict[int, torch.Generator]
    # None when no row wants logprobs
    max_num_logprobs: int | None

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalty is None
            and self.frequency_penalty is None
            and self.repetition_penalty is None
        )

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatch:
        """Build the step's batch; row i is request i of every list.

        ``generators[i]`` is request i's generator (``make_generator``) when
        it has a seed, else None. ``eos_token_ids`` are the model's EOS ids,
        forbidden (with each row's stop ids) until a row has ``min_tokens``
        outputs, unless it sets ``ignore_eos``; ids bound with
        ``SamplingParams.with_eos_token_ids`` count as well.
        """
        num_rows = len(params)
        if not num_rows == len(prompt_token_ids) == len(output_token_ids) == len(generators):
            raise ValueError(
                f"SamplingBatch.build: got {num_rows} params, {len(prompt_token_ids)} prompts, "
                f"{len(output_token_ids)} outputs and {len(generators)} generators; "
                "all must have one entry per row"
            )
        greedy = [p.is_greedy for p in params]
        rows = list(zip(params, greedy, strict=True))
        top_k = [p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size for p, g in rows]
        top_p = [1.0 if g else p.top_p for p, g in rows]
        min_p = [0.0 if g else p.min_p for p, g in rows]
        temperature = [1.0 if g else p.temperature for p, g in rows]
        top_k_tensor = None
        if any(k != vocab_size for k in top_k):
            top_k_tensor = to_device(top_k, torch.int64, device)
        forbidden_row_idx, forbidden_token_ids = _forbidden_tokens(
            params, output_token_ids, eos_token_ids, vocab_size, device
        )
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            greedy_mask=to_device(greedy, torch.bool, device),
            temperature=_floats(temperature, device),
            top_k=top_k_tensor,
            top_p=None if all(p >= 1.0 for p in top_p) else _floats(top_p, device),
            min_p=None if all(p <= 0.0 for p in min_p) else _floats(min_p, device),
            **_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            forbidden_row_idx=forbidden_row_idx,
            forbidden_token_ids=forbidden_token_ids,
            generators={
                i: gen for i, gen in enumerate(generators) if gen is not None and not greedy[i]
            },
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        )


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return to_device(values, torch.float32, device)


def _penalties(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    """The penalty fields of a SamplingBatch; all None when no row uses any."""
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    use_presence = any(v != 0.0 for v in presence)
    use_frequency = any(v != 0.0 for v in frequency)
    use_repetition = any(v != 1.0 for v in repetition)
    counts = None
    if use_presence or use_frequency or use_repetition:
        counts = _token_counts(output_token_ids, vocab_size, device)
    prompt_mask = None
    if use_repetition:
        prompt_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0
    return {
        "presence_penalty": _floats(presence, device) if use_presence else None,
        "frequency_penalty": _floats(frequency, device) if use_frequency else None,
        "repetition_penalty": _floats(repetition, device) if use_repetition else None,
        "output_token_counts": counts,
        "prompt_token_mask": prompt_mask,
    }


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """How often each token occurs in each row: [R, vocab_size] int32."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # pad with vocab_size, an extra bucket sliced off below
    padded = [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    idx = to_device(padded, torch.int64, device).reshape(len(token_ids), max_len)
    idx.clamp_(0, vocab_size)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab_size]


def _forbidden_tokens(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row, token) pairs to mask: stop and EOS ids of rows below min_tokens."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        stop_ids = set(p.all_stop_token_ids)
        if not p.ignore_eos:
            stop_ids.update(eos_token_ids)
        for token_id in sorted(stop_ids):
            if 0 <= token_id < vocab_size:
                rows.append(i)
                tokens.append(token_id)
    if not rows:
        return None, None
    return (
        to_device(rows, torch.int64, device),
        to_device(tokens, torch.int64, device),
    )


def row_argmax(x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``[R, V]`` ``x`` (the first maximum, ties and NaN
    as torch's): with ``use_triton`` (CUDA tensors only) the Triton kernel,
    imported only then, else torch's one-block-per-row reduction."""
    if use_triton:
        from kvserve.kernels.argmax import argmax_rows as triton_argmax_rows

        return triton_argmax_rows(x)
    return x.argmax(dim=-1)


class Sampler:
    """Samples one token per row from ``[R, vocab]`` logits; stateless.

    ``use_triton`` (set by the model runner on CUDA with the Triton backend,
    like the layers' switch) takes the Triton argmax; off, torch's (the
    reference).
    """

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample the next token of every row of ``logits`` ([R, vocab]).

        The input tensor is not modified.
        """
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match a batch of "
                f"{batch.num_rows} rows: expected [{batch.num_rows}, {batch.vocab_size}]"
            )
        if logits.shape[1] != batch.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns but the batch was built for "
                f"vocab_size={batch.vocab_size}"
            )
        logits = logits.float()
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, batch)
        if batch.forbidden_row_idx is not None and batch.forbidden_token_ids is not None:
            logits = logits.index_put(
                (batch.forbidden_row_idx, batch.forbidden_token_ids),
                torch.full((), float("-inf"), device=logits.device),
            )
        sampled = self._sample(logits, batch)
        if raw_logprobs is None or batch.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_ids = None if batch.all_random else row_argmax(logits, self.use_triton)
        if batch.all_greedy and greedy_ids is not None:
            return greedy_ids
        # a new tensor: the masks below may work in place
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.min_p is not None:
            apply_min_p_(logits, batch.min_p)
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        random_ids = exponential_race(probs, batch.generators, self.use_triton)
        if greedy_ids is None:
            return random_ids
        return torch.where(batch.greedy_mask, greedy_ids, random_ids)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF/vLLM: on prompt and output tokens), then frequency and
    presence (OpenAI: on output tokens only) penalties; out of place."""
    counts = batch.output_token_counts
    if batch.no_penalties or counts is None:
        return logits
    if batch.repetition_penalty is not None and batch.prompt_token_mask is not None:
        seen = batch.prompt_token_mask | (counts > 0)
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p`` times the row's top one."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then the smallest set of
    them whose probability reaches ``top_p`` (always at least one token)."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # probability mass strictly before each token
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # rows with top_p == 1 keep everything, however the sums round
        threshold = torch.where(top_p < 1.0, top_p - _TOP_P_SLACK, torch.full_like(top_p, 2.0))
        drop = mass_before >= threshold.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def exponential_race(
    probs: torch.Tensor, generators: dict[int, torch.Generator], use_triton: bool = False
) -> torch.Tensor:
    """Sample each row of ``probs`` as argmax(probs / E), E ~ Exponential(1).

    Seeded rows draw their noise from their own generator, so their tokens do
    not depend on the other rows; the rest share the default generator.
    ``use_triton`` as ``row_argmax``'s.
    """
    noise = torch.empty_like(probs)
    noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # E == 0 would turn a masked token's 0 / 0 into NaN, which argmax picks
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return row_argmax(probs / noise, use_triton)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> SamplerOutput:
    """The sampled token's logprob and rank, and the top ``num_top`` logprobs."""
    sampled_ids = sampled.unsqueeze(1)  # [R, 1]
    sampled_logprobs = raw_logprobs.gather(1, sampled_ids)  # [R, 1]
    # 1-based rank, ties counted against the sampled token (as vLLM does)
    ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)
    token_ids, logprobs = sampled_ids, sampled_logprobs
    if num_top > 0:
        top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([sampled_ids, top_ids], dim=1)
        logprobs = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=token_ids,
        logprobs=logprobs,
        sampled_token_ranks=ranks,
    )
