"""The ``kvserve`` command at its edges: every failure is one line on stderr,
a non-zero exit status and no traceback (driven in subprocesses, as a user
meets them); the request is checked before anything is echoed; prompts
longer than a screen are not echoed whole; help text on every flag with no
reST markup; vLLM's spellings parse. Ctrl-C cases are in
``tests/e2e/test_cli_signals.py``."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import build_parser
from kvserve.console import prompt_echo
from kvserve.server.launcher import _take_model_tag

REPO_ROOT = Path(__file__).resolve().parents[2]


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: one torch thread, an 80x24 terminal, and a hub cache
    of our own in offline mode, so nothing can wait on the network."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_", "KVSERVE_", "OPENAI_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", COLUMNS="80", LINES="24",
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1")
    env.update(extra)
    return env


def run_cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT,
                          env=env or cli_env(tmp_path), stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], status: int,
                          *fragments: str) -> str:
    """Exit ``status``, no traceback, and stderr exactly one ``kvserve: error:``
    line holding every fragment; returns that line."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve: error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------ failures, in subprocesses


@pytest.mark.slow
def test_generate_checks_the_request_before_echoing_anything(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "generate", "--prompt", "def f(x):", "--max-tokens", "5000")
    assert_one_line_error(proc, 2, "max_tokens=5000", "max_model_len=2048")
    assert proc.stdout == ""


@pytest.mark.slow
def test_generate_too_long_prompt_is_refused_without_echo_or_warning(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "generate", "--prompt", "x = 1\n" * 1500)
    assert_one_line_error(proc, 2, "prompt:", "max_model_len=2048")
    assert proc.stdout == ""  # and no transformers warning on stderr (one line above)


@pytest.mark.parametrize(("argv", "fragments"), [
    (["generate", "--top-p", "2"], ["top_p=2.0", "(0, 1]"]),
    (["generate", "--model", "/no/such/dir"], ["'/no/such/dir' is not an existing directory"]),
    (["chat", "--max-logprobs", "-2"], ["max_logprobs=-2"]),
    (["generate", "--chat-template", "not a template"], ["chat_template="]),
    (["generate", "--num-cpu-threads", "0"], ["num_cpu_threads=0"]),
    (["bench", "serve", "--request-rate", "fast"], ["--request-rate=fast"]),
    (["bench", "serve", "--dataset-name", "sharegpt", "--dataset-path", "/no/such.json"],
     ["--dataset-path /no/such.json: no such file"]),
    (["bench", "serve", "--dataset-name", "sharegpt", "--dataset-path", "/"],
     ["--dataset-path /: a directory, not a file"]),
    (["serve", "/no/such/dir"], ["'/no/such/dir' is not an existing directory"]),
    (["serve", "model-a", "--model", "model-b"], ["the model is given twice"]),
])
def test_bad_input_is_one_line_and_status_2(tmp_path: Path, argv: list[str],
                                            fragments: list[str]) -> None:
    assert_one_line_error(run_cli(tmp_path, *argv), 2, *fragments)


@pytest.mark.slow
def test_a_model_larger_than_memory_is_refused_up_front_with_the_numbers(tmp_path: Path) -> None:
    # 70B parameters in float32 (282 GB): larger than any CI machine's memory
    proc = run_cli(tmp_path, "generate", "--model", "llama-3-70b", "--load-format", "dummy",
                   "--device", "cpu")
    assert_one_line_error(proc, 2, "weights need 282.", "GB of memory available",
                          "--dtype bfloat16")


@pytest.mark.slow
def test_serve_that_cannot_load_its_model_logs_one_error_and_exits_1(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "serve", "llama-3-70b", "--load-format", "dummy", "--device", "cpu",
                   "--port", str(free_port()), "--uvicorn-log-level", "warning")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "loading the model failed: the model's weights need" in errors[0]


@pytest.mark.slow
def test_bench_throughput_measures_and_names_the_engines_cpu_threads(tmp_path: Path) -> None:
    # torch would take 2 threads from OMP_NUM_THREADS; the engine is told 1
    result = tmp_path / "result.json"
    proc = run_cli(tmp_path, "bench", "throughput", "--device", "cpu", "--num-cpu-threads", "1",
                   "--num-prompts", "2", "--max-input-len", "16", "--max-output-len", "4",
                   "--disable-tqdm", "--output-json", str(result),
                   env=cli_env(tmp_path, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(result.read_text())["card"].endswith(", 1 thread")
    assert "| card | CPU " in proc.stdout and ", 1 thread (" in proc.stdout


@pytest.mark.slow
def test_a_benchmark_that_froze_its_heap_exits_quietly(tmp_path: Path) -> None:
    # the frozen heap is released at exit: Triton's bindings print ~30 lines
    # about "leaked" objects when they are still alive at interpreter shutdown
    proc = run_cli(tmp_path, "bench", "throughput", "--device", "cpu", "--num-prompts", "2",
                   "--max-input-len", "16", "--max-output-len", "4", "--disable-tqdm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_generate_stats_line_counts_in_english(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "generate", "--device", "cpu", "--num-cpu-threads", "1",
                   "--max-tokens", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.startswith("[kvserve] 1 token in "), proc.stderr
    assert "| CPU, 1 thread |" in proc.stderr


@pytest.mark.slow
def test_chat_names_the_model_and_cpu_threads_first(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "chat", "--device", "cpu", "--num-cpu-threads", "1")  # stdin: EOF
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stderr.splitlines()[0]
    assert first.startswith("[kvserve] CPU, 1 thread | model "), first
    assert first.endswith("kvserve-code-14m"), first


def test_bench_serve_without_a_server_says_so(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "bench", "serve", "--port", str(free_port()), "--num-prompts", "1")
    assert_one_line_error(proc, 1, "cannot reach", "/v1/models", "Connection refused",
                          "is the server running?")


@pytest.mark.parametrize("command", [["serve"], ["router", "--backend", "http://127.0.0.1:1"]])
def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path: Path,
                                                          command: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli(tmp_path, *command, "--port", str(port))
    assert_one_line_error(proc, 1, f"cannot listen on 127.0.0.1:{port}", "Address already in use",
                          "choose another --port")


def test_a_router_whose_backends_never_answer_fails_without_a_traceback(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "router", "--backend", f"http://127.0.0.1:{free_port()}",
                   "--port", str(free_port()), "--startup-timeout-s", "0.5")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "kvserve: error: no backend answered within 0.5 s")


def test_an_unexpected_error_is_one_line_with_the_traceback_at_debug(tmp_path: Path) -> None:
    plugin = tmp_path / "boom.py"
    plugin.write_text(
        "import sys\nfrom kvserve import cli\n"
        "def boom(args):\n    raise KeyError('gone')\n"
        "args = cli.build_parser().parse_args(['generate'])\n"
        "args.func = boom\nsys.exit(cli.run(args))\n")
    proc = subprocess.run([sys.executable, str(plugin)], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT, env=cli_env(tmp_path))
    assert_one_line_error(proc, 1, "internal error: KeyError: 'gone'", "--log-level DEBUG")


# ------------------------------------------------------------ echo


def test_a_prompt_that_fits_half_a_screen_is_echoed_whole() -> None:
    prompt = "def f(x):\n    return x\n"
    assert prompt_echo(prompt, columns=80, rows=24) == prompt


def test_a_prompt_longer_than_half_a_screen_shows_only_its_last_lines() -> None:
    prompt = "\n".join(f"line {i}" for i in range(200)) + "\n" + "y" * 300
    shown = prompt_echo(prompt, columns=80, rows=24)
    lines = shown.split("\n")
    assert lines[0].startswith("[kvserve] the prompt (") and "201 lines" in lines[0]
    assert lines[1:3] == ["line 198", "line 199"]
    assert lines[3] == "…" + "y" * 79  # cut from the left to the terminal's width
    assert len(shown) < 400


def test_one_long_line_counts_by_its_wrapped_rows() -> None:
    assert prompt_echo("z" * 80 * 12, columns=80, rows=24) == "z" * 80 * 12
    assert prompt_echo("z" * 80 * 13, columns=80, rows=24).startswith("[kvserve]")


# ------------------------------------------------------------ the parser


def _walk(parser: argparse.ArgumentParser, path: str
          ) -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _walk(child, f"{path} {name}")
        else:
            found.append((path, parser, action))
    return found


def test_every_flag_has_help_and_no_help_shows_rest_markup() -> None:
    entries = _walk(build_parser(), "kvserve")
    assert len(entries) > 150
    missing = [f"{path} {action.option_strings or action.dest}" for path, _, action in entries
               if not action.help]
    assert not missing, missing
    texts = [str(action.help) for _, _, action in entries]
    texts += [parser.description or "" for _, parser, _ in entries]
    assert not [text for text in texts if "``" in text]


def test_top_level_help_is_for_users() -> None:
    text = build_parser().format_help()
    assert "func" not in text and "heavy imports" not in text
    for command in ("generate", "chat", "serve", "bench", "plan"):
        assert command in text


def test_vllm_spellings_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "org/model", "--enable-prefix-caching",
                              "--chat-template", "t.jinja", "--max-logprobs", "5",
                              "--disable-log-requests", "--revision", "abc"])
    _take_model_tag(args)
    assert args.model == "org/model" and args.enable_prefix_caching
    assert args.chat_template == "t.jinja" and args.max_logprobs == 5
    assert not args.log_requests and args.revision == "abc"
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--enable-log-requests",
                              "--no-enable-chunked-prefill"])
    assert not args.enable_prefix_caching and args.log_requests
    assert not args.enable_chunked_prefill
    defaults = parser.parse_args(["generate"])
    assert defaults.enable_prefix_caching and defaults.enable_chunked_prefill
    assert defaults.max_logprobs == 20 and defaults.num_cpu_threads is None


def test_the_positional_model_and_model_flag_must_agree() -> None:
    args = build_parser().parse_args(["serve", "a", "--model", "a"])
    _take_model_tag(args)
    assert args.model == "a"
    args = build_parser().parse_args(["serve", "a", "--model", "b"])
    with pytest.raises(ValueError, match="given twice"):
        _take_model_tag(args)
