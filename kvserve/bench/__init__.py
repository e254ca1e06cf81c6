"""``kvserve bench``: benchmarks. ``bench serve`` loads any OpenAI-compatible
server (kvserve, vLLM, SGLang) and reports latency percentiles and throughput
with vLLM's key names; ``bench latency`` times one batch of fixed-length
requests through the offline engine (TTFT, TPOT, MBU, prefill MFU) and
``bench throughput`` a whole workload submitted at once. Each subcommand is a
module with its own ``add_cli_args`` / ``run`` pair, mounted here."""

from __future__ import annotations

import argparse
from typing import Any


def plain_text(docstring: str | None) -> str:
    """A module docstring as ``--help`` shows it: no reST double backticks."""
    return (docstring or "").replace("``", "")


def add_bench_parser(sub: Any) -> None:
    """Mount ``bench`` and its subcommands on the ``kvserve`` parser."""
    from kvserve.bench import latency, serve, throughput

    bench = sub.add_parser("bench", help="benchmarks: serve (an HTTP server), latency and "
                                         "throughput (the offline engine)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module, name, summary in (
        (serve, "serve", "load an OpenAI-compatible server and report TTFT / TPOT / ITL / E2E"),
        (latency, "latency", "time one batch of fixed-length requests: TTFT, TPOT, MBU, MFU"),
        (throughput, "throughput", "run a whole workload at once: requests/s and tok/s"),
    ):
        parser = bench_sub.add_parser(name, help=summary, description=plain_text(module.__doc__),
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(parser)
        parser.set_defaults(func=module.run)
