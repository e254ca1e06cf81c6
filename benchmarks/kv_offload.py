"""The host KV tier, measured (issue 25): one command, JSON per part under
``--out``, one markdown table last. The llama-3-8b preset (``--load-format
dummy``, bf16) with a KV pool of ``--num-gpu-blocks`` blocks of 16 tokens,
so the working set outgrows the GPU at a size that runs in minutes.

- ``multiturn``: ``--conversations`` conversations, each with its own
  ``--prefix-len``-token history (together about 4x the pool: 32 x 4,096 =
  131k tokens against 2,048 blocks = 32k), asked ``--turns`` times in a
  cycle, one request at a time (a new 32-token question, 8 tokens out), so
  each history returns after the GPU tier evicted it. TTFT p50 of turns
  after the first with the tier off and on (target: >= 3x lower with it),
  the greedy tokens compared with a pool holding every history (GPU hits:
  the same computation, so identical), and the copies' host-to-device bandwidth
  (bytes / device time of the copies in) against a plain pinned-to-device
  copy of the same size in the same process (target: >= 70%).
- ``w2``: ``kvserve bench throughput --workload w2`` with the tier off and
  on (``--w2-offload-gb``), each in its own process, default KV pool (no
  reuse in W2: target within 3%).
- ``preemption``: ``--preempt-requests`` requests of ``--preempt-len``
  (512) prompt and as many output tokens at once in a pool of ``--preempt-blocks`` blocks (forcing
  preemption): recompute with the tier off, recompute with it on, swap;
  elapsed time, preemptions, and greedy tokens identical in every mode.

    PYTHONPATH=. python benchmarks/kv_offload.py --out $OUT/kv-offload
    PYTHONPATH=. python benchmarks/kv_offload.py --out $OUT/kv-offload --parts multiturn

A CPU smoke run of the logic (a small checkpoint, tiny sizes): ``--model DIR
--load-format auto --dtype float32 --num-gpu-blocks 64 --conversations 4
--prefix-len 96 --preempt-requests 8 --preempt-blocks 48 --preempt-len 128
--offload-gb 0.01 --parts multiturn,preemption``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.report import run_parts

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama-3-8b"
BLOCK_SIZE = 16


def log(message: str) -> None:
    print(f"[kv_offload] {message}", flush=True)


def make_llm(args: argparse.Namespace, **options: Any) -> Any:
    from kvserve import LLM

    return LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
               block_size=BLOCK_SIZE, max_model_len=args.max_model_len, **options)


def release(llm: Any) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pinned_copy_gb_s(num_bytes: int, iters: int = 5) -> float:
    """A plain pinned host -> device copy of ``num_bytes``: GB/s, best of ``iters``."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return num_bytes / best / 1e9


# --------------------------------------------------------------------------- multiturn


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per turn, per conversation: history + a new question (random token ids)."""
    rng = random.Random(0)
    histories = [[rng.randrange(100, 8000) for _ in range(args.prefix_len)]
                 for _ in range(args.conversations)]
    return [[history + [rng.randrange(100, 8000) for _ in range(32)] for history in histories]
            for _ in range(args.turns)]


def run_turns(llm: Any, turns: list[list[list[int]]]) -> dict[str, Any]:
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ttfts: list[float] = []
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for turn, prompts in enumerate(turns):
        for prompt in prompts:
            [output] = llm.generate([prompt], params, use_tqdm=False)
            tokens.append(output.outputs[0].token_ids)
            if turn:  # the first turn is cold either way
                ttfts.append(output.metrics.ttft_s)
    return {"ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_p90_ms": statistics.quantiles(ttfts, n=10)[-1] * 1e3,
            "elapsed_s": time.perf_counter() - start, "tokens": tokens}


def multiturn_part(args: argparse.Namespace) -> dict[str, Any]:
    """Tier off and on in the small pool, and off in a pool that holds every
    history (each return a GPU hit: the same computation as a host hit, so
    the tier's tokens must equal its tokens exactly)."""
    turns = conversations(args)
    roomy_blocks = args.conversations * (args.prefix_len + 64) // BLOCK_SIZE + 64
    results: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name, blocks, gb in (("off", args.num_gpu_blocks, 0.0),
                             ("on", args.num_gpu_blocks, args.offload_gb),
                             ("roomy", roomy_blocks, 0.0)):
        llm = make_llm(args, num_kv_blocks=blocks, kv_offload_gb=gb, max_num_seqs=8)
        log(f"multiturn, {name}: {args.conversations} x {args.prefix_len} tokens, "
            f"{args.turns} turns, pool {blocks} blocks, tier {gb} GB")
        run = run_turns(llm, turns)
        tokens[name] = run.pop("tokens")
        run["stats"] = {k: v for k, v in llm.stats().items() if k.startswith(("kv_", "prefix"))}
        release(llm)
        results[name] = run
    on = results["on"]["stats"]
    copy_s = on.get("kv_host_copy_to_device_s", 0.0)
    moved = on.get("kv_host_bytes_to_device", 0)
    results["h2d_gb_s"] = moved / copy_s / 1e9 if copy_s else 0.0
    # a plain copy of one returning history's bytes
    per_return = max(moved // max(1, args.conversations * (args.turns - 1)), 1 << 20)
    results["pinned_gb_s"] = pinned_copy_gb_s(per_return) if torch.cuda.is_available() else 0.0
    results["h2d_share"] = results["h2d_gb_s"] / (results["pinned_gb_s"] or float("inf"))
    results["ttft_ratio"] = results["off"]["ttft_p50_ms"] / results["on"]["ttft_p50_ms"]
    results["same_tokens_as_gpu_hits"] = tokens["on"] == tokens["roomy"]
    # recomputed histories (off) may round differently in bf16 from cached ones
    results["same_tokens_as_recompute"] = tokens["on"] == tokens["off"]
    return results


# --------------------------------------------------------------------------- w2


def w2_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, extra in (("off", []), ("on", ["--kv-offload-gb", str(args.w2_offload_gb)])):
        path = out / f"w2_{name}.json"
        command = [sys.executable, "-m", "kvserve.cli", "bench", "throughput", "--model",
                   args.model, "--load-format", args.load_format, "--dtype", args.dtype,
                   "--workload", "w2",
                   "--disable-tqdm", "--output-json", str(path), *extra]
        log(f"w2 {name}: {' '.join(command)}")
        subprocess.run(command, check=True, cwd=REPO)
        results[name] = json.loads(path.read_text())
    results["ratio"] = results["on"]["output_tok_s"] / results["off"]["output_tok_s"]
    return results


# --------------------------------------------------------------------------- preemption


def preemption_part(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 8000) for _ in range(args.preempt_len)]
               for _ in range(args.preempt_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.preempt_len, ignore_eos=True)
    modes = (("recompute", 0.0, "recompute"), ("recompute+tier", args.offload_gb, "recompute"),
             ("swap", args.offload_gb, "swap"))
    results: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name, gb, mode in modes:
        llm = make_llm(args, num_kv_blocks=args.preempt_blocks, kv_offload_gb=gb,
                       preemption_mode=mode, max_num_seqs=args.preempt_requests)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        log(f"preemption, {name}: {args.preempt_requests} requests, "
            f"{args.preempt_blocks} blocks")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
        stats = llm.stats()
        results[name] = {"elapsed_s": elapsed, "num_preemptions": stats["num_preemptions"],
                         **{k: v for k, v in stats.items() if k.startswith("kv_host")}}
        release(llm)
    results["same_tokens"] = all(t == tokens["recompute"] for t in tokens.values())
    return results


# --------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    lines = ["| part | off | on | ratio | target |", "|---|---:|---:|---:|---|"]
    if "multiturn" in results:
        m = results["multiturn"]
        lines.append(f"| multi-turn TTFT p50 (ms) | {m['off']['ttft_p50_ms']:.1f} | "
                     f"{m['on']['ttft_p50_ms']:.1f} | {m['ttft_ratio']:.2f}x | >= 3x"
                     f"{'' if m['same_tokens_as_gpu_hits'] else ', TOKENS DIFFER'} |")
        lines.append(f"| H2D copy GB/s (tier / plain pinned) | {m['pinned_gb_s']:.1f} | "
                     f"{m['h2d_gb_s']:.1f} | {m['h2d_share']:.2f} | >= 0.70 |")
    if "w2" in results:
        w = results["w2"]
        lines.append(f"| W2 output tok/s | {w['off']['output_tok_s']:.0f} | "
                     f"{w['on']['output_tok_s']:.0f} | {w['ratio']:.3f} | >= 0.97 |")
    if "preemption" in results:
        p = results["preemption"]
        for name in ("recompute+tier", "swap"):
            lines.append(f"| preemption s (recompute / {name}) | {p['recompute']['elapsed_s']:.2f}"
                         f" | {p[name]['elapsed_s']:.2f} | "
                         f"{p['recompute']['elapsed_s'] / p[name]['elapsed_s']:.2f}x | "
                         f"reported{'' if p['same_tokens'] else ', TOKENS DIFFER'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the JSON files")
    parser.add_argument("--parts", default="multiturn,w2,preemption")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-gpu-blocks", type=int, default=2048,
                        help="KV pool of the multi-turn part, blocks of 16 tokens")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--offload-gb", type=float, default=32.0)
    parser.add_argument("--w2-offload-gb", type=float, default=32.0)
    parser.add_argument("--preempt-requests", type=int, default=64)
    parser.add_argument("--preempt-blocks", type=int, default=1024)
    parser.add_argument("--preempt-len", type=int, default=512, help="prompt and output tokens")
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args(argv)
    return run_parts(Path(args.out), args.parts, {
        "multiturn": lambda: multiturn_part(args),
        "w2": lambda: w2_part(args, Path(args.out)),
        "preemption": lambda: preemption_part(args)}, "host KV tier", table)


if __name__ == "__main__":
    raise SystemExit(main())
