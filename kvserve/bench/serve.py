"""Load an OpenAI-compatible server (kvserve, vLLM, SGLang, ...) and measure it.

Requests are streamed (``stream_options.include_usage`` so token counts come
from the server) and timed on the client: TTFT = first content chunk minus
send time, ITL = gaps between content chunks, TPOT = (latency - TTFT) /
(output tokens - 1), E2EL = latency. Arrivals are Poisson (``--burstiness
1``) or gamma (burstier below 1) at ``--request-rate`` requests/s (``inf``:
all at once), capped by ``--max-concurrency``. A comma list of rates runs a
sweep; ``--plot`` draws latency against throughput over it (PNG).

Datasets: ``random`` prompts are made of random common English words; the
words-per-token ratio is measured once through the server's ``/tokenize``
when it has one (kvserve and vLLM do), else taken as 1, so input lengths are
close to ``--random-input-len`` but not exact; the true prompt token counts
come back in the usage chunk and are the ones reported. ``sharegpt`` reads a
ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human",
"value": ...}, {"from": "gpt", "value": ...}, ...]}``) and uses the first
human turn as the prompt, the first answer's length (about 4 characters per
token) or ``--sharegpt-output-len`` as ``max_tokens``.

``--save-result`` writes JSON with vLLM's ``bench serve`` key names. The
peak output throughput is the most output tokens in any one-second window
(a sliding window starting at each content chunk; a chunk counts its
request's tokens over its chunks, so tokens are counted as in the mean).

Failures end in one line and a non-zero exit: a server that cannot be
reached or refuses the API key (checked first, through ``/v1/models``), a
dataset file that is missing or unreadable, a rate at which no request
succeeded. Ctrl-C prints what was measured so far (the requests finished
by then) and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvserve import envs
from kvserve.bench.report import latency_stats_ms, percentile_key

_WORD_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think"
)
WORDS = tuple(_WORD_TEXT.split())
CHARS_PER_TOKEN = 4
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (--dataset-name w2 / w3)
    prompt_len: int  # estimated; the server's usage count replaces it
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvserve bench serve`` (vLLM's names)."""
    target = parser.add_argument_group("target")
    target.add_argument("--backend", default="openai", choices=("openai", "openai-chat"),
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    target.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    target.add_argument("--host", default="127.0.0.1",
                        help="the server's host when --base-url is not given")
    target.add_argument("--port", type=int, default=8000,
                        help="the server's port when --base-url is not given")
    target.add_argument("--endpoint", default=None, help="default from --backend")
    target.add_argument("--model", default=None, help="default: the first of /v1/models")
    target.add_argument("--api-key", default=None, help="default $OPENAI_API_KEY")
    target.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random",
                      choices=("random", "sharegpt", "w2", "w3"),
                      help="random: prompts of random common words; sharegpt: conversations "
                           "from --dataset-path; w2 / w3: the first --num-prompts requests of "
                           "`kvserve bench throughput`'s workloads, as token-id prompts "
                           "(completions only)")
    data.add_argument("--workload-vocab-size", type=int, default=32000,
                      help="w2 / w3: prompt token ids are drawn below this; it must not exceed "
                           "the served model's vocabulary (default: %(default)s)")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    data.add_argument("--num-prompts", type=int, default=1000,
                      help="requests to send (default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens per random request, about (default: %(default)s)")
    data.add_argument("--random-output-len", type=int, default=128,
                      help="max_tokens of each random request (default: %(default)s)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="max_tokens of every ShareGPT request (default: the length of "
                           "the conversation's first answer)")
    data.add_argument("--ignore-eos", action="store_true",
                      help="ask the server to generate max_tokens tokens, EOS or not")
    data.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature of every request (default: 0, greedy)")
    data.add_argument("--seed", type=int, default=0,
                      help="seed of the prompts, lengths and arrival times")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests/s, 'inf', or a comma list for a sweep")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps (1 = Poisson)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="the most requests in flight at once (default: no limit)")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests sent one by one before the measured run")
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help="the metrics to print percentiles of (default: %(default)s)")
    report.add_argument("--metric-percentiles", default="50,90,99",
                        help="the percentiles to print (default: %(default)s)")
    report.add_argument("--save-result", action="store_true",
                        help="write the result as JSON (vLLM's key names)")
    report.add_argument("--save-detailed", action="store_true",
                        help="add every request's lengths, latencies, text and error")
    report.add_argument("--result-dir", default=".",
                        help="where --save-result writes (default: the current directory)")
    report.add_argument("--result-filename", default=None,
                        help="the file name (default: BACKEND-RATEqps-MODEL-DATE.json)")
    report.add_argument("--plot", default=None, metavar="PNG",
                        help="draw latency vs throughput over the --request-rate sweep")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


# ------------------------------------------------------------ arguments


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            rate = float("nan")
        if not rate > 0:
            raise ValueError(f"--request-rate={text} is invalid: rates must be > 0 (or inf)")
        rates.append(rate)
    return rates


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        try:
            slo = float(value)
        except ValueError:
            slo = float("nan")
        if name not in ("ttft", "tpot", "e2el") or not slo >= 0:
            raise ValueError(f"--goodput {item} is invalid: use ttft:MS, tpot:MS or e2el:MS")
        slos[name] = slo
    return slos


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts} is invalid: must be >= 1")
    if args.base_url and not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url={args.base_url} is invalid: must start with http:// or "
                         "https://")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio={args.random_range_ratio} is invalid: "
                         "must be in [0, 1)")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness={args.burstiness} is invalid: must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} is invalid: must be >= 1")
    if args.dataset_name in ("w2", "w3") and args.backend != "openai":
        raise ValueError(f"--dataset-name {args.dataset_name} sends token-id prompts: it needs "
                         "--backend openai (completions)")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    if args.dataset_path and not Path(args.dataset_path).is_file():
        what = "a directory, not a file" if Path(args.dataset_path).is_dir() else "no such file"
        raise ValueError(f"--dataset-path {args.dataset_path}: {what}")


# ------------------------------------------------------------ datasets


def _lengths(rng: random.Random, mean: int, ratio: float, num: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def random_requests(args: argparse.Namespace, tokens_per_word: float) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    inputs = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    outputs = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    requests = []
    for input_len, output_len in zip(inputs, outputs):
        num_words = max(1, round(input_len / tokens_per_word))
        prompt = " ".join(rng.choice(WORDS) for _ in range(num_words))
        requests.append(SampleRequest(prompt, input_len, output_len))
    return requests


def workload_requests(args: argparse.Namespace) -> list[SampleRequest]:
    """The first ``--num-prompts`` requests of workload W2 or W3 (token ids)."""
    from kvserve.bench.workloads import w2, w3

    make = w2 if args.dataset_name == "w2" else w3
    return [SampleRequest(r.prompt_token_ids, len(r.prompt_token_ids), r.output_len)
            for r in make(args.workload_vocab_size, num_requests=args.num_prompts)]


def sharegpt_requests(args: argparse.Namespace) -> list[SampleRequest]:
    try:
        entries = json.loads(Path(args.dataset_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {args.dataset_path}: cannot be read as JSON "
                         f"({exc})") from None
    if not isinstance(entries, list):
        raise ValueError(f"--dataset-path {args.dataset_path}: expected a JSON list")
    random.Random(args.seed).shuffle(entries)
    requests: list[SampleRequest] = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, answer = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        output_len = args.sharegpt_output_len or max(1, len(answer) // CHARS_PER_TOKEN)
        if not prompt or output_len < 1:
            continue
        requests.append(SampleRequest(prompt, max(1, len(prompt) // CHARS_PER_TOKEN),
                                      output_len))
        if len(requests) == args.num_prompts:
            break
    if not requests:
        raise ValueError(f"--dataset-path {args.dataset_path}: no usable conversations")
    base = list(requests)
    while len(requests) < args.num_prompts:  # a small file: go round again
        requests.append(base[len(requests) % len(base)])
    return requests


# ------------------------------------------------------------ the client


class Target:
    """Where and how to send requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        self.chat = args.backend == "openai-chat"
        endpoint = args.endpoint or ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.url = self.base_url + endpoint
        api_key = args.api_key or envs.openai_api_key()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model: str = args.model or ""
        self.ignore_eos = args.ignore_eos
        self.temperature = args.temperature

    def payload(self, request: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.output_len,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


async def sse_data(response: Any) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE response (split on blank lines, never on
    the Unicode line breaks JSON may carry)."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            for line in frame.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode("utf-8")


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send_request(client: Any, target: Target, request: SampleRequest) -> RequestResult:
    """Send one streaming request and time it."""
    result = RequestResult(prompt_len=request.prompt_len)
    start = result.start_s = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", target.url, json=target.payload(request),
                                 headers=target.headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for data in sse_data(response):
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if "error" in message:
                    result.error = str(message["error"].get("message", message["error"]))
                    break
                usage = message.get("usage")
                if usage:
                    result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
                    result.output_len = usage.get("completion_tokens", result.output_len)
                for choice in message.get("choices", []):
                    text = _chunk_text(choice)
                    if not text:
                        continue
                    now = time.perf_counter()
                    if not result.chunk_times:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunk_times.append(now)
                    result.generated_text += text
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - start
    if not result.output_len:
        result.output_len = len(result.chunk_times)
    result.success = not result.error and bool(result.chunk_times)
    if not result.error and not result.success:
        result.error = "no content received (an empty completion counts as failed, as in vLLM)"
    return result


async def _get_json(client: Any, url: str, headers: dict[str, str],
                    body: dict[str, Any] | None = None) -> Any:
    response = await (client.post(url, json=body, headers=headers) if body is not None
                      else client.get(url, headers=headers))
    response.raise_for_status()
    return response.json()


def _refused_key_message(url: str, status: int, reason: str, has_key: bool) -> str:
    if has_key:
        return f"{url} answered {status} {reason}: the server refused the API key given"
    return (f"{url} answered {status} {reason}: the server wants an API key; pass it with "
            "--api-key or OPENAI_API_KEY")


def _transport_reason(exc: BaseException) -> str:
    """The root cause of a failed connection ("Connection refused"), not
    httpx's summary ("All connection attempts failed")."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and (cause.errno or cause.strerror):
            return os.strerror(cause.errno) if cause.errno else str(cause.strerror)
        cause = cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__


async def check_server(client: Any, target: Target) -> None:
    """GET ``/v1/models``: the server is up and takes our key (ConnectionError
    with one line saying what is wrong otherwise); fill in the model name."""
    import httpx

    url = target.base_url + "/v1/models"
    try:
        response = await client.get(url, headers=target.headers)
    except httpx.TransportError as exc:
        raise ConnectionError(
            f"cannot reach {url}: {_transport_reason(exc)}; is the server running? "
            "(--base-url, or --host and --port)") from None
    if response.status_code in (401, 403):
        raise ConnectionError(_refused_key_message(url, response.status_code,
                                                   response.reason_phrase,
                                                   bool(target.headers)))
    if target.model:
        return
    try:
        response.raise_for_status()
        target.model = str(response.json()["data"][0]["id"])
    except (httpx.HTTPStatusError, ValueError, LookupError, TypeError):
        raise ConnectionError(
            f"{url} answered {response.status_code} {response.reason_phrase} without a "
            "model to use; pass --model") from None


async def discover(client: Any, target: Target) -> float:
    """Check the server and fill in the model name; return tokens per word of
    the random word list (through ``/tokenize`` when the server has it, else 1)."""
    await check_server(client, target)
    sample = " ".join(WORDS)
    try:
        result = await _get_json(client, target.base_url + "/tokenize", target.headers,
                                 {"model": target.model, "prompt": sample,
                                  "add_special_tokens": False})
        return max(float(result["count"]) / len(WORDS), 0.1)
    except Exception:
        return 1.0


async def arrivals(requests: list[SampleRequest], rate: float, burstiness: float,
                   seed: int) -> AsyncIterator[SampleRequest]:
    """Yield requests with gamma-distributed gaps (mean 1/rate; shape = burstiness)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for request in requests:
        yield request
        if math.isfinite(rate):
            await asyncio.sleep(float(rng.gamma(shape=burstiness,
                                                scale=1.0 / (rate * burstiness))))


@dataclass
class LoadRun:
    """One rate's requests: the results of those that finished, the wall time
    and whether Ctrl-C cut it short (requests still in flight then are dropped)."""

    rate: float
    results: list[RequestResult]
    duration: float
    interrupted: bool = False


async def run_load(client: Any, target: Target, requests: list[SampleRequest],
                   rate: float, args: argparse.Namespace) -> LoadRun:
    """Send every request at the given rate (Ctrl-C: stop, keep what finished)."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = tqdm(total=len(requests), disable=args.disable_tqdm, desc=f"rate {rate:g}")

    async def one(request: SampleRequest) -> RequestResult:
        if limit is None:
            result = await send_request(client, target, request)
        else:
            async with limit:
                result = await send_request(client, target, request)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    interrupted = False
    try:
        async for request in arrivals(requests, rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(request)))
        if tasks:
            await asyncio.wait(tasks)
    except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels the main task)
        interrupted = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    duration = time.perf_counter() - start
    progress.close()
    results = [task.result() for task in tasks if task.done() and not task.cancelled()]
    return LoadRun(rate, results, duration, interrupted)


# ------------------------------------------------------------ metrics


def peak_output_tokens_per_s(results: list[RequestResult], duration: float) -> float:
    """The most output tokens in any one-second window, per second.

    Windows slide: one starts at each content chunk. A chunk counts its
    request's output tokens over its number of chunks, so tokens are counted
    as the mean counts them. A run shorter than a second is one window of
    its own duration (the peak is then the mean)."""
    events = sorted((t, r.output_len / len(r.chunk_times))
                    for r in results if r.success and r.chunk_times for t in r.chunk_times)
    window = min(1.0, duration)
    best = total = 0.0
    left = 0
    for time_s, tokens in events:
        total += tokens
        while time_s - events[left][0] >= window - 1e-9:  # [start, start + window)
            total -= events[left][1]
            left += 1
        best = max(best, total)
    return best / window if window > 0 else 0.0


def peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at once."""
    events = sorted([(r.start_s, 1) for r in results]
                    + [(r.start_s + r.latency, -1) for r in results])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return peak


def _tpot(result: RequestResult) -> float:
    if result.output_len <= 1:
        return 0.0
    return (result.latency - result.ttft) / (result.output_len - 1)


def compute_metrics(results: list[RequestResult], duration: float,
                    args: argparse.Namespace) -> dict[str, Any]:
    """The summary with vLLM's key names (latencies in ms)."""
    ok = [r for r in results if r.success]
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    slos = parse_goodput(args.goodput)
    good = 0
    for result in ok:
        measured = {"ttft": result.ttft, "tpot": _tpot(result), "e2el": result.latency}
        good += all(measured[name] * 1000.0 <= slo for name, slo in slos.items())
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    summary: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_output_tokens_per_s(results, duration),
        "max_concurrent_requests": peak_concurrency(results),
    }
    values = {"ttft": [r.ttft for r in ok], "tpot": [_tpot(r) for r in ok if r.output_len > 1],
              "itl": [gap for r in ok for gap in r.itl], "e2el": [r.latency for r in ok]}
    for name in METRICS:
        summary.update(latency_stats_ms(name, values[name], percentiles))
    if args.save_detailed:
        summary.update(
            input_lens=[r.prompt_len for r in results], output_lens=[r.output_len for r in results],
            ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results])
    return summary


# ------------------------------------------------------------ reporting


def print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{text:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if args.max_concurrency:
        row("Maximum request concurrency:", args.max_concurrency)
    row("Request rate configured (RPS):", summary["request_rate"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary["request_goodput"] is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for name in METRICS:
        if name not in selected:
            continue
        print("{s:{c}^{n}}".format(s=METRIC_NAMES[name], n=50, c="-"))
        label = name.upper()
        row(f"Mean {label} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", summary[f"median_{name}_ms"])
        for p in args.metric_percentiles.split(","):
            key = percentile_key(float(p))
            row(f"P{key} {label} (ms):", summary[f"p{key}_{name}_ms"])
    print("=" * 50)


def result_path(args: argparse.Namespace, summary: dict[str, Any], sweep: bool) -> Path:
    rate = summary["request_rate"]
    if args.result_filename:
        name = args.result_filename
        if sweep:
            stem, dot, ext = name.rpartition(".")
            name = f"{stem}-{rate}qps.{ext}" if dot else f"{name}-{rate}qps"
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(summary["model_id"]).replace("/", "_")
        name = f"{args.backend}-{rate}qps{concurrency}-{model}-{summary['date']}.json"
    return Path(args.result_dir) / name


def write_plot(path: str, summaries: list[dict[str, Any]]) -> None:
    """Median and P99 TTFT and TPOT against output throughput, one point per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(summaries, key=lambda s: s["output_throughput"])
    x = [s["output_throughput"] for s in points]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, metric in zip(axes, ("ttft", "tpot")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            key = f"{stat}_{metric}_ms"
            axis.plot(x, [s.get(key, float("nan")) for s in points], style, label=stat)
        for s in points:
            axis.annotate(f"{s['request_rate']} rps", (s["output_throughput"],
                                                       s[f"median_{metric}_ms"]), fontsize=7)
        axis.set_xlabel("output throughput (tok/s)")
        axis.set_ylabel(f"{metric.upper()} (ms)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{points[0]['model_id']}: latency vs throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ------------------------------------------------------------ entry point


def _summary(args: argparse.Namespace, target: Target, run: LoadRun,
             num_prompts: int) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
        "model_id": target.model, "tokenizer_id": target.model, "num_prompts": num_prompts,
        "request_rate": run.rate if math.isfinite(run.rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **compute_metrics(run.results, run.duration, args),
    }


def _report(args: argparse.Namespace, summary: dict[str, Any], run: LoadRun,
            sweep: bool) -> None:
    """Print one rate's summary and its first distinct errors; save it unless
    Ctrl-C cut the run short."""
    if run.interrupted:
        print(f"Interrupted: {len(run.results)} of {summary['num_prompts']} requests "
              "finished; the figures below are theirs.")
    print_summary(summary, args)
    if summary["completed"]:  # when none succeeded, run() names the first error
        errors = sorted({r.error for r in run.results if r.error})
        for error in errors[:5]:
            print(f"error ({summary['request_rate']} rps): {error}", file=sys.stderr)
    if args.save_result and not run.interrupted:
        path = result_path(args, summary, sweep)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
        print(f"saved {path}")


@dataclass
class Outcome:
    """What ``_benchmark`` ran: a summary per rate, whether Ctrl-C cut it
    short, and for each rate where no request succeeded its first error."""

    summaries: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    failures: list[str] = field(default_factory=list)


async def _benchmark(args: argparse.Namespace, rates: list[float]) -> Outcome:
    """Run every rate, reporting each as it ends."""
    import httpx

    target = Target(args)
    # the dataset file is read (and checked) before the server is contacted
    dataset = (sharegpt_requests(args) if args.dataset_name == "sharegpt" else
               workload_requests(args) if args.dataset_name in ("w2", "w3") else None)
    outcome = Outcome()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        try:
            tokens_per_word = await discover(client, target)
            requests = dataset or random_requests(args, tokens_per_word)
            for request in requests[:args.num_warmups]:
                await send_request(client, target, request)
        except asyncio.CancelledError:
            outcome.interrupted = True
            return outcome
        for rate in rates:
            run = await run_load(client, target, requests, rate, args)
            summary = _summary(args, target, run, len(requests))
            _report(args, summary, run, sweep=len(rates) > 1)
            outcome.summaries.append(summary)
            if not summary["completed"] and run.results:
                error = " ".join(run.results[0].error.split())
                outcome.failures.append(f"at {summary['request_rate']} rps, first error: {error}")
            if run.interrupted:
                outcome.interrupted = True
                break
    return outcome


def run(args: argparse.Namespace) -> int:
    """``kvserve bench serve``: 0 when at least one request succeeded at every
    rate; 130 after Ctrl-C (what was measured is printed first)."""
    _check_args(args)
    rates = parse_rates(args.request_rate)
    parse_goodput(args.goodput)
    outcome = asyncio.run(_benchmark(args, rates))
    if outcome.interrupted:
        print("kvserve: interrupted", file=sys.stderr)
        return 130
    if args.plot:
        write_plot(args.plot, outcome.summaries)
        print(f"plot {args.plot}")
    if outcome.failures:
        print(f"kvserve: error: no request succeeded {'; '.join(outcome.failures)}",
              file=sys.stderr)
        return 1
    return 0
