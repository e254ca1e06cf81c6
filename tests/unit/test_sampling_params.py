"""SamplingParams: defaults, normalisation, validation messages, n > 1 children."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvserve.core.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy


def test_stop_normalised_to_lists() -> None:
    p = SamplingParams(stop="\n", stop_token_ids=(7, 8))  # type: ignore[arg-type]
    assert p.stop == ["\n"] and p.stop_strings == ["\n"]
    assert p.stop_token_ids == [7, 8]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_value_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert "is invalid" in str(info.value)


def test_message_format() -> None:
    with pytest.raises(ValueError, match=r"^temperature=-1\.0 is invalid: must be >= 0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p=0 is invalid: must be in \(0, 1\]$"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 5},
        {"temperature": 0.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 16},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"repetition_penalty": 0.5},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    ],
)
def test_valid_edges(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_all_stop_token_ids_and_eos() -> None:
    p = SamplingParams(stop_token_ids=[5, 6])
    assert p.all_stop_token_ids == {5, 6}
    bound = p.with_eos_token_ids([2])
    assert bound.all_stop_token_ids == {2, 5, 6} and bound.eos_token_ids == (2,)
    assert p.all_stop_token_ids == {5, 6}  # the original is untouched
    ignoring = SamplingParams(stop_token_ids=[5], ignore_eos=True).with_eos_token_ids([2])
    assert ignoring.all_stop_token_ids == {5}


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.clone()
    assert q == p
    assert isinstance(q.stop, list) and q.stop_token_ids is not None
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]


def test_children_seeds() -> None:
    p = SamplingParams(n=3, seed=10, temperature=0.7)
    children = p.children()
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 for c in children)
    assert p.n == 3 and p.seed == 10
    unseeded = SamplingParams(n=2).children()
    assert [c.seed for c in unseeded] == [None, None]
    assert SamplingParams(n=2, seed=2**63 - 1).child(1).seed == -(2**63)
    with pytest.raises(ValueError, match="index"):
        p.child(3)


def test_core_imports_no_torch() -> None:
    code = (
        "import sys, kvserve.core.sampling_params\n"
        "assert 'torch' not in sys.modules, 'kvserve.core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
