"""``kvserve bench latency``: one batch of fixed-length requests, timed again and again.

Each iteration sends ``--batch-size`` fresh prompts of ``--input-len`` random
tokens (workload W1, ``kvserve/bench/workloads.py``; fresh, so the prefix
cache never hits) through ``LLM.generate`` with ``--output-len`` new tokens
each (``ignore_eos``, greedy), and records:

- TTFT: the slowest request's arrival-to-first-token time, i.e. the prefill
  of the whole batch;
- TPOT: the requests' mean time per output token after the first;
- E2E: the wall time of the ``generate`` call.

Reported over the measured iterations (after ``--num-iters-warmup``): mean,
median, p50/p90/p99 of each; decode tok/s = batch / mean TPOT; output tok/s
= batch x output / mean E2E (prefill included); MBU = bytes one decode step
must read (every weight but the embedding table, plus the batch's KV at the
mean decode context, input + output / 2) x steps/s, over the copy rate
measured first in the same process and over the card's spec-sheet bandwidth
when ``kvserve/plan/gpus.py`` knows the card; prefill MFU = 2 x parameters x
batch x input / mean TTFT over the measured matmul rate (in the engine's
dtype). W6 is ``--input-len 2048 --output-len 1`` (TTFT only: no TPOT,
decode rate or MBU). ``--num-loras N --lora-rank R`` runs request ``i`` of
each batch with the ``i % N``-th of N random adapters (``bench/lora.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvserve.bench import lora
from kvserve.bench.offline import (
    OfflineBench,
    check_fits,
    mean_decode_context,
    resolve_engine,
    start,
)
from kvserve.bench.report import latency_stats_ms, print_table, write_json
from kvserve.bench.workloads import w1
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.lora.request import LoRARequest

PERCENTILES = [50.0, 90.0, 99.0]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvserve bench latency``: the engine's, then the workload's."""
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=256, help="new tokens per request")
    group.add_argument("--batch-size", type=int, default=1, help="requests per iteration")
    group.add_argument("--num-iters", type=int, default=5, help="measured iterations")
    group.add_argument("--num-iters-warmup", type=int, default=1,
                       help="iterations run first and not measured")
    group.add_argument("--output-json", default=None, help="write every figure here")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    lora.add_cli_args(parser)


def _check_args(args: argparse.Namespace) -> None:
    for flag, value, low in (("--input-len", args.input_len, 1),
                             ("--output-len", args.output_len, 1),
                             ("--batch-size", args.batch_size, 1),
                             ("--num-iters", args.num_iters, 1),
                             ("--num-iters-warmup", args.num_iters_warmup, 0)):
        if value < low:
            raise ValueError(f"{flag}={value} is invalid: must be >= {low}")
    lora.check_args(args)


def _iteration(bench: OfflineBench, args: argparse.Namespace, seed: int,
               loras: list[LoRARequest]) -> dict[str, Any]:
    requests = w1(bench.vocab_size, args.input_len, args.output_len, args.batch_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start_s = time.perf_counter()
    outputs = bench.llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False,
                                 lora_request=lora.round_robin(loras, len(requests)))
    e2e_s = time.perf_counter() - start_s
    tpots = [o.tpot_s for o in outputs if o.tpot_s is not None]
    return {"ttft_s": max(o.metrics.ttft_s or 0.0 for o in outputs),
            "tpot_s": statistics.mean(tpots) if tpots else None, "e2e_s": e2e_s}


def _stats(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    """Percentile stats, every key None when there are no values (TPOT of W6)."""
    stats = latency_stats_ms(prefix, values_s, PERCENTILES)
    return {key: value if values_s else None for key, value in stats.items()}


def summarize(bench: OfflineBench, args: argparse.Namespace,
              iterations: list[dict[str, Any]]) -> dict[str, Any]:
    """Every figure of the run from its measured iterations."""
    ttfts = [it["ttft_s"] for it in iterations]
    tpots = [it["tpot_s"] for it in iterations if it["tpot_s"] is not None]
    e2es = [it["e2e_s"] for it in iterations]
    batch, figures, rates = args.batch_size, bench.figures, bench.rates
    mean_context = mean_decode_context(args.input_len, args.output_len)
    decode_tok_s = batch / statistics.mean(tpots) if tpots else None

    def mbu(bandwidth_gb_s: float | None) -> float | None:
        if decode_tok_s is None or bandwidth_gb_s is None:
            return None
        return figures.mbu(batch, mean_context, decode_tok_s, bandwidth_gb_s)

    return {
        "input_len": args.input_len, "output_len": args.output_len, "batch_size": batch,
        "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
        **_stats("ttft", ttfts), **_stats("tpot", tpots), **_stats("e2e", e2es),
        "decode_tok_s": decode_tok_s,
        "output_tok_s": batch * args.output_len / statistics.mean(e2es),
        "mean_context": mean_context,
        "decode_step_bytes": figures.decode_step_bytes(batch, mean_context),
        "mbu_vs_copy": mbu(rates.copy_gb_s),
        "mbu_vs_spec": mbu(rates.spec_bandwidth_gb_s),
        "prefill_mfu": figures.mfu(batch * args.input_len / statistics.mean(ttfts),
                                   rates.matmul_tflop_s),
        "iterations": iterations,
    }


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _ms(result: dict[str, Any], prefix: str) -> str:
    if result[f"mean_{prefix}_ms"] is None:
        return "—"
    return " / ".join(f"{result[f'{stat}_{prefix}_ms']:.2f}"
                      for stat in ("mean", "p50", "p90", "p99")) + " ms"


def print_result(result: dict[str, Any]) -> None:
    decode = result["decode_tok_s"]
    print_table(f"kvserve bench latency: {result['model']}", [
        ("card", f"{result['card']} ({result['dtype']})"),
        ("copy / matmul", f"{result['copy_gb_s']:,.0f} GB/s / "
                          f"{result['matmul_tflop_s']:,.1f} TFLOP/s ({result['matmul_dtype']})"),
        ("workload", f"batch {result['batch_size']}, prompt {result['input_len']}, "
                     f"{result['output_len']} new, {result['num_iters']} iterations"),
        ("TTFT mean / p50 / p90 / p99", _ms(result, "ttft")),
        ("TPOT mean / p50 / p90 / p99", _ms(result, "tpot")),
        ("E2E mean / p50 / p90 / p99", _ms(result, "e2e")),
        ("decode tok/s", "—" if decode is None else f"{decode:,.1f}"),
        ("output tok/s (incl. prefill)", f"{result['output_tok_s']:,.1f}"),
        ("MBU of copy / of spec sheet",
         f"{_percent(result['mbu_vs_copy'])} / {_percent(result['mbu_vs_spec'])}"),
        ("prefill MFU", _percent(result["prefill_mfu"])),
    ])


def run(args: argparse.Namespace) -> int:
    """``kvserve bench latency``."""
    from tqdm import tqdm

    _check_args(args)
    engine_args, config = resolve_engine(args)
    check_fits(config, args.input_len + args.output_len, "--input-len + --output-len")
    if args.batch_size > config.scheduler_config.max_num_seqs:
        raise ValueError(f"--batch-size={args.batch_size} is invalid: more than "
                         f"--max-num-seqs={config.scheduler_config.max_num_seqs}")
    iterations = []
    total = args.num_iters_warmup + args.num_iters
    with lora.random_adapters(args, config.model_config) as loras:
        bench = start(engine_args, config)
        for adapter in loras:  # read before the clock starts
            bench.llm.engine.add_lora(adapter)
        for i in tqdm(range(total), desc="iterations", disable=args.disable_tqdm):
            iteration = _iteration(bench, args, seed=i, loras=loras)
            if i >= args.num_iters_warmup:
                iterations.append(iteration)
    result = bench.result("latency", {**lora.describe(args),
                                      **summarize(bench, args, iterations)})
    print_result(result)
    write_json(args.output_json, result)
    return 0
