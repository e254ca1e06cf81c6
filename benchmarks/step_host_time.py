"""Where a decode step's host time goes: wall time of the engine's host-side
functions per engine step, for any engine flags (speculative decoding
included), batch 1.

    PYTHONPATH=. python benchmarks/step_host_time.py --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --speculative-config '{"method": "oracle", \\
        "num_speculative_tokens": 4, "acceptance_rate": 0.8, "auto_disable": false}'

Builds the engine, runs one warm-up request, then wraps the functions of
``SPANS`` with ``time.perf_counter`` timers (class attributes, so every call
counts) and runs one request of ``--input-len`` random prompt tokens and
``--output-len`` new ones (greedy, ``ignore_eos``). Prints, per engine step,
each function's calls and milliseconds; spans nest (``EngineCore.step``
holds the wait, the scheduler's work and the runner's), so they do not add
up. ``PendingStep.get`` is the time the host waited for the device; a step's
wall time less that wait is host time the device may not have hidden.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from warm_engine import warm_engine

from kvserve.engine.args import EngineArgs

# (module, class, method), outermost first
SPANS = [
    ("kvserve.engine.llm_engine", "LLMEngine", "step"),
    ("kvserve.engine.engine_core", "EngineCore", "step"),
    ("kvserve.worker.model_runner", "PendingStep", "get"),
    ("kvserve.core.scheduler", "Scheduler", "update_from_output"),
    ("kvserve.core.scheduler", "Scheduler", "schedule"),
    ("kvserve.worker.model_runner", "ModelRunner", "execute_model"),
    ("kvserve.worker.model_runner", "ModelRunner", "_update_states"),
    ("kvserve.worker.model_runner", "ModelRunner", "_prepare_inputs"),
    ("kvserve.worker.model_runner", "ModelRunner", "_forward"),
    ("kvserve.worker.model_runner", "ModelRunner", "_sampling_batch"),
    ("kvserve.worker.spec_decode", "SpecDecodeRunner", "execute"),
    ("kvserve.worker.spec_decode", "SpecDecodeRunner", "_verify"),
    ("kvserve.worker.spec_decode", "SpecDecodeRunner", "_proposer_step"),
    ("kvserve.worker.spec_decode", "SpecDecodeRunner", "_read"),
]


def wrap_spans(totals: dict[str, list[float]]) -> None:
    """Time every call of the SPANS that exist into ``totals[name] = [calls, seconds]``."""
    for module_name, class_name, method in SPANS:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is None or not hasattr(cls, method):
            continue
        name = f"{class_name}.{method}"
        original = getattr(cls, method)

        def timed(*args: Any, _original: Any = original, _name: str = name,
                  **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                entry = totals[_name]
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        setattr(cls, method, functools.wraps(original)(timed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="write the table as JSON too")
    parser.add_argument("--cprofile", type=Path, default=None,
                        help="also run the measured request under cProfile and write its "
                        "statistics here (pstats), the top 40 functions by own time printed")
    args = parser.parse_args(argv)
    llm, prompt, params = warm_engine(args)
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    wrap_spans(totals)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = max(int(totals["LLMEngine.step"][0]), 1)
    order = [f"{class_name}.{method}" for _, class_name, method in SPANS]
    rows = [{"span": name, "calls_per_step": totals[name][0] / steps,
             "ms_per_step": 1e3 * totals[name][1] / steps} for name in order if name in totals]
    print(f"\n{steps} engine steps, {args.output_len} tokens, {1e3 * wall / steps:.3f} ms a step "
          f"({args.output_len / wall:.1f} tok/s)\n")
    print("| span | calls a step | ms a step |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row['span']} | {row['calls_per_step']:.2f} | {row['ms_per_step']:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"steps": steps, "wall_s": wall,
                                         "tokens": args.output_len, "spans": rows}, indent=2))
    if args.cprofile is not None:  # after the timed run: cProfile slows every Python call
        profiler = cProfile.Profile()
        profiler.runcall(llm.generate, [prompt], params, use_tqdm=False)
        profiler.dump_stats(str(args.cprofile))
        stats = pstats.Stats(str(args.cprofile))
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats("kvserve", 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
