"""``kvserve bench throughput``: a whole workload submitted at once, offline.

``--workload w2`` (default: 1,000 requests, prompt ~ U[128, 2048], output ~
U[128, 512]) or ``w3`` (512 x 1,000 in / 1,000 out) from
``kvserve/bench/workloads.py``; ``--num-prompts`` takes the first N
requests of it, ``--max-input-len`` / ``--max-output-len`` cut lengths for a
scaled-down run. Every request goes to one ``LLM.generate`` call (greedy,
``ignore_eos``) after one short warm-up request; reported: requests/s,
output tok/s, total (prompt + output) tok/s, elapsed seconds, and the compute
roofline share = total tok/s x 2 x parameters over the matmul rate measured
first in the same process (in the engine's dtype). ``--num-loras N
--lora-rank R`` runs the requests with N random adapters, round-robin
(``bench/lora.py``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvserve.bench import lora
from kvserve.bench.offline import OfflineBench, check_fits, resolve_engine, start
from kvserve.bench.report import print_table, write_json
from kvserve.bench.workloads import THROUGHPUT_WORKLOADS, BenchRequest, cap_lengths, w1
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.lora.request import LoRARequest

WARMUP_SEED = -1  # a prompt no workload request shares


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvserve bench throughput``: the engine's, then the workload's."""
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default="w2", choices=sorted(THROUGHPUT_WORKLOADS),
                       help="w2: 1,000 requests, prompts of 128 to 2,048 tokens, outputs of 128 "
                            "to 512; w3: 512 requests of 1,000 in and 1,000 out (default: w2)")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="the first N requests (default: the whole workload)")
    group.add_argument("--max-input-len", type=int, default=None, help="cut prompts to this")
    group.add_argument("--max-output-len", type=int, default=None, help="cut outputs to this")
    group.add_argument("--output-json", default=None, help="write every figure here")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    lora.add_cli_args(parser)


def _check_args(args: argparse.Namespace) -> None:
    for flag, value in (("--num-prompts", args.num_prompts),
                        ("--max-input-len", args.max_input_len),
                        ("--max-output-len", args.max_output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value} is invalid: must be >= 1")
    lora.check_args(args)


def _params(request: BenchRequest) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)


def measure(bench: OfflineBench, requests: list[BenchRequest], use_tqdm: bool,
            loras: list[LoRARequest] | None = None) -> dict[str, Any]:
    """Run every request in one ``generate`` call (request ``i`` with adapter
    ``loras[i % len(loras)]``, adapters read before the clock starts); the
    figures of that run."""
    [warmup] = w1(bench.vocab_size, input_len=16, output_len=4, seed=WARMUP_SEED)
    bench.llm.generate([warmup.prompt_token_ids], _params(warmup), use_tqdm=False,
                       lora_request=loras[0] if loras else None)
    for adapter in loras or ():
        bench.llm.engine.add_lora(adapter)
    prompts = [r.prompt_token_ids for r in requests]
    params = [_params(r) for r in requests]
    start_s = time.perf_counter()
    outputs = bench.llm.generate(prompts, params, use_tqdm=use_tqdm,
                                 lora_request=lora.round_robin(loras or [], len(prompts)))
    elapsed_s = time.perf_counter() - start_s
    num_input = sum(len(p) for p in prompts)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total_tok_s = (num_input + num_output) / elapsed_s
    return {"num_requests": len(prompts), "total_input_tokens": num_input,
            "total_output_tokens": num_output, "elapsed_s": elapsed_s,
            "requests_per_s": len(prompts) / elapsed_s, "output_tok_s": num_output / elapsed_s,
            "total_tok_s": total_tok_s,
            "compute_roofline_share": bench.figures.mfu(total_tok_s, bench.rates.matmul_tflop_s)}


def print_result(result: dict[str, Any]) -> None:
    print_table(f"kvserve bench throughput: {result['model']}", [
        ("card", f"{result['card']} ({result['dtype']})"),
        ("copy / matmul", f"{result['copy_gb_s']:,.0f} GB/s / "
                          f"{result['matmul_tflop_s']:,.1f} TFLOP/s ({result['matmul_dtype']})"),
        ("workload", f"{result['workload']}: {result['num_requests']} requests, "
                     f"{result['total_input_tokens']:,} prompt + "
                     f"{result['total_output_tokens']:,} output tokens"),
        ("LoRA", f"{result['num_loras']} adapters of rank {result['lora_rank']}, round-robin"
         if result["num_loras"] else "none"),
        ("elapsed", f"{result['elapsed_s']:.2f} s"),
        ("requests/s", f"{result['requests_per_s']:.2f}"),
        ("output tok/s", f"{result['output_tok_s']:,.1f}"),
        ("total tok/s", f"{result['total_tok_s']:,.1f}"),
        ("compute roofline share", f"{100 * result['compute_roofline_share']:.1f}%"),
    ])


def run(args: argparse.Namespace) -> int:
    """``kvserve bench throughput``."""
    _check_args(args)
    engine_args, config = resolve_engine(args)
    make = THROUGHPUT_WORKLOADS[args.workload]
    sized = {} if args.num_prompts is None else {"num_requests": args.num_prompts}
    requests = cap_lengths(make(config.model_config.vocab_size, **sized),
                           args.max_input_len, args.max_output_len)
    check_fits(config, max(len(r.prompt_token_ids) + r.output_len for r in requests),
               f"the longest {args.workload} request (--max-input-len / --max-output-len cut it)")
    with lora.random_adapters(args, config.model_config) as loras:
        bench = start(engine_args, config)
        figures = measure(bench, requests, use_tqdm=not args.disable_tqdm, loras=loras)
    result = bench.result("throughput", {
        "workload": args.workload, "num_prompts": args.num_prompts,
        "max_input_len": args.max_input_len, "max_output_len": args.max_output_len,
        **lora.describe(args), **figures})
    print_result(result)
    write_json(args.output_json, result)
    return 0
