"""Where a decode step's device time goes: kernel times of batch-1 decode under
``torch.profiler``, for any engine flags.

    PYTHONPATH=. python benchmarks/profile_decode.py --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --quantization int4 --output-len 64

Builds the engine, runs one warm-up request, then profiles one request of
``--input-len`` random prompt tokens and ``--output-len`` new ones (greedy,
``ignore_eos``) and prints the CUDA kernels by total device time, with their
count and mean, and the total device time per decode token. Kernels inside
CUDA graph replays are seen by the profiler on recent drivers; run with
``--enforce-eager`` to be sure every kernel is listed.
"""

from __future__ import annotations

import argparse
import sys

import torch
from warm_engine import warm_engine

from kvserve.engine.args import EngineArgs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rows", type=int, default=25, help="kernels listed")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode.py lists CUDA kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    llm, prompt, params = warm_engine(args)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    events = [e for e in profile.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total_us = sum(e.device_time_total for e in events)
    print("\n| kernel | calls | total ms | mean µs | share |\n|---|---:|---:|---:|---:|")
    for event in events[:args.rows]:
        print(f"| {event.key[:70]} | {event.count} | {event.device_time_total / 1e3:.2f} | "
              f"{event.device_time_total / event.count:.1f} | "
              f"{100 * event.device_time_total / total_us:.1f}% |")
    print(f"\ndevice time {total_us / 1e3:.1f} ms for {args.output_len} tokens: "
          f"{total_us / 1e3 / args.output_len:.3f} ms a token (prefill included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
