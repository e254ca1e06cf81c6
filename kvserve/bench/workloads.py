"""The workloads of ``../shared/BENCHMARKS.md`` as seeded lists of requests.

A request is random token ids (drawn from ``random.Random(seed)`` in
``[MIN_TOKEN_ID, vocab_size)``, so no tokenizer is needed and special ids stay
out) plus the number of tokens to generate with ``ignore_eos``. The same call
gives the same requests in every process, which is how kvserve's benchmarks
and ``benchmarks/peers.py`` run identical work. Requests are drawn one after
another from one stream, so the first N of a workload are the same whatever
the number asked for.

- W1 latency: a batch of prompts of 128 (also 4,096) tokens, 256 new tokens.
- W2 throughput: 1,000 requests, prompt ~ U[128, 2048], output ~ U[128, 512].
- W3 fixed: 512 requests of 1,000 tokens in, 1,000 out.
- W6 prefill: one 2,048-token prompt, one new token (its TTFT is the figure).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

MIN_TOKEN_ID = 100


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size={vocab_size} is too small: workloads draw token ids "
                         f"from [{MIN_TOKEN_ID}, vocab_size)")
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(length)]


def _fixed(vocab_size: int, input_len: int, output_len: int, num_requests: int,
           seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_prompt(rng, input_len, vocab_size), output_len)
            for _ in range(num_requests)]


def w1(vocab_size: int, input_len: int = 128, output_len: int = 256, batch_size: int = 1,
       seed: int = 0) -> list[BenchRequest]:
    """W1: ``batch_size`` prompts of ``input_len`` tokens, ``output_len`` new tokens each."""
    return _fixed(vocab_size, input_len, output_len, batch_size, seed)


def w2(vocab_size: int, num_requests: int = 1000, seed: int = 0) -> list[BenchRequest]:
    """W2: prompt length ~ U[128, 2048], output length ~ U[128, 512]."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        input_len, output_len = rng.randint(128, 2048), rng.randint(128, 512)
        requests.append(BenchRequest(_prompt(rng, input_len, vocab_size), output_len))
    return requests


def w3(vocab_size: int, num_requests: int = 512, seed: int = 0) -> list[BenchRequest]:
    """W3: 1,000 tokens in, 1,000 out."""
    return _fixed(vocab_size, 1000, 1000, num_requests, seed)


def w6(vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """W6: one 2,048-token prompt and one new token
    (``kvserve bench latency --input-len 2048 --output-len 1``)."""
    return _fixed(vocab_size, 2048, 1, 1, seed)


THROUGHPUT_WORKLOADS: dict[str, Callable[..., list[BenchRequest]]] = {"w2": w2, "w3": w3}


def cap_lengths(requests: list[BenchRequest], max_input_len: int | None,
                max_output_len: int | None) -> list[BenchRequest]:
    """The same requests with prompts cut to ``max_input_len`` tokens and outputs
    to ``max_output_len`` (a scaled-down run, e.g. on a CPU); None keeps a length."""
    return [BenchRequest(r.prompt_token_ids[:max_input_len],
                         min(r.output_len, max_output_len or r.output_len))
            for r in requests]
