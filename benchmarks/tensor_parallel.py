"""Issue 21's figures on a 2-GPU machine, in one command: JSON per run, a
summary JSON, and a table of the targets last.

    PYTHONPATH=. python benchmarks/tensor_parallel.py OUT_DIR [STAGE ...]

Stages, in order (default: all but ``70b``):

- ``allreduce``: ``benchmarks/all_reduce.py`` for NCCL and the one-shot
  all-reduce, eager and in a CUDA graph (each under torchrun with its own
  time limit, so a hang costs one stage, not the run);
- ``w1``: ``kvserve bench latency`` (W1: batch 1, prompt 128, 256 new) on
  the llama-3-8b preset, random bf16 weights, at TP=1, TP=2 and TP=2 with
  ``--all-reduce one-shot``;
- ``gptfast``: gpt-fast's own TP=2 on the same W1 (``benchmarks/gptfast_tp.py``
  under torchrun; needs ``.peers/gpt-fast/``), the peer of the same call;
- ``w2``: ``kvserve bench throughput --workload w2`` at TP=1, TP=2 and PP=2;
- ``70b``: the llama-3-70b preset at TP=2, W1 and W2 (two H200s: it does
  not fit two H100s in bf16);
- ``summary``: the table below from every JSON in OUT_DIR (it also runs on a
  folder gathered from several calls).

The targets (issue 21): W1 TP=2 >= 1.6x TP=1 decode tok/s; W2 TP=2 >= 1.8x
and PP=2 >= 1.5x TP=1 output tok/s; 70B W1 MBU per GPU >= 70% of the copy
rate. MBU per GPU is ``kvserve bench``'s MBU (the whole model's bytes a step
reads, over one GPU's copy rate) divided by the ranks. A stage that fails is
reported and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = ["--model", "llama-3-8b", "--load-format", "dummy", "--dtype", "bfloat16",
         "--disable-tqdm"]
MODEL_70B = ["--model", "llama-3-70b", "--load-format", "dummy", "--dtype", "bfloat16",
             "--disable-tqdm"]
W1 = ["--input-len", "128", "--output-len", "256", "--num-iters", "5"]
STAGE_TIMEOUT_S = 1800
ALL_REDUCE_TIMEOUT_S = 300
STAGES = ("allreduce", "w1", "gptfast", "w2", "70b", "summary")
DEFAULT_STAGES = ("allreduce", "w1", "gptfast", "w2", "summary")


def run_command(name: str, command: list[str], timeout_s: float, out: Path) -> bool:
    """Run ``command`` (its output to ``OUT/name.log``) in a session of its own;
    whether it succeeded. Past ``timeout_s`` the whole session is killed (torchrun's
    ranks, an engine's workers), so a hang costs this command and frees the GPUs."""
    print(f"== {name} (limit {timeout_s:.0f} s): {' '.join(command)}", file=sys.stderr,
          flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    with open(out / f"{name}.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            print(f"FAILED: {name} ran past {timeout_s:.0f} s", file=sys.stderr)
            return False
        finally:
            with contextlib.suppress(ProcessLookupError):  # what the command left behind
                os.killpg(process.pid, signal.SIGKILL)
    print(f"   {name}: exit {code} after {time.monotonic() - start:.0f} s", file=sys.stderr,
          flush=True)
    if code:
        print(f"FAILED: {name} (exit {code}; see {out / name}.log)", file=sys.stderr)
    return code == 0


def bench_command(kind: str, name: str, flags: list[str], out: Path) -> list[str]:
    """``kvserve bench KIND FLAGS``, its JSON to ``OUT/name.json`` (INFO logs: each
    rank's start-up figures and times go to ``OUT/name.log``)."""
    return [sys.executable, "-m", "kvserve.cli", "--log-level", "INFO", "bench", kind, *flags,
            "--output-json", str(out / f"{name}.json")]


def torchrun_command(script: str, name: str, flags: list[str], out: Path,
                     nproc: int = 2) -> list[str]:
    """``script`` on ``nproc`` local ranks under torchrun, its JSON to ``OUT/name.json``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), script, *flags, "--output-json", str(out / f"{name}.json")]


def bench(kind: str, name: str, flags: list[str], out: Path,
          timeout_s: float = STAGE_TIMEOUT_S) -> bool:
    return run_command(name, bench_command(kind, name, flags, out), timeout_s, out)


def torchrun(script: str, name: str, flags: list[str], out: Path, timeout_s: float) -> bool:
    return run_command(name, torchrun_command(script, name, flags, out), timeout_s, out)


def run_stage(stage: str, out: Path) -> bool:
    ok = True
    if stage == "allreduce":
        for method in ("nccl", "one-shot"):
            for mode in ("eager", "graph"):
                ok &= torchrun("benchmarks/all_reduce.py", f"all-reduce-{method}-{mode}",
                                ["--method", method, "--mode", mode], out,
                                ALL_REDUCE_TIMEOUT_S)
    elif stage == "w1":
        ok &= bench("latency", "w1-tp1", [*MODEL, *W1], out)
        ok &= bench("latency", "w1-tp2", [*MODEL, *W1, "-tp", "2"], out)
        ok &= bench("latency", "w1-tp2-one-shot",
                     [*MODEL, *W1, "-tp", "2", "--all-reduce", "one-shot"], out)
    elif stage == "gptfast":
        ok &= torchrun("benchmarks/gptfast_tp.py", "peer-gptfast-tp2", [], out,
                        STAGE_TIMEOUT_S)
    elif stage == "w2":
        for name, flags in (("w2-tp1", []), ("w2-tp2", ["-tp", "2"]), ("w2-pp2", ["-pp", "2"])):
            ok &= bench("throughput", name, [*MODEL, "--workload", "w2", *flags], out)
    elif stage == "70b":
        ok &= bench("latency", "w1-70b-tp2", [*MODEL_70B, *W1, "-tp", "2"], out)
        ok &= bench("throughput", "w2-70b-tp2",
                     [*MODEL_70B, "--workload", "w2", "-tp", "2"], out)
    elif stage == "summary":
        summarize(out)
    return ok


def world(result: dict[str, Any]) -> int:
    """The processes a ``kvserve bench`` run used."""
    engine = result.get("engine_args") or {}
    return int(engine.get("tensor_parallel_size", 1)) * int(
        engine.get("pipeline_parallel_size", 1))


def mbu_per_gpu(result: dict[str, Any]) -> float:
    """``kvserve bench latency``'s MBU (the whole model's bytes a step reads over
    one GPU's copy rate) shared by the ranks: each GPU's own share of its copy rate."""
    return float(result["mbu_vs_copy"]) / world(result)


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}x"


@dataclass
class Runs:
    """Every JSON of a results folder: a row per run, and the figures targets compare."""

    runs: dict[str, dict[str, Any]]
    rows: list[tuple[str, str, str]]
    decode: dict[str, float | None]  # W1 runs and peers: decode tok/s
    output: dict[str, float | None]  # W2 runs: output tok/s


def collect(out: Path) -> Runs:
    """The rows and figures of every JSON in ``out`` but ``summary.json``."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))
            if p.stem != "summary"}
    rows: list[tuple[str, str, str]] = []
    decode = {n: r.get("decode_tok_s") for n, r in runs.items() if r.get("benchmark") == "latency"}
    output = {n: r.get("output_tok_s") for n, r in runs.items()
              if r.get("benchmark") == "throughput"}
    for name, r in runs.items():
        if r.get("benchmark") == "latency" and r.get("decode_tok_s"):
            rows.append((name, r["card"], f"{r['decode_tok_s']:.1f} decode tok/s "
                         f"({r['decode_tok_s'] / world(r):.1f} per GPU), TPOT "
                         f"{r['mean_tpot_ms']:.2f} ms, MBU per GPU "
                         f"{100 * mbu_per_gpu(r):.1f}% of copy"))
        elif r.get("benchmark") == "throughput":
            rows.append((name, r["card"], f"{r['output_tok_s']:,.0f} output tok/s "
                         f"({r['output_tok_s'] / world(r):,.0f} per GPU), {r['elapsed_s']:.1f} s"))
        elif r.get("benchmark") == "peers":
            for peer, p in r["peers"].items():
                rows.append((peer, r["card"], p.get("error") or (
                    f"{p['decode_tok_s']:.1f} decode tok/s, MBU per GPU "
                    f"{100 * p['mbu_per_gpu_vs_copy']:.1f}% of copy")))
                decode[peer] = p.get("decode_tok_s")
        elif r.get("benchmark") == "all_reduce":
            rows.append((name, r["card"], f"{r.get('world_size', 2)} ranks: " + ", ".join(
                f"{size} {us:.1f} µs" for size, us in r["us_per_call"].items())))
    return Runs(runs, rows, decode, output)


def write_summary(out: Path, runs: Runs, targets: list[tuple[str, str]]) -> dict[str, Any]:
    """Print the runs' table and the targets' table (last); write ``out/summary.json``."""
    commits = sorted({str(r.get("commit")) for r in runs.runs.values()})
    summary = {"runs": [{"run": a, "card": b, "figure": c} for a, b, c in runs.rows],
               "targets": dict(targets), "commits": commits}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"commit(s): {', '.join(commits)}\n")
    print("| run | card | figure |\n|---|---|---|")
    for row in runs.rows:
        print("| " + " | ".join(row) + " |")
    print("\n| target | measured |\n|---|---|")
    for target, measured in targets:
        print(f"| {target} | {measured} |")
    return summary


def summarize(out: Path) -> dict[str, Any]:
    """Issue 21's table of every JSON in ``out``; writes ``out/summary.json``."""
    runs = collect(out)
    decode, output = runs.decode, runs.output
    targets = [
        ("W1 TP=2 / TP=1 (target >= 1.6x)", ratio(decode.get("w1-tp2"), decode.get("w1-tp1"))),
        ("W1 TP=2 one-shot / TP=1", ratio(decode.get("w1-tp2-one-shot"), decode.get("w1-tp1"))),
        ("W1 TP=2 / gpt-fast TP=2", ratio(decode.get("w1-tp2"), decode.get("gptfast-tp2"))),
        ("W2 TP=2 / TP=1 (target >= 1.8x)", ratio(output.get("w2-tp2"), output.get("w2-tp1"))),
        ("W2 PP=2 / TP=1 (target >= 1.5x)", ratio(output.get("w2-pp2"), output.get("w2-tp1"))),
    ]
    return write_summary(out, runs, targets)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    stages = argv[1:] or list(DEFAULT_STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"unknown stage(s) {unknown}; known: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for stage in sorted(stages, key=STAGES.index):
        ok &= run_stage(stage, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
