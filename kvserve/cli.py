"""The ``kvserve`` command: flags of ``generate`` and ``chat``, the
subcommands mounted on one parser, and how every subcommand ends.

``main`` turns every failure into one line on stderr and an exit status:
2 for bad input (a ``ValueError`` naming the flag or field), 1 for a
failure of the machine or the network (``OSError``, out of memory) or a
bug (the traceback only with ``--log-level DEBUG``), 130 for Ctrl-C. Heavy
imports (torch, the engine) happen inside the handlers so ``kvserve
--help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvserve import __version__

DESCRIPTION = ("kvserve: an LLM inference engine. Complete a prompt (generate), chat, serve "
               "the OpenAI API (serve), route over several servers (router), benchmark "
               "(bench) or plan a deployment (plan).")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130

logger = logging.getLogger("kvserve.cli")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group(
        "sampling", "a flag left unset takes the model's generation_config.json value, if it "
        "has one (temperature excepted: greedy unless given)")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help="the most tokens to generate (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=None,
                       help="sample from the smallest set of tokens whose probabilities add up "
                            "to this (default: 1, off)")
    group.add_argument("--top-k", type=int, default=None,
                       help="sample from the k most likely tokens (default: 0, off)")
    group.add_argument("--min-p", type=float, default=None,
                       help="drop tokens less likely than this times the most likely one "
                            "(default: 0, off)")
    group.add_argument("--repetition-penalty", type=float, default=None,
                       help="> 1 discourages tokens already in the prompt or output "
                            "(default: 1, off)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted from the logits of tokens already "
                            "generated (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted once per earlier occurrence of a token "
                            "(default: 0)")
    group.add_argument("--dry-multiplier", type=float, default=None,
                       help="DRY: > 0 penalises tokens that would extend a repeat of earlier "
                            "text, more the longer the repeat (default: 0, off)")
    group.add_argument("--dry-allowed-length", type=int, default=None,
                       help="DRY: repeats up to this many tokens go unpenalised (default: 2)")
    group.add_argument("--dry-base", type=float, default=None,
                       help="DRY: the penalty grows by this factor per repeated token beyond "
                            "--dry-allowed-length (default: 1.75)")
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    from kvserve.bench import add_bench_parser
    from kvserve.bench.plan_cli import add_plan_parser
    from kvserve.console import run_chat, run_generate
    from kvserve.engine.args import EngineArgs
    from kvserve.quantize.cli import add_quantize_parser
    from kvserve.router.launcher import add_router_parser
    from kvserve.server.launcher import add_serve_parser

    parser = argparse.ArgumentParser(prog="kvserve", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="log messages from this level up (default: WARNING; serve "
                             "always logs its start-up at INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="complete a prompt, streamed to the terminal",
                              description="Complete a prompt, streamed to the terminal; Ctrl-C "
                                          "stops the completion (exit status 130).")
    generate.add_argument("--prompt", default="def fibonacci(n):",
                          help="the text to complete (default: %(default)r)")
    EngineArgs.add_cli_args(generate)
    _add_sampling_args(generate, max_tokens=128)
    generate.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="interactive chat through the chat template",
                          description="Chat through the model's chat template. Ctrl-C stops "
                                      "a reply; Ctrl-C twice, Ctrl-D or /exit leaves; /clear "
                                      "starts over.")
    chat.add_argument("--system", default=None, help="a system message")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=run_chat)

    add_serve_parser(sub)
    add_router_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_quantize_parser(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error(message: str) -> None:
    print(f"kvserve: error: {_one_line(message)}", file=sys.stderr)


def _is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(exc, MemoryError) or (
        torch is not None and isinstance(exc, torch.OutOfMemoryError))


def _quiet_broken_pipe() -> None:
    """stdout's reader went away (``kvserve generate | head``): send what is
    left to /dev/null so the interpreter's final flush does not fail too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; every failure becomes one line and a status."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\nkvserve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        _quiet_broken_pipe()
        return EXIT_FAILURE
    except OSError as exc:
        _error(str(exc) or type(exc).__name__)
        return EXIT_FAILURE
    except Exception as exc:
        if _is_out_of_memory(exc):
            _error(f"out of memory: {exc}; use a smaller model or --max-model-len, or lower "
                   "--max-num-seqs / --gpu-memory-utilization")
            return EXIT_FAILURE
        logger.debug("the traceback of the error below", exc_info=exc)
        _error(f"internal error: {type(exc).__name__}: {exc} (rerun with --log-level DEBUG "
               "for the traceback, and please report it)")
        return EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # to start copies of itself
    except KeyboardInterrupt:
        print("\nkvserve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
