"""``kvserve generate`` and ``kvserve chat``: the engine at a terminal.

Owns what a person at a terminal sees: the request is validated before
anything is printed, a prompt longer than about half a screen is not echoed
whole (its last lines are), the completion streams as it is generated, and
one stats line goes to stderr (chat's first line names the model and, on
the CPU, torch's thread count). Ctrl-C while a reply streams stops that reply
(the request is aborted between two engine steps, so the engine stays
consistent); in ``chat`` a second Ctrl-C in a row, Ctrl-D or ``/exit``
leaves. It must not parse flags (``cli.py`` does) nor know about models.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine

# a prompt is echoed whole when it wraps to at most this share of the
# terminal's rows; otherwise only its last ECHO_TAIL_LINES lines are shown
ECHO_SCREEN_SHARE = 0.5
ECHO_TAIL_LINES = 3
EXIT_INTERRUPTED = 130
CHAT_HELP = ("kvserve chat: type a message. Ctrl-C stops a reply; Ctrl-C twice, Ctrl-D or "
             "/exit leaves; /clear starts a new conversation.")


# sampling flags that the model's generation_config fills when left unset
_MODEL_DEFAULTED = ("top_p", "top_k", "min_p", "repetition_penalty", "dry_multiplier",
                    "dry_allowed_length", "dry_base")


def sampling_params(args: argparse.Namespace,
                    model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The sampling flags as ``SamplingParams`` (ValueError naming a bad one);
    flags left unset take ``model_defaults`` (the engine's values from the
    model's generation_config.json), then SamplingParams' own defaults.
    Temperature is never taken from the model: greedy unless given."""
    from kvserve.core.sampling_params import SamplingParams

    defaults = {name: value for name, value in (model_defaults or {}).items()
                if name in (*_MODEL_DEFAULTED, "dry_penalty_last_n", "dry_sequence_breakers")}
    defaults.update({name: getattr(args, name) for name in _MODEL_DEFAULTED
                     if getattr(args, name) is not None})
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos, **defaults,
    )


def make_engine(args: argparse.Namespace) -> LLMEngine:
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))


class StopOnInterrupt:
    """While active, SIGINT (Ctrl-C) sets ``requested`` instead of raising, so
    a streaming loop can abort its request between two engine steps. A second
    SIGINT before the loop reacts raises ``KeyboardInterrupt`` (a step that
    never ends can still be left). A no-op outside the main thread or when
    SIGINT is ignored (a background job)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:
                self._previous = signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


@dataclass
class Reply:
    """What one streamed request produced."""

    text: str = ""
    num_tokens: int = 0
    ttft_s: float = 0.0
    elapsed_s: float = 0.0
    interrupted: bool = False


def stream_reply(engine: LLMEngine, request_id: str, stop: StopOnInterrupt) -> Reply:
    """Step the engine, printing the request's new text, until it finishes or
    Ctrl-C asks it to stop (then it is aborted)."""
    reply = Reply()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if stop.requested:
            engine.abort_request(request_id)
            reply.interrupted = True
            break
        for output in engine.step():
            if output.request_id != request_id:
                continue
            completion = output.outputs[0]
            if reply.num_tokens == 0 and completion.token_ids:
                reply.ttft_s = time.perf_counter() - start
            sys.stdout.write(completion.delta_text)
            sys.stdout.flush()
            reply.text, reply.num_tokens = completion.text, len(completion.token_ids)
    reply.elapsed_s = time.perf_counter() - start
    return reply


def prompt_echo(prompt: str, columns: int, rows: int) -> str:
    """The prompt as echoed before its completion: whole when it wraps to at
    most ``ECHO_SCREEN_SHARE`` of ``rows``, else a note and its last lines
    (each cut to the last ``columns`` characters)."""
    lines = prompt.split("\n")
    wrapped = sum(max(1, -(-len(line) // columns)) for line in lines)
    if wrapped <= rows * ECHO_SCREEN_SHARE:
        return prompt
    tail = [line if len(line) <= columns else "…" + line[-(columns - 1):]
            for line in lines[-ECHO_TAIL_LINES:]]
    note = (f"[kvserve] the prompt ({len(prompt):,} characters, {len(lines):,} lines) is "
            f"longer than the screen; its last {len(tail)} line(s):")
    return note + "\n" + "\n".join(tail)


def _on_cpu(engine: LLMEngine) -> bool:
    import torch

    device = engine.config.device
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def _engine_parts(engine: LLMEngine) -> list[str]:
    """The CPU's thread count (on the CPU) and the model, for a status line."""
    parts = []
    if _on_cpu(engine):
        import torch

        threads = torch.get_num_threads()
        parts.append(f"CPU, {threads} thread{'s' if threads != 1 else ''}")
    return [*parts, f"model {engine.config.model}"]


def _stats_line(engine: LLMEngine, reply: Reply) -> str:
    decode_s = max(reply.elapsed_s - reply.ttft_s, 1e-9)
    plural = "s" if reply.num_tokens != 1 else ""
    parts = [f"{reply.num_tokens} token{plural} in {reply.elapsed_s:.2f} s",
             f"TTFT {reply.ttft_s * 1e3:.1f} ms",
             f"decode {max(reply.num_tokens - 1, 0) / decode_s:.1f} tok/s",
             *_engine_parts(engine)]
    if reply.interrupted:
        parts.append("stopped by Ctrl-C")
    return "[kvserve] " + " | ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    """``kvserve generate``: 0, or 130 when Ctrl-C stopped the completion."""
    sampling_params(args)  # a bad flag fails before the model loads
    engine = make_engine(args)
    params = sampling_params(args, engine.config.sampling_defaults)
    _, token_ids = engine.processor.tokenize(args.prompt)
    request_id = engine.add_request(token_ids, params)  # validated before anything is shown
    columns, rows = shutil.get_terminal_size()
    sys.stdout.write(prompt_echo(args.prompt, columns, rows))
    sys.stdout.flush()
    with StopOnInterrupt() as stop:
        reply = stream_reply(engine, request_id, stop)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_stats_line(engine, reply), file=sys.stderr)
    return EXIT_INTERRUPTED if reply.interrupted else 0


def _chat_request(engine: LLMEngine, messages: list[dict[str, str]],
                  params: SamplingParams) -> str:
    """Queue the conversation's next reply; ``max_tokens`` is cut to the room
    left in ``max_model_len`` (ValueError when there is none)."""
    token_ids = engine.processor.apply_chat_template(messages, add_generation_prompt=True)
    room = engine.max_model_len - len(token_ids)
    if room < 1:
        raise ValueError(
            f"the conversation has {len(token_ids)} tokens, which leaves no room in "
            f"max_model_len={engine.max_model_len}; /clear starts a new one")
    if params.max_tokens is not None and params.max_tokens > room:
        params = dataclasses.replace(params, max_tokens=room,
                                     min_tokens=min(params.min_tokens, room))
    return engine.add_request(token_ids, params)


def run_chat(args: argparse.Namespace) -> int:
    """``kvserve chat``: 0 when the user leaves."""
    sampling_params(args)  # a bad flag fails before the model loads
    engine = make_engine(args)
    params = sampling_params(args, engine.config.sampling_defaults)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print("[kvserve] " + " | ".join(_engine_parts(engine)), file=sys.stderr)
    print(CHAT_HELP, file=sys.stderr)
    interrupted = False  # the last thing the user did was Ctrl-C
    while True:
        try:
            line = input("you> ")
        except EOFError:
            sys.stdout.write("\n")
            return 0
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            if interrupted:
                return 0
            interrupted = True
            print("(Ctrl-C again or Ctrl-D to leave)", file=sys.stderr)
            continue
        interrupted = False
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/clear":
            messages = list(system)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        try:
            request_id = _chat_request(engine, messages, params)
        except ValueError as exc:
            messages.pop()
            print(f"kvserve: error: {exc}", file=sys.stderr)
            continue
        sys.stdout.write("assistant> ")
        sys.stdout.flush()
        with StopOnInterrupt() as stop:
            reply = stream_reply(engine, request_id, stop)
        sys.stdout.write("\n")
        if reply.interrupted:
            print("[reply stopped; Ctrl-C again or Ctrl-D to leave]", file=sys.stderr)
            interrupted = True
        messages.append({"role": "assistant", "content": reply.text})
