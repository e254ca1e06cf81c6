"""benchmarks/spec_decode.py's plan figures and table: the plan's i.i.d. speed-up sits
beside its upper bound for each real proposer, and equals the theoretical speed-up when a
proposal costs nothing (the oracle)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import load_file_module

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_file_module(REPO / "benchmarks" / "spec_decode.py", "spec_decode_bench")


def test_plan_prediction_iid_and_bound(bench: ModuleType) -> None:
    free = bench.plan_prediction("llama-3-8b", 4, 0.8, 0.0)
    assert free["plan_speedup_iid"] == pytest.approx(bench.theory(0.8, 4))
    assert free["plan_speedup"] == pytest.approx(1 + 4 * 0.8)
    costly = bench.plan_prediction("llama-3-8b", 4, 0.6, 0.1)
    assert costly["plan_speedup_iid"] == pytest.approx(bench.theory(0.6, 4) / 1.4)
    assert costly["plan_speedup_iid"] < costly["plan_speedup"]


def test_real_rows_show_the_plans_iid_speedup_and_its_bound(bench: ModuleType) -> None:
    eagle = {"decode_tok_s": 129.3, "speedup": 0.87, "plan_speedup": 2.3,
             "plan_speedup_iid": 1.58, "alpha_first": 0.61, "mean_accepted_length": 2.8,
             "acceptance_rate": 0.45, "same_tokens_as_plain": False}
    lines = bench.table({"real": {"device": "cpu", "k": 4, "plain": {"decode_tok_s": 147.9},
                                  "eagle": eagle}}).splitlines()
    assert lines[3] == ("| bundled cpu | eagle k=4 | 129.3 | 0.87 | plan 1.58 (≤ 2.30) | 0.61 "
                        "| 2.80 | rate 0.45, TOKENS DIFFER |")
