"""``benchmarks/multi_gpu.py`` without a GPU: the stages it plans for 4 and 8
GPUs fit their calls, a stage past its limit is killed with what it started,
a stage past the call's deadline is skipped, and the summary's tables and
targets come out of JSON shaped as ``kvserve bench`` and the peer scripts
write it (their own tests check those fields)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import multi_gpu
from benchmarks.multi_gpu import DEFAULT_DEADLINE_S, Stage, plan_stages, run_stages
from tests.conftest import process_alive

H100, H200 = 85e9, 150.7e9


def _calls(stages: list[Stage]) -> dict[int, list[str]]:
    calls: dict[int, list[str]] = {}
    for stage in stages:
        calls.setdefault(stage.call, []).append(stage.name)
    return calls


def test_four_gpus_run_in_two_calls(tmp_path: Path) -> None:
    stages = plan_stages(4, H100, tmp_path)
    assert _calls(stages) == {
        1: ["w1-8b-tp1", "w1-8b-tp2", "w1-8b-tp4", "w1-8b-tp4-one-shot",
            "all-reduce-nccl-tp4", "all-reduce-one-shot-tp4", "peer-gptfast-tp4"],
        2: ["w1-70b-tp4", "w2-70b-tp4", "gpu-tests-4"],
    }
    for call in (1, 2):
        assert sum(s.estimate_s for s in stages if s.call == call) <= DEFAULT_DEADLINE_S
    assert all(s.limit_s >= s.estimate_s for s in stages)
    w1 = next(s for s in stages if s.name == "w1-70b-tp4").command
    assert w1[w1.index("--model") + 1] == "llama-3-70b" and "dummy" in w1
    assert w1[w1.index("-tp") + 1] == "4"
    gptfast = next(s for s in stages if s.name == "peer-gptfast-tp4").command
    assert gptfast[gptfast.index("--nproc-per-node") + 1] == "4"


@pytest.mark.parametrize(("gpu_bytes", "tp2"), [(H100, False), (H200, True)])
def test_eight_gpus_add_tp8_the_pipeline_and_tp2_where_70b_fits(
    gpu_bytes: float, tp2: bool, tmp_path: Path
) -> None:
    stages = plan_stages(8, gpu_bytes, tmp_path)
    names = [s.name for s in stages]
    for name in ("w1-8b-tp8", "w1-70b-tp8", "w2-70b-tp8", "w1-70b-tp4", "w2-70b-tp4-pp2",
                 "peer-gptfast-tp8", "all-reduce-one-shot-tp8", "gpu-tests-8"):
        assert name in names
    assert ("w1-70b-tp2" in names) == tp2
    assert stages[-1].name == "gpu-tests-8"
    for call in _calls(stages):
        assert sum(s.estimate_s for s in stages if s.call == call) <= DEFAULT_DEADLINE_S


def test_fewer_than_four_gpus_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--gpus 2: this benchmark is for 4 or 8 GPUs"):
        plan_stages(2, H100, tmp_path)



def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    # the stage starts a child (as torchrun starts ranks) and both sleep
    child_pid = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    hang = Stage("hang", 1, 0.1, 1.5, [sys.executable, "-c", script])
    late = Stage("late", 1, 1000.0, 1000.0, [sys.executable, "-c", "pass"])
    start = time.monotonic()
    assert not run_stages([hang, late], tmp_path, deadline_s=60)
    assert time.monotonic() - start < 20
    assert not (tmp_path / "late.log").exists()  # its estimate passed the deadline
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(pid)


def _latency(card: str, tp: int, decode: float, mbu: float, model: str = "llama-3-8b",
             pp: int = 1) -> dict[str, Any]:
    return {"benchmark": "latency", "card": card, "commit": "abc", "model": model,
            "engine_args": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
            "decode_tok_s": decode, "mean_tpot_ms": 1e3 / decode, "mbu_vs_copy": mbu,
            "decode_step_bytes": 15e9, "copy_gb_s": 3000.0}


def test_summary_tables_plot_and_targets(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    card = "NVIDIA H200"
    runs = {
        "w1-8b-tp1": _latency(card, 1, 200.0, 0.9),
        "w1-8b-tp2": _latency(card, 2, 340.0, 1.5),
        "w1-8b-tp4": _latency(card, 4, 500.0, 2.2),
        "w1-8b-tp4-one-shot": _latency(card, 4, 550.0, 2.4),
        "w1-70b-tp2": _latency(card, 2, 30.0, 1.6, "llama-3-70b"),
        "w1-70b-tp4": _latency(card, 4, 50.0, 2.8, "llama-3-70b"),
        "w1-70b-tp8": _latency(card, 8, 60.0, 3.6, "llama-3-70b"),
        "w2-70b-tp8": {"benchmark": "throughput", "card": card, "output_tok_s": 4000.0,
                       "elapsed_s": 80.0, "engine_args": {"tensor_parallel_size": 8}},
        "w2-70b-tp4-pp2": {"benchmark": "throughput", "card": card, "output_tok_s": 3000.0,
                           "elapsed_s": 100.0, "engine_args": {"tensor_parallel_size": 4,
                                                               "pipeline_parallel_size": 2}},
        "all-reduce-nccl-tp4": {"benchmark": "all_reduce", "card": card, "world_size": 4,
                                "method": "nccl", "us_per_call": {"8KiB": 15.0}},
        "peer-gptfast-tp4": {"benchmark": "peers", "card": card, "peers": {
            "gptfast-tp4": {"decode_tok_s": 400.0, "mbu_per_gpu_vs_copy": 0.5}}},
    }
    for name, run in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    (tmp_path / "w1-70b-tp4.log").write_text(
        "INFO kvserve.worker.model_runner: weights: 35.28 GB in torch.bfloat16, loaded in 0.4 s\n"
        "INFO kvserve.worker.model_runner: weights: 35.28 GB in torch.bfloat16, loaded in 0.6 s\n"
        "INFO kvserve.worker.multiproc_executor: rank 3 (TP rank 3, stage 0, pid 9) on cuda:3: "
        "weights 35.28 GB, profiled step 2.10 GB, KV 30.00 GB for 80 layers x 2 KV heads, "
        "900 blocks, ready in 41.5 s\n")
    summary = multi_gpu.summarize(tmp_path)
    targets = summary["targets"]
    assert targets["70B W1 TP=8 / TP=2, same card (target >= 1.8x)"] == "2.00x"
    assert targets["70B W1 MBU per GPU at TP=4 (target >= 65%)"] == "70.0% of copy"
    assert targets["70B W1 MBU per GPU at TP=8"] == "45.0% of copy"
    assert targets["70B W2 TP=4 x PP=2 / TP=8"] == "0.75x"
    assert targets["8B W1 TP=4 / TP=1"] == "2.50x"
    assert targets["8B W1 TP=4 / gpt-fast TP=4"] == "1.25x"
    assert targets["8B W1 TP=4 one-shot / NCCL"] == "1.10x"
    scaling = (tmp_path / "w1-8b-scaling.txt").read_text()
    # TP=4: 32 layers x 2 all-reduces x 15 µs; bound 15 GB / 4 / 3,000 GB/s
    assert "TP=4" in scaling and "all-reduce 0.96 ms" in scaling and "bound 1.25 ms" in scaling
    assert "gpt-fast TP4: 400.0" in scaling
    out = capsys.readouterr().out
    assert "w1-70b-tp4: 35.28 GB of weights a rank drawn in 0.6 s, ready in 41.5 s" in out
    assert out.rstrip().endswith("| 70B W2 TP=4 x PP=2 / TP=8 | 0.75x |")  # the targets last


def test_the_targets_need_both_70b_runs_on_one_card(tmp_path: Path) -> None:
    (tmp_path / "w1-70b-tp2.json").write_text(json.dumps(
        _latency("NVIDIA H200", 2, 30.0, 1.6, "llama-3-70b")))
    (tmp_path / "w1-70b-tp8.json").write_text(json.dumps(
        _latency("NVIDIA H100 80GB HBM3", 8, 60.0, 3.6, "llama-3-70b")))
    targets = multi_gpu.summarize(tmp_path)["targets"]
    assert targets["70B W1 TP=8 / TP=2, same card (target >= 1.8x)"].startswith("— (needs")


def test_the_command_line_prints_the_plan(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert multi_gpu.main([str(tmp_path), "--plan", "--gpus", "4", "--gpu-gb", "85"]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs: 2 calls" in out and f"{tmp_path} --call 2" in out
    assert multi_gpu.main([str(tmp_path), "--stages", "nope", "--gpus", "4"]) == 2
    assert os.listdir(tmp_path) == []
