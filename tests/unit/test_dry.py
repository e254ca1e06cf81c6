"""The DRY penalty (``kvserve/sampling/dry.py``, llama.cpp's parameters): its
host-side penalties against a direct count over every earlier position, its
place in the sampler, the checks on its parameters, breaker strings resolved
to token ids, the model's generation_config and the CLI's flags as defaults,
and through the engine: it changes only the requests that ask for it, and
greedy output with it is identical with speculation on and off."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser
from kvserve.console import sampling_params
from kvserve.engine.generation_config import read_sampling_defaults
from kvserve.sampling.dry import MAX_EXPONENT, DrySettings, dry_penalties
from kvserve.sampling.sampler import Sampler, SamplingBatch, SamplingRows

DRY = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
       "dry_sequence_breakers": []}


def settings(multiplier: float = 0.8, base: float = 1.75, allowed: int = 2, last_n: int = -1,
             breakers: frozenset[int] = frozenset()) -> DrySettings:
    return DrySettings(multiplier, base, allowed, last_n, breakers)


def direct_penalties(tokens: list[int], s: DrySettings) -> dict[int, float]:
    """For each earlier position j, count back how far tokens[:j + 1] and
    tokens end alike (never through a breaker); tokens[j + 1] gets the
    penalty of the longest such match of at least allowed_length."""
    h = tokens[-s.penalty_last_n:] if s.penalty_last_n > 0 else tokens
    out: dict[int, float] = {}
    for j in range(len(h) - 1):
        length = 0
        while (length <= j and h[j - length] == h[-1 - length]
               and h[-1 - length] not in s.breaker_ids):
            length += 1
        if length >= s.allowed_length:
            exponent = min(length - s.allowed_length, MAX_EXPONENT)
            value = s.multiplier * s.base ** exponent
            out[h[j + 1]] = max(out.get(h[j + 1], 0.0), value)
    return out


def as_dict(result: tuple[np.ndarray, np.ndarray]) -> dict[int, float]:
    ids, values = result
    assert len(set(ids.tolist())) == len(ids)  # each token once
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


@pytest.mark.parametrize("s", [settings(), settings(allowed=1), settings(allowed=3, base=2.0),
                               settings(last_n=12), settings(breakers=frozenset({0})),
                               settings(allowed=1, breakers=frozenset({1, 2}), last_n=30)])
def test_penalties_match_a_direct_count(s: DrySettings) -> None:
    rng = random.Random(0)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        got = as_dict(dry_penalties(tokens, s))
        want = direct_penalties(tokens, s)
        assert got.keys() == want.keys(), tokens
        for token, value in want.items():
            assert got[token] == pytest.approx(value, rel=1e-6)


def test_a_worked_example() -> None:
    # "1 2 3 4 1 2 3": 3 ends a repeat of "1 2 3" (length 3), so 4 would extend it:
    # 0.8 * 1.75 ** (3 - 2); "2 3" also ended at position 2 ... nothing else repeats
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert as_dict(dry_penalties(tokens, settings())) == pytest.approx({4: 0.8 * 1.75})
    assert as_dict(dry_penalties(tokens, settings(allowed=4))) == {}
    # a breaker inside the repeat cuts it to "3" alone, below allowed_length
    assert as_dict(dry_penalties(tokens, settings(breakers=frozenset({2})))) == {}
    assert as_dict(dry_penalties(tokens, settings(multiplier=0.0))) == {}
    assert as_dict(dry_penalties(tokens, settings(last_n=0))) == {}
    # a long run of one token: the exponent stops at MAX_EXPONENT, finite
    _, values = dry_penalties([7] * 200, settings())
    assert np.isfinite(values).all() and values.max() == pytest.approx(0.8 * 1.75 ** MAX_EXPONENT)


def test_the_sampler_subtracts_the_penalties_from_its_rows_only() -> None:
    vocab = 8
    history = [1, 2, 3, 4, 1, 2, 3]
    logits = torch.zeros(2, vocab)
    logits[:, 4] = 1.0  # the repeat's continuation leads by 1.0 ...
    logits[:, 5] = 0.5  # ... and loses to 5 once 0.8 * 1.75 = 1.4 is taken off it
    params = [SamplingParams(temperature=0.0, **DRY), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [history[:4]] * 2, [history[4:]] * 2, [None, None],
                                vocab, "cpu")
    out = Sampler()(logits, batch)
    assert out.sampled_token_ids.tolist() == [5, 4]
    greedy, _ = Sampler().process(logits.clone(), batch)
    assert greedy is not None and greedy.tolist() == [5, 4]
    # a DRY row reads its tokens, so it is never a plain argmax
    rows = SamplingRows.of(params, vocab)
    assert rows.has_penalties(np.arange(2)).tolist() == [True, False]
    assert not rows.argmax_only[0] and rows.argmax_only[1]
    with pytest.raises(ValueError, match="penalties need the rows' token ids"):
        SamplingBatch.from_rows(rows, None, None, [], {}, "cpu")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dry_multiplier": -0.1}, "dry_multiplier=-0.1 is invalid: must be in"),
    ({"dry_base": 1.0}, r"dry_base=1.0 is invalid: must be in \(1, 10\]"),
    ({"dry_allowed_length": 0}, "dry_allowed_length=0 is invalid: must be an integer >= 1"),
    ({"dry_allowed_length": 2.5}, "dry_allowed_length=2.5 is invalid"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n=-2 is invalid"),
    ({"dry_sequence_breakers": ["\n", ""]}, r"dry_sequence_breakers\[1\]='' is invalid"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers='\\\\n' is invalid: must be a list"),
])
def test_bad_parameters_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", with_tokenizer=True)


def test_breakers_resolve_to_the_tokens_that_hold_them(model: Path) -> None:
    llm = LLM(model=str(model), num_kv_blocks=32)
    processor = llm.engine.processor
    tokenizer = processor.tokenizer
    default = processor.dry_breaker_ids(None)
    assert default and all(any(b in tokenizer.decode([i], skip_special_tokens=False)
                               for b in ("\n", ":", '"', "*")) for i in default)
    assert tokenizer.encode("\n", add_special_tokens=False)[0] in default
    assert processor.dry_breaker_ids([]) == frozenset()
    # bound to the request's params only when DRY is on
    resolved = processor.resolve_params(4, SamplingParams(dry_multiplier=0.5))
    assert resolved.dry_breaker_ids == default
    assert processor.resolve_params(4, SamplingParams()).dry_breaker_ids == frozenset()


PROMPTS = [[5, 17, 99, 3, 250, 7, 42], [7, 7, 7, 7, 7, 7, 7, 7, 7], list(range(20, 40)),
           [300, 12, 8, 8, 8, 19, 77, 1, 64, 120, 33, 9, 18, 200, 11, 4, 90, 91, 92, 93, 5]]


def token_ids(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_dry_changes_only_the_requests_that_ask_for_it(model: Path) -> None:
    llm = LLM(model=str(model), num_kv_blocks=64, block_size=4)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    dry = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, dry_multiplier=2.0,
                         dry_allowed_length=2, dry_sequence_breakers=[])
    without = token_ids(llm, [plain] * 4)
    with_dry = token_ids(llm, [dry] * 4)
    mixed = token_ids(llm, [dry, plain, dry, plain])
    assert with_dry != without  # a tiny random model repeats itself, DRY breaks it
    assert mixed == [with_dry[0], without[1], with_dry[2], without[3]]
    # the longest repeat left in a DRY output is short: its penalty grows per token
    assert longest_repeat(with_dry[1]) < longest_repeat(without[1])


def longest_repeat(tokens: list[int]) -> int:
    """The longest run of tokens that also starts at an earlier position."""
    return max((m for n in range(len(tokens) + 1) for m in range(1, n + 1)
                if any(tokens[j:j + m] == tokens[n - m:n] for j in range(n - m))), default=0)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_output_with_dry_is_identical_with_speculation(model: Path,
                                                              async_scheduling: bool) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **DRY),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                             dry_multiplier=1.5, dry_allowed_length=3, dry_sequence_breakers=[]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **DRY)]
    expected = token_ids(LLM(model=str(model), block_size=4), params)
    for config in ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                   {"method": "draft_model", "model": str(model)},
                   {"method": "oracle", "acceptance_rate": 1.0}):
        llm = LLM(model=str(model), block_size=4, async_scheduling=async_scheduling,
                  speculative_config={**config, "num_speculative_tokens": 4,
                                      "auto_disable": False})
        assert token_ids(llm, params) == expected, config["method"]
        if config["method"] == "oracle":
            # the oracle proposes the plain output itself: all accepted only if
            # every verified position saw the proposals before it as its history
            assert token_ids(llm, params) == expected
            stats = llm.stats()
            assert (stats["spec_decode_num_accepted_tokens"]
                    == stats["spec_decode_num_draft_tokens"] > 20)


def test_generation_config_and_cli_flags_set_dry(model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "tuned"
    shutil.copytree(model, folder)
    values = {"repetition_penalty": 1.1, "dry_multiplier": 0.8, "dry_allowed_length": 8,
              "dry_sequence_breakers": []}
    (folder / "generation_config.json").write_text(json.dumps(values))
    defaults = read_sampling_defaults("auto", str(folder))
    assert defaults == {"repetition_penalty": 1.1, "dry_multiplier": 0.8,
                        "dry_allowed_length": 8, "dry_sequence_breakers": []}
    assert LLM(model=str(folder), num_kv_blocks=32).get_default_sampling_params() == (
        SamplingParams(**defaults))
    (folder / "generation_config.json").write_text(json.dumps({"dry_sequence_breakers": "\n"}))
    with pytest.raises(ValueError, match="dry_sequence_breakers='\\\\n' must be a list"):
        read_sampling_defaults("auto", str(folder))
    # the CLI: unset flags take the model's values, given ones win, temperature stays greedy
    args = build_parser().parse_args(["generate", "--model", str(folder), "--prompt", "x"])
    params = sampling_params(args, defaults)
    assert (params.dry_multiplier, params.dry_allowed_length, params.repetition_penalty,
            params.dry_sequence_breakers, params.temperature) == (0.8, 8, 1.1, [], 0.0)
    args = build_parser().parse_args(["generate", "--model", str(folder), "--prompt", "x",
                                      "--dry-multiplier", "0", "--repetition-penalty", "1.0"])
    params = sampling_params(args, {**defaults, "temperature": 0.7})
    assert (params.dry_multiplier, params.repetition_penalty, params.temperature) == (
        0.0, 1.0, 0.0)
    assert not params.uses_dry


def test_dry_settings_survive_the_trip_to_an_engine_core_process() -> None:
    """The core process gets requests as msgpack (``engine/core_proc.py``):
    the DRY fields and the bound breaker ids must arrive."""
    import msgspec

    from kvserve.engine.core_client import EngineCoreRequest

    params = SamplingParams(dry_multiplier=0.8, dry_allowed_length=5, dry_penalty_last_n=64,
                            dry_sequence_breakers=["\n"]).with_dry_breaker_ids(frozenset({3, 9}))
    encoded = msgspec.msgpack.Encoder().encode((EngineCoreRequest("a", [1, 2], params), None))
    request, _ = msgspec.msgpack.Decoder(tuple[EngineCoreRequest, str | None]).decode(encoded)
    assert request.sampling_params == params
    assert request.sampling_params.dry_breaker_ids == frozenset({3, 9})


def test_the_breaker_cache_keeps_only_the_latest_lists(model: Path) -> None:
    from kvserve.engine.input_processor import BREAKER_CACHE_SIZE

    processor = LLM(model=str(model), num_kv_blocks=32).engine.processor
    lists = [[f"x{i}"] for i in range(BREAKER_CACHE_SIZE + 5)]
    for breakers in lists:
        processor.dry_breaker_ids(breakers)
    assert len(processor._breaker_ids) == BREAKER_CACHE_SIZE
    assert tuple(lists[-1]) in processor._breaker_ids
    assert tuple(lists[0]) not in processor._breaker_ids
