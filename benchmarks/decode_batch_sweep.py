"""Decode tokens/s against batch size for one engine, every batch in one process.

    PYTHONPATH=. python benchmarks/decode_batch_sweep.py --model llama-3-8b --load-format dummy \\
        --dtype bfloat16 --quantization int4 --batch-sizes 1 4 16 64 256 --output-json int4.json
    PYTHONPATH=. python benchmarks/decode_batch_sweep.py --plot bf16.json int8.json int4.json \\
        --out sweep.png

Each batch size runs ``kvserve bench latency``'s iterations (W1 requests:
``--input-len`` random prompt tokens, ``--output-len`` new, greedy,
``ignore_eos``) on the same engine, so the model is built and its CUDA
graphs captured once; the JSON's ``results`` hold one ``kvserve bench
latency`` result per batch size. ``--plot`` draws decode tok/s against batch for several
such files (one line each, labelled by their ``--quantization``) with
matplotlib (optional: ``pip install ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.bench import latency
from kvserve.bench.offline import check_fits, resolve_engine, start
from kvserve.bench.report import print_table, write_json


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine_args, config = resolve_engine(args)
    check_fits(config, args.input_len + args.output_len, "--input-len + --output-len")
    bench = start(engine_args, config)
    results = []
    for batch_size in args.batch_sizes:
        args.batch_size = batch_size
        iterations = [latency._iteration(bench, args, seed=i)
                      for i in range(args.num_iters_warmup + args.num_iters)]
        summary = latency.summarize(bench, args, iterations[args.num_iters_warmup:])
        results.append(bench.result("latency", summary))
    return results


def label(result: dict[str, Any]) -> str:
    return result["engine_args"].get("quantization") or result["dtype"]


def plot(files: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for file in files:
        results = json.loads(Path(file).read_text())["results"]
        ax.plot([r["batch_size"] for r in results], [r["decode_tok_s"] for r in results],
                marker="o", label=label(results[0]))
    first = json.loads(Path(files[0]).read_text())["results"][0]
    ax.set(xscale="log", yscale="log", xlabel="batch size (requests decoding)",
           ylabel="decode tokens/s", title=f"{first['model']} on {first['card']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    latency.add_cli_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                        help="plot these sweep files instead of running")
    parser.add_argument("--out", default="decode_batch_sweep.png", help="with --plot")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot, args.out)
        return 0
    args.max_num_seqs = max(args.max_num_seqs, *args.batch_sizes)
    results = sweep(args)
    print_table(f"decode batch sweep: {results[0]['model']} ({label(results[0])}) on "
                f"{results[0]['card']}", [
        (f"batch {r['batch_size']}",
         f"{r['decode_tok_s']:,.1f} decode tok/s, TPOT {r['mean_tpot_ms']:.2f} ms, "
         f"MBU {100 * (r['mbu_vs_copy'] or 0):.1f}% of copy") for r in results])
    write_json(args.output_json, {"benchmark": "decode_batch_sweep", "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
