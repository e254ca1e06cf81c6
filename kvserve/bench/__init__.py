"""``kvserve bench``: benchmarks. ``bench serve`` loads any OpenAI-compatible
server (kvserve, vLLM, SGLang) and reports latency percentiles and throughput
with vLLM's key names; more benchmarks mount here with their own
``add_cli_args`` / ``run`` pair."""

from __future__ import annotations

from typing import Any


def add_bench_parser(sub: Any) -> None:
    """Mount ``bench`` and its subcommands on the ``kvserve`` parser."""
    from kvserve.bench import serve

    bench = sub.add_parser("bench", help="benchmarks (bench serve: load an HTTP server)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve_parser = bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server and report TTFT / TPOT / ITL / E2E",
        description=serve.__doc__)
    serve.add_cli_args(serve_parser)
    serve_parser.set_defaults(func=serve.run)
