"""Disaggregated prefill / decode against two colocated replicas, on 2 GPUs
(issue 24's disaggregation targets).

    PYTHONPATH=. python benchmarks/disagg.py --output-json disagg.json

Two setups serve the same seeded workload at the same Poisson request rate:

- ``colocated``: ``kvserve serve --data-parallel-size 2`` (two replicas,
  GPUs 0 and 1, behind the router with ``--router-policy least_load``);
- ``disagg``: ``kvserve serve --kv-role prefill`` on GPU 0, ``kvserve serve
  --kv-role decode`` on GPU 1, and ``kvserve router --prefill --decode``.

The workload (``/v1/completions``, token-id prompts, ``ignore_eos``) is short
chats (``--short-len`` prompt tokens) with a share ``--long-fraction`` of
``--long-len``-token prompts (8,192 by default) among them, each generating
``--output-len`` tokens, streamed. Figures per setup: TPOT p50 / p99 (each
request's mean time per output token after its first), TTFT p50 / p99,
output tokens per second over the run, and for ``disagg`` the KV transfer
bandwidth (bytes received / receive seconds, from the decode engine's
``/metrics``) and requests that fell back to recomputing. Then, with the
servers gone, a plain NCCL send / recv between GPUs 0 and 1 of the same
bytes in the same chunks (64 MiB at most, as the transfer sends them)
gives the bandwidth to compare with (each process seeing only its own GPU,
as the engines do; the figure with both GPUs visible is reported too). The
targets: TPOT p99 disagg / colocated <= 0.5, output throughput ratio >= 0.9,
transfer bandwidth >= 50% of the plain send / recv. JSON to
``--output-json``; a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.workloads import MIN_TOKEN_ID
from kvserve.models.source import resolve_model_config

START_TIMEOUT_S = 900.0
CHUNK_MAX_BYTES = 64 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b", help="preset (random weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--long-len", type=int, default=8192)
    parser.add_argument("--short-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=8192 + 512)
    parser.add_argument("--port", type=int, default=8041, help="the router's; servers take the "
                                                               "next ones")
    parser.add_argument("--kv-transfer-port", type=int, default=14579)
    parser.add_argument("--setups", nargs="+", default=["disagg", "colocated"])
    parser.add_argument("--serve-args", default="", help="extra flags for every kvserve serve")
    parser.add_argument("--log-dir", default="disagg_logs")
    parser.add_argument("--output-json", default="disagg.json")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[float, list[int]]]:
    """(arrival offset in seconds, prompt) per request, seeded."""
    rng = random.Random(args.seed)
    requests, now = [], 0.0
    for _ in range(args.num_requests):
        now += rng.expovariate(args.rate)
        length = args.long_len if rng.random() < args.long_fraction else args.short_len
        requests.append((now, [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(length)]))
    return requests


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> dict[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = -1.0
    num_tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if '"error"' in line:
                raise RuntimeError(line[:300])
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                last = time.perf_counter()
                if first < 0:
                    first = last
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return {"ttft_s": first - start, "tpot_s": tpot, "num_tokens": num_tokens,
            "prompt_len": len(prompt)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def run_load(args: argparse.Namespace, url: str, requests: list[tuple[float, list[int]]]
                   ) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        start = time.perf_counter()

        async def fire(offset: float, prompt: list[int]) -> dict[str, float]:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await one_request(client, url, args.model, prompt, args.output_len)

        results = await asyncio.gather(*(fire(t, p) for t, p in requests))
        wall = time.perf_counter() - start
    tpots = [r["tpot_s"] for r in results if r["num_tokens"] > 1]
    ttfts = [r["ttft_s"] for r in results]
    return {"num_requests": len(results), "wall_s": wall,
            "output_tokens_per_s": sum(r["num_tokens"] for r in results) / wall,
            "tpot_p50_ms": 1e3 * percentile(tpots, 0.5),
            "tpot_p99_ms": 1e3 * percentile(tpots, 0.99),
            "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99)}


def launch(command: list[str], log_path: Path, gpu: str | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "kvserve.cli", *command], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)


def wait_ready(url: str, processes: list[subprocess.Popen[bytes]], healthy: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a server exited during start-up; see the logs")
        try:
            answer = httpx.get(url + "/ready", timeout=2)
            if answer.status_code == 200 and answer.json().get("healthy_backends", 1) >= healthy:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} was not ready in {START_TIMEOUT_S:.0f} s")


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def serve_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--load-format", "dummy", "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--disable-access-log",
            "--uvicorn-log-level", "warning", *args.serve_args.split()]


def start_setup(args: argparse.Namespace, setup: str, log_dir: Path
                ) -> tuple[list[subprocess.Popen[bytes]], str | None]:
    """The processes of a setup, ready; the decode engine's URL for ``disagg``."""
    router = f"http://127.0.0.1:{args.port}"
    if setup == "colocated":
        process = launch(["serve", *serve_flags(args), "--port", str(args.port),
                          "--data-parallel-size", "2", "--router-policy", "least_load"],
                         log_dir / "colocated.log")
        wait_ready(router, [process], 2)
        return [process], None
    prefill_url, decode_url = (f"http://127.0.0.1:{args.port + i}" for i in (1, 2))
    prefill = launch(["serve", *serve_flags(args), "--port", str(args.port + 1),
                      "--kv-role", "prefill", "--kv-transfer-port", str(args.kv_transfer_port)],
                     log_dir / "prefill.log", gpu="0")
    decode = launch(["serve", *serve_flags(args), "--port", str(args.port + 2),
                     "--kv-role", "decode"], log_dir / "decode.log", gpu="1")
    processes = [prefill, decode]
    for url in (prefill_url, decode_url):
        wait_ready(url, processes, 1)
    processes.append(launch(["router", "--port", str(args.port), "--prefill", prefill_url,
                             "--decode", decode_url, "--uvicorn-log-level", "warning",
                             "--disable-access-log"], log_dir / "router.log"))
    wait_ready(router, processes, 1)
    return processes, decode_url


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def nccl_send_recv(num_bytes: int, chunk_bytes: int, isolated: bool) -> float:
    """GB/s of a plain NCCL send / recv of ``num_bytes`` from GPU 0 to GPU 1, in
    chunks of ``chunk_bytes`` (best of three, after a warm-up). ``isolated``:
    each process sees only its own GPU (CUDA_VISIBLE_DEVICES), as the two
    engines do, so NCCL picks the transport it picks for them."""
    code = f"""
import os, time, torch, torch.distributed as dist
rank = int(os.environ["RANK"]); torch.cuda.set_device(0 if {isolated} else rank)
dist.init_process_group("nccl", rank=rank, world_size=2)
chunk = torch.empty({chunk_bytes}, dtype=torch.uint8, device="cuda")
n = max(1, {num_bytes} // {chunk_bytes})
def run():
    for _ in range(n):
        dist.send(chunk, 1) if rank == 0 else dist.recv(chunk, 0)
    torch.cuda.synchronize()
run(); best = 1e9
for _ in range(3):
    dist.barrier(); torch.cuda.synchronize(); start = time.perf_counter(); run()
    best = min(best, time.perf_counter() - start)
if rank == 1: print("GBPS", n * {chunk_bytes} / best / 1e9)
dist.destroy_process_group()
"""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "WORLD_SIZE": "2"}
    visible = [{"CUDA_VISIBLE_DEVICES": str(r)} if isolated else {} for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code],
                              env={**env, **visible[r], "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    line = next(line for line in outs[1].splitlines() if line.startswith("GBPS"))
    return float(line.split()[1])


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> int:
    args = parse_args()
    config, _ = resolve_model_config(args.model, weights=False)
    requests = workload(args, config.vocab_size)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"model": args.model, "args": vars(args), "setups": {}}
    for setup in args.setups:
        processes, decode_url = start_setup(args, setup, log_dir)
        try:
            figures = asyncio.run(run_load(args, f"http://127.0.0.1:{args.port}", requests))
            if decode_url is not None:
                received = metric(decode_url, "kvserve:kv_transfer_bytes_received_total")
                seconds = metric(decode_url, "kvserve:kv_transfer_receive_s_total")
                figures.update(
                    kv_bytes_received=received, kv_receive_s=seconds,
                    kv_transfer_gbps=received / seconds / 1e9 if seconds else 0.0,
                    recomputed=metric(decode_url, "kvserve:kv_transfer_recomputed_requests_total"),
                    pulled=metric(decode_url, "kvserve:kv_transfer_pulled_requests_total"))
        finally:
            stop(processes)
        results["setups"][setup] = figures
        print(setup, json.dumps(figures), flush=True)
    disagg, colocated = results["setups"].get("disagg"), results["setups"].get("colocated")
    if disagg and disagg.get("kv_bytes_received") and _num_gpus() >= 2:
        per_pull = disagg["kv_bytes_received"] / max(disagg["pulled"], 1)
        chunk = min(CHUNK_MAX_BYTES, int(per_pull))
        # the baseline: the same process layout as the engines (one GPU visible each)
        disagg["nccl_send_recv_gbps"] = nccl_send_recv(int(per_pull), chunk, isolated=True)
        disagg["nccl_send_recv_all_visible_gbps"] = nccl_send_recv(int(per_pull), chunk,
                                                                   isolated=False)
        disagg["kv_transfer_vs_nccl"] = disagg["kv_transfer_gbps"] / disagg["nccl_send_recv_gbps"]
    if disagg and colocated:
        results["ratios"] = {
            "tpot_p99_disagg_over_colocated": disagg["tpot_p99_ms"] / colocated["tpot_p99_ms"],
            "throughput_disagg_over_colocated": (disagg["output_tokens_per_s"]
                                                 / colocated["output_tokens_per_s"]),
            "kv_transfer_vs_nccl": disagg.get("kv_transfer_vs_nccl", 0.0)}
    Path(args.output_json).write_text(json.dumps(results, indent=2))
    print(f"\n{'setup':<10} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'out tok/s':>10} {'KV GB/s':>8} {'NCCL GB/s':>9}")
    for setup, f in results["setups"].items():
        print(f"{setup:<10} {f['tpot_p50_ms']:>9.1f} {f['tpot_p99_ms']:>9.1f} "
              f"{f['ttft_p50_ms']:>9.0f} {f['ttft_p99_ms']:>9.0f} "
              f"{f['output_tokens_per_s']:>10.0f} {f.get('kv_transfer_gbps', 0):>8.1f} "
              f"{f.get('nccl_send_recv_gbps', 0):>9.1f}")
    for name, value in results.get("ratios", {}).items():
        print(f"{name}: {value:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
