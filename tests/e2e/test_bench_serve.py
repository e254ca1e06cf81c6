"""``kvserve bench serve`` against the test server (random and ShareGPT data, a
rate sweep with a plot), plus its pure pieces: rate and SLO parsing, SSE
splitting, the metrics with vLLM's key names."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench import serve as bench
from tests.e2e.conftest import MODEL_NAME, REPO_ROOT, ServerProcess

VLLM_KEYS = [
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p50", "p90", "p99")),
]


def run_bench(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", server.url,
               "--disable-tqdm", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})


def test_bench_random_writes_vllm_json(serve_tiny: ServerProcess, tmp_path: Path) -> None:
    result = run_bench(serve_tiny, "--num-prompts", "8", "--random-input-len", "12",
                       "--random-output-len", "6", "--ignore-eos", "--request-rate", "40",
                       "--max-concurrency", "4", "--goodput", "ttft:60000", "tpot:60000",
                       "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                       "--result-filename", "out.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Serving Benchmark Result" in result.stdout
    saved = json.loads((tmp_path / "out.json").read_text())
    for key in VLLM_KEYS:
        assert key in saved, key
    assert saved["model_id"] == MODEL_NAME
    assert saved["completed"] == 8 and saved["failed"] == 0
    assert saved["total_output_tokens"] == 8 * 6
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    assert 0 < saved["median_ttft_ms"] <= saved["p99_ttft_ms"]
    assert saved["max_concurrent_requests"] <= 4
    # one gap per content chunk; a token that ends mid-character adds no chunk
    assert len(saved["itls"]) == 8 and all(len(gaps) <= 5 for gaps in saved["itls"])


def test_bench_sharegpt_chat_sweep_and_plot(serve_tiny: ServerProcess, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    conversations = [{"conversations": [{"from": "human", "value": f"tell me about {w}"},
                                        {"from": "gpt", "value": "x" * 24}]}
                     for w in ("foxes", "dogs", "caches")]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    plot = tmp_path / "sweep.png"
    result = run_bench(serve_tiny, "--backend", "openai-chat", "--dataset-name", "sharegpt",
                       "--dataset-path", str(dataset), "--num-prompts", "4",
                       "--request-rate", "20,inf", "--burstiness", "0.5", "--save-result",
                       "--result-dir", str(tmp_path), "--result-filename", "chat.json",
                       "--plot", str(plot))
    assert result.returncode == 0, result.stderr[-3000:]
    for rate in ("20.0", "inf"):
        saved = json.loads((tmp_path / f"chat-{rate}qps.json").read_text())
        assert saved["completed"] == 4 and saved["backend"] == "openai-chat"
        assert "ttfts" not in saved  # only with --save-detailed
    assert plot.stat().st_size > 1000


def test_bench_bad_flags_exit_2(serve_tiny: ServerProcess) -> None:
    result = run_bench(serve_tiny, "--goodput", "latency:5")
    assert result.returncode == 2 and "--goodput" in result.stderr


# ------------------------------------------------------------ pure pieces


def _args(**overrides: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_parse_rates_and_goodput() -> None:
    assert bench.parse_rates("1, 2.5,inf") == [1.0, 2.5, float("inf")]
    with pytest.raises(ValueError, match="request-rate"):
        bench.parse_rates("0")
    assert bench.parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="goodput"):
        bench.parse_goodput(["itl:5"])


def test_sse_split_keeps_unicode_line_breaks() -> None:
    class Fake:
        async def aiter_bytes(self) -> Any:
            payload = 'data: {"t": "a\u2028b"}\n\ndata: [DO'.encode()
            yield payload
            yield b"NE]\n\n"

    async def collect() -> list[str]:
        return [data async for data in bench.sse_data(Fake())]

    assert asyncio.run(collect()) == ['{"t": "a\u2028b"}', "[DONE]"]


def test_compute_metrics_names_and_goodput() -> None:
    fast = bench.RequestResult(success=True, prompt_len=10, output_len=5, ttft=0.1,
                               itl=[0.01] * 4, latency=0.14, start_s=0.0,
                               chunk_times=[0.1, 0.11, 0.12, 0.13, 0.14])
    slow = bench.RequestResult(success=True, prompt_len=10, output_len=3, ttft=2.0,
                               itl=[0.5, 0.5], latency=3.0, start_s=0.05,
                               chunk_times=[2.05, 2.55, 3.05])
    failed = bench.RequestResult(error="HTTP 503: busy", start_s=0.2, latency=0.01)
    summary = bench.compute_metrics([fast, slow, failed], 4.0,
                                    _args(goodput=["ttft:500"], metric_percentiles="50,99"))
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 8
    assert summary["request_goodput"] == pytest.approx(1 / 4.0)
    assert summary["mean_ttft_ms"] == pytest.approx(1050.0)
    assert summary["median_tpot_ms"] == pytest.approx((10.0 + 500.0) / 2)
    assert summary["max_concurrent_requests"] == 2
    assert {"p50_itl_ms", "p99_e2el_ms", "std_ttft_ms"} <= set(summary)


def test_random_dataset_lengths() -> None:
    args = _args(num_prompts=50, random_input_len=20, random_output_len=10,
                 random_range_ratio=0.5, seed=3)
    requests = bench.random_requests(args, tokens_per_word=2.0)
    assert len(requests) == 50
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in requests)
    assert all(len(r.prompt.split()) == max(1, round(r.prompt_len / 2.0)) for r in requests)
    assert requests == bench.random_requests(args, tokens_per_word=2.0)  # seeded


def test_workload_datasets_are_the_offline_workloads() -> None:
    """--dataset-name w2 sends the requests `bench throughput --workload w2` runs."""
    from kvserve.bench.workloads import w2

    args = _args(dataset_name="w2", num_prompts=5, workload_vocab_size=1000, backend="openai")
    requests = bench.workload_requests(args)
    assert [(r.prompt, r.output_len) for r in requests] == [
        (r.prompt_token_ids, r.output_len) for r in w2(1000, num_requests=5)]
    with pytest.raises(ValueError, match="--backend openai"):
        bench._check_args(_args(dataset_name="w3", backend="openai-chat"))


def _stream(output_len: int, chunk_times: list[float], success: bool = True
            ) -> bench.RequestResult:
    return bench.RequestResult(success=success, output_len=output_len, chunk_times=chunk_times,
                               start_s=0.0, latency=chunk_times[-1])


def test_peak_is_the_busiest_one_second_window_in_tokens() -> None:
    peak = bench.peak_output_tokens_per_s
    # 10 chunks a second of 2 tokens each for 3 s: the peak is the mean, 20 tok/s
    steady = _stream(60, [i / 10 for i in range(30)])
    assert peak([steady], 3.0) == pytest.approx(20.0)
    summary = bench.compute_metrics([steady], 3.0, _args())
    assert summary["max_output_tokens_per_s"] >= summary["output_throughput"]
    # 30 tokens within half a second, then quiet: the window holds them all
    burst = _stream(30, [i / 60 for i in range(30)])
    assert peak([burst], 3.0) == pytest.approx(30.0)
    # the window slides: 10 tokens at 0.6-0.9 s and 10 at 1.1-1.4 s are one window
    split = _stream(20, [0.6, 0.7, 0.8, 0.9, 1.1, 1.2, 1.3, 1.4])
    assert peak([split], 2.0) == pytest.approx(20.0)
    # a run shorter than a second: its tokens over its duration; failures count nothing
    assert peak([_stream(8, [0.1, 0.2])], 0.5) == pytest.approx(16.0)
    assert peak([_stream(8, [0.1, 0.2], success=False)], 0.5) == 0.0
