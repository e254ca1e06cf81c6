"""The ``kvserve`` command: ``generate``, ``chat``, ``serve``, ``bench`` and ``plan``.

Each subcommand adds its flags and sets ``func``; heavy imports (torch, the
engine) happen inside the handlers so ``kvserve --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from kvserve import __version__

if TYPE_CHECKING:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine, Prompt


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from kvserve.core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _make_engine(args: argparse.Namespace) -> LLMEngine:
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))


def _stream(engine: LLMEngine, prompt: Prompt, params: SamplingParams) -> tuple[str, int, float]:
    """Print the completion as it is generated; returns text, tokens, TTFT."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    ttft = 0.0
    text, num_tokens = "", 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            completion = output.outputs[0]
            if num_tokens == 0 and completion.token_ids:
                ttft = time.perf_counter() - start
            sys.stdout.write(completion.delta_text)
            sys.stdout.flush()
            text, num_tokens = completion.text, len(completion.token_ids)
    return text, num_tokens, ttft


def run_generate(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _sampling_params(args)
    prompt = args.prompt
    sys.stdout.write(prompt)
    start = time.perf_counter()
    _, num_tokens, ttft = _stream(engine, prompt, params)
    elapsed = time.perf_counter() - start
    decode_s = max(elapsed - ttft, 1e-9)
    sys.stdout.write("\n")
    print(
        f"[kvserve] {num_tokens} tokens in {elapsed:.2f} s | TTFT {ttft * 1e3:.1f} ms | "
        f"decode {max(num_tokens - 1, 0) / decode_s:.1f} tok/s | model {engine.config.model}",
        file=sys.stderr,
    )
    return 0


def run_chat(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat: type a message, /exit to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sys.stdout.write("assistant> ")
        text, _, _ = _stream(engine, prompt, params)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": text})
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvserve.bench import add_bench_parser
    from kvserve.engine.args import EngineArgs
    from kvserve.plan.cli import add_plan_parser
    from kvserve.quant.calibrate.cli import add_quantize_parser
    from kvserve.server.launcher import add_serve_parser

    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="complete a prompt, streamed to the terminal")
    generate.add_argument("--prompt", default="def fibonacci(n):")
    EngineArgs.add_cli_args(generate)
    _add_sampling_args(generate, max_tokens=64)
    generate.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="interactive chat through the chat template")
    chat.add_argument("--system", default=None, help="a system message")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=run_chat)

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
