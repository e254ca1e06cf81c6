"""Router benchmark: two replicas behind ``kvserve serve --data-parallel-size 2``,
prefix-aware routing against round-robin (issue 24's router targets).

    PYTHONPATH=. python benchmarks/router_w5.py --output-json router_w5.json

For each policy (``--policies``, default ``prefix round_robin``) it starts
``kvserve serve --data-parallel-size 2 --router-policy POLICY`` on the preset
(random weights; replicas on GPUs 0 and 1), waits for it, then runs:

- W5-style multi-turn: ``--num-conversations`` conversations, all at once,
  each ``--num-turns`` turns in sequence. Turn k's prompt is the shared
  ``--system-len``-token system prompt, the conversation's own
  ``--history-len``-token history, then for each earlier turn its user
  message (``--user-len`` tokens) and a reply (``--output-len`` pre-drawn
  tokens standing in for the model's answer, so prompts are the same
  whatever the weights), then this turn's user message; each turn generates
  ``--output-len`` tokens (``ignore_eos``). Figures: TTFT p50 / p99 (streamed
  requests), wall time, and the prefix-cache hit rate (hits / queries summed
  over both replicas' ``/metrics``, before and after).
- W2 throughput (``--w2-prompts`` requests of W2, all submitted at once):
  output tokens per second.

Prompts are token-id lists (``/v1/completions``), so no tokenizer is needed.
The JSON holds each policy's figures and the ratios the targets ask for:
hit rate prefix / round_robin (target >= 1.8), TTFT p50 round_robin / prefix
(target >= 2) and W2 throughput prefix / round_robin (target >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.workloads import MIN_TOKEN_ID, w2
from kvserve.models.source import resolve_model_config

START_TIMEOUT_S = 900.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b", help="preset (random weights)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policies", nargs="+", default=["prefix", "round_robin"],
                        help="router policies to compare (the first is the candidate)")
    parser.add_argument("--num-conversations", type=int, default=64)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--history-len", type=int, default=2048,
                        help="tokens of each conversation's own history before turn 1")
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--w2-prompts", type=int, default=1000)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--serve-args", default="",
                        help="extra flags for kvserve serve (one string)")
    parser.add_argument("--log-dir", default="router_w5_logs")
    parser.add_argument("--output-json", default="router_w5.json")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def conversations(args: argparse.Namespace, vocab_size: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn."""
    rng = random.Random(args.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]

    system = draw(args.system_len)
    result = []
    for _ in range(args.num_conversations):
        context = system + draw(args.history_len)
        turns = []
        for _ in range(args.num_turns):
            context = context + draw(args.user_len)
            turns.append(context)
            context = context + draw(args.output_len)
        result.append(turns)
    return result


async def stream_ttft(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> tuple[float, int]:
    """TTFT of one streamed completion and its number of output chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft, chunks = -1.0, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                if '"error"' in line:
                    raise RuntimeError(line[:300])
                chunks += 1
                if ttft < 0:
                    ttft = time.perf_counter() - start
    return ttft, chunks


async def prefix_counters(client: httpx.AsyncClient, router: str) -> tuple[float, float]:
    """Prefix-cache (queries, hits) summed over the router's backends."""
    text = (await client.get(router + "/metrics")).text
    backends = [line.split('backend="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                if line.startswith("kvserve:router_backend_healthy{")]
    queries = hits = 0.0
    for backend in backends:
        for line in (await client.get(backend + "/metrics")).text.splitlines():
            if line.startswith("kvserve:prefix_cache_queries_total{"):
                queries += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvserve:prefix_cache_hits_total{"):
                hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def requests_per_backend(client: httpx.AsyncClient, router: str) -> list[float]:
    text = (await client.get(router + "/metrics")).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvserve:router_requests_total{")]


async def run_w5(args: argparse.Namespace, url: str, vocab_size: int) -> dict[str, Any]:
    convs = conversations(args, vocab_size)
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as c:
        queries0, hits0 = await prefix_counters(c, url)

        async def converse(turns: list[list[int]]) -> None:
            for prompt in turns:
                ttft, _ = await stream_ttft(c, url, args.model, prompt, args.output_len)
                ttfts.append(ttft)

        start = time.perf_counter()
        await asyncio.gather(*(converse(turns) for turns in convs))
        wall_s = time.perf_counter() - start
        queries1, hits1 = await prefix_counters(c, url)
        per_backend = await requests_per_backend(c, url)
    ttfts.sort()
    return {"requests": len(ttfts), "wall_s": wall_s,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "prefix_hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1.0),
            "requests_per_backend": per_backend}


async def run_w2(args: argparse.Namespace, url: str, vocab_size: int) -> dict[str, Any]:
    requests = w2(vocab_size, num_requests=args.w2_prompts, seed=args.seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as c:

        async def one(prompt: list[int], output_len: int) -> int:
            body = {"model": args.model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0.0, "ignore_eos": True}
            response = await c.post(url + "/v1/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(r.prompt_token_ids, r.output_len)
                                         for r in requests))
        wall_s = time.perf_counter() - start
    return {"requests": len(outputs), "wall_s": wall_s,
            "output_tokens_per_s": sum(outputs) / wall_s}


def start_server(args: argparse.Namespace, policy: str, log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", args.model,
               "--load-format", "dummy", "--dtype", args.dtype,
               "--max-model-len", str(args.max_model_len), "--port", str(args.port),
               "--data-parallel-size", "2", "--router-policy", policy,
               "--disable-access-log",
               "--uvicorn-log-level", "warning", *args.serve_args.split()]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=dict(os.environ))
    deadline = time.monotonic() + START_TIMEOUT_S
    url = f"http://127.0.0.1:{args.port}"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvserve serve exited; see {log_path}")
        try:
            if httpx.get(url + "/ready", timeout=2).json().get("healthy_backends") == 2:
                return process
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    raise RuntimeError(f"kvserve serve was not ready in {START_TIMEOUT_S:.0f} s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def main() -> int:
    args = parse_args()
    config, _ = resolve_model_config(args.model, weights=False)
    vocab_size = config.vocab_size
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    results: dict[str, Any] = {"model": args.model, "args": vars(args), "policies": {}}
    for policy in args.policies:
        if not port_is_free(args.port):
            raise RuntimeError(f"port {args.port} is taken")
        process = start_server(args, policy, log_dir / f"serve_{policy}.log")
        try:
            w5_result = asyncio.run(run_w5(args, url, vocab_size))
            w2_result = (asyncio.run(run_w2(args, url, vocab_size)) if args.w2_prompts
                         else {"output_tokens_per_s": 0.0})
        finally:
            stop_server(process)
        results["policies"][policy] = {"w5": w5_result, "w2": w2_result}
        print(policy, json.dumps(results["policies"][policy]), flush=True)
    if len(args.policies) >= 2:
        new, base = (results["policies"][p] for p in args.policies[:2])
        results["ratios"] = {
            "w5_hit_rate": new["w5"]["prefix_hit_rate"] / max(base["w5"]["prefix_hit_rate"],
                                                              1e-9),
            "w5_ttft_p50_speedup": base["w5"]["ttft_p50_s"] / new["w5"]["ttft_p50_s"],
            "w2_throughput": (new["w2"]["output_tokens_per_s"]
                              / max(base["w2"]["output_tokens_per_s"], 1e-9)),
        }
        print("ratios", json.dumps(results["ratios"]), flush=True)
    Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
