"""``kvserve bench latency`` and ``kvserve bench throughput`` on the bundled
model on the CPU at tiny sizes: the JSON's keys and numbers, MBU and the
roofline share recomputed by hand from the JSON's own fields, the workload
generators, card lookup and flag errors. Speed is never asserted here."""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.assets import default_model_path
from kvserve.bench.workloads import MIN_TOKEN_ID, BenchRequest, cap_lengths, w1, w2, w3, w6
from kvserve.cli import main
from kvserve.plan.gpus import gpu_for_device_name

COMMON_KEYS = {
    "benchmark", "date", "kvserve", "commit", "torch", "triton", "model", "device", "dtype",
    "card", "copy_gb_s", "matmul_tflop_s", "matmul_dtype", "spec_bandwidth_gb_s", "params",
    "weight_read_bytes", "kv_bytes_per_token", "engine_args", "engine_stats",
}
LATENCY_FIGURES = {
    f"{stat}_{metric}_ms" for stat in ("mean", "p50", "p90", "p99")
    for metric in ("ttft", "tpot", "e2e")
} | {"decode_tok_s", "output_tok_s", "mean_context", "decode_step_bytes", "mbu_vs_copy",
     "prefill_mfu"}
THROUGHPUT_FIGURES = {"num_requests", "total_input_tokens", "total_output_tokens", "elapsed_s",
                      "requests_per_s", "output_tok_s", "total_tok_s", "compute_roofline_share"}
TINY = ["--device", "cpu", "--disable-tqdm"]


@pytest.fixture(autouse=True)
def _thawed_heap() -> Iterator[None]:
    """A benchmark freezes the heap of the process it runs in, pytest's here: thaw it."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _bench(argv: list[str], tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "result.json"
    assert main(["bench", *argv, *TINY, "--output-json", str(path)]) == 0
    return json.loads(path.read_text())


def _bundled_config() -> dict[str, Any]:
    return json.loads((default_model_path() / "config.json").read_text())


def _positive(result: dict[str, Any], keys: set[str]) -> None:
    for key in keys:
        assert isinstance(result[key], (int, float)) and math.isfinite(result[key]), key
        assert result[key] > 0, key


def test_bench_latency_reports_every_figure_and_mbu_by_its_formula(tmp_path: Path) -> None:
    result = _bench(["latency", "--input-len", "16", "--output-len", "8", "--batch-size", "2",
                     "--num-iters", "1", "--num-iters-warmup", "0"], tmp_path)
    assert result.keys() >= COMMON_KEYS | LATENCY_FIGURES
    _positive(result, LATENCY_FIGURES | {"copy_gb_s", "matmul_tflop_s", "params"})
    assert result["benchmark"] == "latency" and result["device"] == "cpu"
    assert result["spec_bandwidth_gb_s"] is None and result["mbu_vs_spec"] is None
    assert len(result["iterations"]) == 1

    # the bundled model: tied embeddings (read once, by the logits matmul), float32 on the CPU
    config = _bundled_config()
    assert result["weight_read_bytes"] == 4 * result["params"]
    assert result["kv_bytes_per_token"] == 4 * 2 * config["num_hidden_layers"] * (
        config["num_key_value_heads"] * config["head_dim"])

    batch = result["batch_size"]
    assert result["mean_context"] == 16 + 8 / 2
    assert result["decode_tok_s"] == pytest.approx(batch / (result["mean_tpot_ms"] / 1e3))
    step_bytes = result["weight_read_bytes"] + (
        result["kv_bytes_per_token"] * batch * result["mean_context"])
    assert result["decode_step_bytes"] == pytest.approx(step_bytes)
    steps_s = result["decode_tok_s"] / batch
    assert result["mbu_vs_copy"] == pytest.approx(
        step_bytes * steps_s / (result["copy_gb_s"] * 1e9))
    assert result["prefill_mfu"] == pytest.approx(
        2 * result["params"] * batch * 16 / (result["mean_ttft_ms"] / 1e3)
        / (result["matmul_tflop_s"] * 1e12))


def test_bench_throughput_runs_the_capped_workload(tmp_path: Path) -> None:
    result = _bench(["throughput", "--num-prompts", "4", "--max-input-len", "24",
                     "--max-output-len", "6"], tmp_path)
    assert result.keys() >= COMMON_KEYS | THROUGHPUT_FIGURES
    _positive(result, THROUGHPUT_FIGURES)
    assert result["workload"] == "w2" and result["num_requests"] == 4
    assert gc.get_freeze_count() > 0  # the engine's start-up heap is out of the collector's way
    assert result["engine_stats"]["num_preemptions"] == 0
    requests = cap_lengths(w2(_bundled_config()["vocab_size"], num_requests=4), 24, 6)
    assert result["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in requests) == 96
    assert result["total_output_tokens"] == sum(r.output_len for r in requests) == 24
    elapsed = result["elapsed_s"]
    assert result["requests_per_s"] == pytest.approx(4 / elapsed)
    assert result["total_tok_s"] == pytest.approx(120 / elapsed)
    assert result["compute_roofline_share"] == pytest.approx(
        result["total_tok_s"] * 2 * result["params"] / (result["matmul_tflop_s"] * 1e12))


def _lengths(requests: list[BenchRequest]) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.output_len) for r in requests]


def test_workloads_are_deterministic_and_in_range() -> None:
    vocab = 1000
    for make in (lambda: w1(vocab, batch_size=3), lambda: w2(vocab, 50),
                 lambda: w3(vocab, 4), lambda: w6(vocab)):
        first, again = make(), make()
        assert first == again
        assert all(MIN_TOKEN_ID <= t < vocab for r in first for t in r.prompt_token_ids)
    assert _lengths(w1(vocab, batch_size=2)) == [(128, 256)] * 2
    assert _lengths(w1(vocab, 4096, 256)) == [(4096, 256)]
    assert _lengths(w3(vocab, 3)) == [(1000, 1000)] * 3
    assert _lengths(w6(vocab)) == [(2048, 1)]
    lengths = _lengths(w2(vocab))
    assert len(lengths) == 1000 and len(w3(vocab)) == 512
    assert all(128 <= p <= 2048 and 128 <= o <= 512 for p, o in lengths)
    assert len(set(lengths)) > 900  # drawn, not constant
    assert w2(vocab, 10)[:5] == w2(vocab, 5)  # the first N are the same for any N
    assert w1(vocab, seed=1) != w1(vocab, seed=0)
    assert w1(vocab, batch_size=2)[0] != w1(vocab, batch_size=2)[1]
    capped = cap_lengths(w2(vocab, 3), 100, None)
    assert [len(r.prompt_token_ids) for r in capped] == [100] * 3
    assert [r.output_len for r in capped] == [r.output_len for r in w2(vocab, 3)]
    with pytest.raises(ValueError, match="vocab_size"):
        w1(MIN_TOKEN_ID)


@pytest.mark.parametrize(("device_name", "table_name"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200", "h200"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA GH200 480GB", None), ("NVIDIA H100 NVL", None),  # bandwidths in no table row
])
def test_cards_are_found_by_their_cuda_names(device_name: str, table_name: str | None) -> None:
    spec = gpu_for_device_name(device_name)
    assert (spec.name if spec else None) == table_name


@pytest.mark.parametrize(("argv", "flag"), [
    (["latency", "--batch-size", "0"], "--batch-size"),
    (["latency", "--num-iters", "0"], "--num-iters"),
    (["latency", "--input-len", "2040", "--output-len", "16"], "--input-len"),
    (["throughput", "--num-prompts", "0"], "--num-prompts"),
    (["throughput", "--max-output-len", "-1"], "--max-output-len"),
])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], flag: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv, *TINY]) == 2
    assert flag in capsys.readouterr().err
