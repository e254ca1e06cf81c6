"""Turns the model's last-position logits into next tokens, on the device.

Per step the model runner builds one ``SamplingBatch`` (per-request settings
as device tensors plus host-side fast-path flags) from the ``SamplingRows``
it keeps per request (numpy columns) and calls ``Sampler``.
The order of operations is:

    logit bias -> grammar bitmask -> penalties (repetition, presence, frequency, DRY)
    -> min_tokens mask
    -> greedy rows: argmax
    -> temperature -> min_p -> top_k -> top_p -> exponential-race sample

Everything before the draw is ``Sampler.process``, which speculative
verification (``rejection.py``) shares, so a speculative step accepts
against exactly the distribution a plain step would sample from.
Logprobs are of the raw model distribution (log_softmax of the logits as
given, before any of the above), as vLLM returns them by default.
Both argmaxes (greedy rows, the race) take ``kernels/argmax.py`` with ``use_triton``.

This module must not synchronise with the host: no ``.item()``, no
``.tolist()``, no branches on tensor values, no blocking host-to-device
copies (``to_device`` queues them). Every branch is on a flag that
``SamplingBatch.from_rows`` computed on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.host_copy import to_device
from kvserve.sampling.dry import DrySettings, dry_triples

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


class SamplingRows:
    """Per-row sampling settings as numpy columns, the form the model runner
    keeps between steps (one row per request) and a step's batch is taken from.

    Greedy rows hold the neutral values (temperature 1.0, top-k/top-p/min-p
    off), so a column is "used" exactly when some row differs from neutral.
    The float columns are the rows of one array (``FLOAT_COLUMNS`` order), so
    a step takes and checks them all in one numpy call each. ``argmax_only``
    marks the rows whose token is always the argmax of their logits: greedy,
    with no penalty, no logprobs and no ``min_tokens`` (whose masked stop ids
    change the argmax), so a batch of them needs no ``SamplingBatch``.
    """

    def __init__(self, num_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.greedy = np.zeros(num_rows, dtype=bool)
        self.floats = np.repeat(_NEUTRAL[:, None], num_rows, axis=1)
        self.top_k = np.full(num_rows, vocab_size, dtype=np.int64)  # vocab_size: off
        self.num_logprobs = np.full(num_rows, -1, dtype=np.int64)  # -1: none wanted
        self.argmax_only = np.zeros(num_rows, dtype=bool)
        # DRY: a DrySettings per row that uses it (``dry_on``), else None
        self.dry = np.full(num_rows, None, dtype=object)
        self.dry_on = np.zeros(num_rows, dtype=bool)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> SamplingRows:
        """Row i holds ``params[i]``."""
        rows = cls(len(params), vocab_size)
        for i, p in enumerate(params):
            rows.set(i, p)
        return rows

    def set(self, row: int, params: SamplingParams) -> None:
        greedy = params.is_greedy
        self.greedy[row] = greedy
        self.floats[:, row] = (
            1.0 if greedy else params.temperature,
            1.0 if greedy else params.top_p,
            0.0 if greedy else params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self.top_k[row] = (params.top_k if 0 < params.top_k < self.vocab_size and not greedy
                           else self.vocab_size)
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.dry_on[row] = params.uses_dry
        self.dry[row] = DrySettings(
            params.dry_multiplier, params.dry_base, params.dry_allowed_length,
            params.dry_penalty_last_n, params.dry_breaker_ids) if params.uses_dry else None
        self.argmax_only[row] = (greedy and params.logprobs is None and params.min_tokens == 0
                                 and not params.changes_logits
                                 and not self.has_penalties(np.array([row]))[0])

    def has_penalties(self, rows: np.ndarray) -> np.ndarray:
        """Per row of ``rows``: whether any penalty is on (sampling reads its
        tokens: the prompt's and the outputs')."""
        penalties = self.floats[3:, rows]
        return (penalties != _NEUTRAL[3:, None]).any(axis=0) | self.dry_on[rows]

    def take(self, rows: np.ndarray) -> SamplingRows:
        """The settings of ``rows``, in that order."""
        taken = SamplingRows.__new__(SamplingRows)
        taken.vocab_size = self.vocab_size
        taken.greedy = self.greedy[rows]
        taken.floats = self.floats[:, rows]
        taken.top_k = self.top_k[rows]
        taken.num_logprobs = self.num_logprobs[rows]
        taken.argmax_only = self.argmax_only[rows]
        taken.dry = self.dry[rows]
        taken.dry_on = self.dry_on[rows]
        return taken

    @property
    def num_rows(self) -> int:
        return len(self.greedy)


FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
# each float column's "off" value (the penalties' rows: 3 and after)
_NEUTRAL = np.array([1.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=np.float32)


@dataclass
class SamplingBatch:
    """Per-request sampling settings of one step, as device tensors.

    A tensor is None when no row needs it; that is what the fast-path
    properties (``no_penalties``, ``no_top_k``, ...) read. An all-greedy
    batch has no temperature or mask either: it is an argmax.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [R] bool; None when all rows agree
    temperature: torch.Tensor | None  # [R] float32, 1.0 on greedy rows; None if all greedy
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
    # (row, token, bias) triples added to the logits (SamplingParams.logit_bias)
    bias_row_idx: torch.Tensor | None  # [B] int64
    bias_token_ids: torch.Tensor | None  # [B] int64
    bias_values: torch.Tensor | None  # [B] float32
    # (row, token, penalty) triples subtracted from the logits (DRY, kvserve/sampling/dry.py)
    dry_row_idx: torch.Tensor | None  # [D] int64
    dry_token_ids: torch.Tensor | None  # [D] int64
    dry_values: torch.Tensor | None  # [D] float32
    # structured output: bit j of word i of a row set when token 32 i + j is allowed
    token_bitmask: torch.Tensor | None  # [R, ceil(vocab_size / 32)] int32
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
        forbidden = [(i, token_id) for i, p in enumerate(params)
                     for token_id in forbidden_token_ids(p, len(output_token_ids[i]),
                                                         eos_token_ids, vocab_size)]
        return cls.from_rows(
            SamplingRows.of(params, vocab_size), prompt_token_ids, output_token_ids, forbidden,
            {i: g for i, g in enumerate(generators) if g is not None}, device,
            logit_bias_triples(enumerate(params)),
        )

    @classmethod
    def from_rows(
        cls,
        rows: SamplingRows,
        prompt_token_ids: Sequence[Sequence[int]] | None,
        output_token_ids: Sequence[Sequence[int]] | None,
        forbidden: Sequence[tuple[int, int]],
        generators: dict[int, torch.Generator],
        device: torch.device | str,
        logit_bias: Sequence[tuple[int, int, float]] = (),
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """The batch of ``rows``. The token ids are read only when a row has a
        penalty, DRY included (the runner passes None otherwise); ``forbidden`` are the
        (row, token) pairs to mask (``forbidden_token_ids``); ``generators``
        maps rows to seeded generators (greedy rows' are dropped);
        ``logit_bias`` the (row, token, bias) triples (``logit_bias_triples``);
        ``token_bitmask`` the rows' allowed tokens, on the host (int32 words)."""
        vocab_size = rows.vocab_size
        all_greedy = bool(rows.greedy.all())
        all_random = not rows.greedy.any()
        use_top_k = bool((rows.top_k != vocab_size).any())
        used = (rows.floats != _NEUTRAL[:, None]).any(axis=1)
        used[0] = not all_greedy  # temperatures divide every random row, 1.0 or not
        # every float column in use goes to the device in one copy
        tensors: dict[str, torch.Tensor | None] = dict.fromkeys(FLOAT_COLUMNS)
        if used.any():
            stacked = to_device(rows.floats[used], torch.float32, device)
            names = [name for name, on in zip(FLOAT_COLUMNS, used.tolist(), strict=True) if on]
            tensors.update(zip(names, stacked.unbind(0), strict=True))
        counts = prompt_mask = None
        if (used[3:].any() or rows.dry_on.any()) and (prompt_token_ids is None
                                                      or output_token_ids is None):
            raise ValueError("SamplingBatch.from_rows: penalties need the rows' token ids")
        if used[3:].any():
            assert prompt_token_ids is not None and output_token_ids is not None
            counts = _token_counts(output_token_ids, vocab_size, device)
            if used[5]:
                prompt_mask = _token_counts(prompt_token_ids, vocab_size, device) > 0
        forbidden_rows = forbidden_ids = None
        if forbidden:
            pairs = to_device(list(forbidden), torch.int64, device)
            forbidden_rows, forbidden_ids = pairs[:, 0], pairs[:, 1]
        bias_rows = bias_ids = bias_values = None
        if logit_bias:
            bias_rows = to_device([t[0] for t in logit_bias], torch.int64, device)
            bias_ids = to_device([t[1] for t in logit_bias], torch.int64, device)
            bias_values = to_device([t[2] for t in logit_bias], torch.float32, device)
        dry_rows = dry_ids = dry_values = None
        if rows.dry_on.any():
            assert prompt_token_ids is not None and output_token_ids is not None
            triples = dry_triples([(i, rows.dry[i], [*prompt_token_ids[i], *output_token_ids[i]])
                                   for i in np.flatnonzero(rows.dry_on).tolist()])
            if triples:
                dry_rows = to_device([t[0] for t in triples], torch.int64, device)
                dry_ids = to_device([t[1] for t in triples], torch.int64, device)
                dry_values = to_device([t[2] for t in triples], torch.float32, device)
        max_logprobs = int(rows.num_logprobs.max(initial=-1))
        return cls(
            num_rows=rows.num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=(None if all_greedy or all_random
                         else to_device(rows.greedy, torch.bool, device)),
            temperature=tensors["temperature"],
            top_k=to_device(rows.top_k, torch.int64, device) if use_top_k else None,
            top_p=tensors["top_p"],
            min_p=tensors["min_p"],
            presence_penalty=tensors["presence_penalty"],
            frequency_penalty=tensors["frequency_penalty"],
            repetition_penalty=tensors["repetition_penalty"],
            output_token_counts=counts,
            prompt_token_mask=prompt_mask,
            forbidden_row_idx=forbidden_rows,
            forbidden_token_ids=forbidden_ids,
            bias_row_idx=bias_rows,
            bias_token_ids=bias_ids,
            bias_values=bias_values,
            dry_row_idx=dry_rows,
            dry_token_ids=dry_ids,
            dry_values=dry_values,
            token_bitmask=(None if token_bitmask is None
                           else to_device(token_bitmask.numpy(), torch.int32, device)),
            generators={i: g for i, g in generators.items() if not rows.greedy[i]},
            max_num_logprobs=max_logprobs if max_logprobs >= 0 else None,
        )


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """How often each token occurs in each row: [R, vocab_size] int32."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # pad with vocab_size, an extra bucket sliced off below; numpy rows, one copy
    padded = np.full((len(token_ids), max_len), vocab_size, dtype=np.int64)
    for row, ids in enumerate(token_ids):
        padded[row, :len(ids)] = ids
    idx = to_device(padded, torch.int64, device)
    idx.clamp_(0, vocab_size)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab_size]


def logit_bias_triples(
    rows: Iterable[tuple[int, SamplingParams]],
) -> list[tuple[int, int, float]]:
    """(row, token, bias) for every ``logit_bias`` entry of ``(row, params)``."""
    return [(row, token_id, float(bias)) for row, params in rows
            for token_id, bias in (params.logit_bias or {}).items()]


def forbidden_token_ids(
    params: SamplingParams, num_outputs: int, eos_token_ids: Sequence[int], vocab_size: int
) -> list[int]:
    """The tokens a row may not sample yet: its stop and EOS ids while it
    has fewer than ``min_tokens`` outputs (sorted; none after that)."""
    if num_outputs >= params.min_tokens:
        return []
    stop_ids = set(params.all_stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(eos_token_ids)
    return [token_id for token_id in sorted(stop_ids) if 0 <= token_id < vocab_size]


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

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy tokens of ``[R, vocab]`` logits: what ``__call__`` samples
        for rows that are all ``SamplingRows.argmax_only``."""
        return row_argmax(logits, self.use_triton)

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
        greedy_ids, probs = self.process(logits, batch)
        if probs is None:
            assert greedy_ids is not None, "an all-greedy batch has its argmax"
            sampled = greedy_ids
        else:
            sampled = exponential_race(probs, batch.generators, self.use_triton)
            if greedy_ids is not None and batch.greedy_mask is not None:
                sampled = torch.where(batch.greedy_mask, greedy_ids, sampled)
        if raw_logprobs is None or batch.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)

    def process(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Everything a step applies to float32 ``[R, vocab]`` logits before
        it draws: the greedy rows' tokens (None when every row is random) and
        the random rows' final distribution (None when every row is greedy;
        rows of the other kind hold values to ignore). Speculative
        verification takes the target's distribution from here, so it is
        exactly the one a plain step samples from."""
        if batch.bias_row_idx is not None:
            assert batch.bias_token_ids is not None and batch.bias_values is not None
            logits = logits.index_put((batch.bias_row_idx, batch.bias_token_ids),
                                      batch.bias_values, accumulate=True)
        if batch.token_bitmask is not None:
            logits = apply_token_bitmask(logits, batch.token_bitmask)
        logits = apply_penalties(logits, batch)
        if batch.dry_row_idx is not None:
            assert batch.dry_token_ids is not None and batch.dry_values is not None
            logits = logits.index_put((batch.dry_row_idx, batch.dry_token_ids),
                                      -batch.dry_values, accumulate=True)
        if batch.forbidden_row_idx is not None and batch.forbidden_token_ids is not None:
            logits = logits.index_put(
                (batch.forbidden_row_idx, batch.forbidden_token_ids),
                torch.full((), float("-inf"), device=logits.device),
            )
        greedy_ids = None if batch.all_random else self.argmax(logits)
        if batch.all_greedy:
            return greedy_ids, None
        assert batch.temperature is not None, "a batch with random rows has temperatures"
        # a new tensor: the masks below may work in place
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.min_p is not None:
            apply_min_p_(logits, batch.min_p)
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        return greedy_ids, torch.softmax(logits, dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``-inf`` for every token whose bit is clear (bit ``j`` of word ``i`` is
    token ``32 i + j``); out of place."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :logits.shape[1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


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
