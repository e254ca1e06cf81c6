"""Issue 26's figures on 4 or 8 GPUs of one host: the stages that fit the GPUs
found, split into calls of under 10 minutes, a table of the targets last.

    PYTHONPATH=. python benchmarks/multi_gpu.py OUT_DIR --plan          # the calls, no GPU used
    PYTHONPATH=. python benchmarks/multi_gpu.py OUT_DIR --call 1        # then --call 2, ...
    PYTHONPATH=. python benchmarks/multi_gpu.py OUT_DIR --stages w1-70b-tp4 ...   # a rerun
    PYTHONPATH=. python benchmarks/multi_gpu.py OUT_DIR --summary       # the tables again

Stages (``--gpus`` overrides the count ``torch.cuda.device_count()`` finds):

- ``w1-8b-tpN``: W1 (batch 1, prompt 128, 256 new) on the llama-3-8b preset at
  TP=1, 2, 4 (and 8): where all-reduce latency stops the scaling; also
  ``w1-8b-tpN-one-shot`` at the largest N; ``all-reduce-{nccl,one-shot}-tpN``
  (``benchmarks/all_reduce.py``, in a CUDA graph) at that N;
- ``peer-gptfast-tpN``: gpt-fast's own TP at the largest N, batch 1, on the
  same W1 (``benchmarks/gptfast_tp.py``; gpt-fast's files in the git-ignored
  ``.peers/gpt-fast/``);
- ``w1-70b-tpN`` / ``w2-70b-tpN``: the llama-3-70b preset (random bf16
  weights, drawn on each device) at TP=4 (and 8); on 8 GPUs W2 at TP=4 x PP=2
  against TP=8, and W1 at TP=2 where a GPU holds 70.6 GB of weights and its
  KV (H200);
- ``gpu-tests-N``: the tests of ``tests/gpu/test_parallel_gpu.py`` that split a
  model over more than 2 GPUs (``-k more_than_two``), on the N found.

Every stage runs in a session of its own under its own time limit (a hang
costs that stage, not the call: ``tensor_parallel.run_command``); a stage
starts only when its estimate fits before ``--deadline-s`` (default 570 s
after the call started: the device runs a command for at most 10 minutes),
and is cut at the deadline. Skipped stages are listed with the command that
reruns them. Every call ends with the tables of every JSON in OUT_DIR (a
row per run; tokens/s and MBU per GPU against the copy rate each run
measured in its own process), the 8B scaling plot (``w1-8b-scaling.txt``,
and ``.png`` when matplotlib is installed), and the targets: 70B W1 TP=8 >=
1.8x TP=2 on the same card type, 70B W1 MBU per GPU at TP=4 >= 65%.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.tensor_parallel import (
    Runs,
    bench_command,
    collect,
    mbu_per_gpu,
    ratio,
    run_command,
    torchrun_command,
    world,
    write_summary,
)
from kvserve.config import ModelConfig
from kvserve.models.presets import PRESETS, get_preset

MODEL_8B = ["--model", "llama-3-8b", "--load-format", "dummy", "--dtype", "bfloat16",
            "--disable-tqdm"]
MODEL_70B = ["--model", "llama-3-70b", "--load-format", "dummy", "--dtype", "bfloat16",
             "--disable-tqdm"]
# batch 1 replays the decode graph of one sequence only: capturing the others
# would cost start-up time (80 layers at 70B) and change no figure
W1 = ["--input-len", "128", "--output-len", "256", "--num-iters", "5", "--cuda-graph-sizes", "1"]
W2 = ["--workload", "w2"]
# a GPU with this much memory holds the 70B's TP=2 share (70.6 GB) and its KV
TP2_70B_MIN_GPU_BYTES = 120e9
DEFAULT_DEADLINE_S = 570.0
TESTS = "tests/gpu/test_parallel_gpu.py"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One command: its name (and JSON's), the call it belongs to, what it is
    expected to take and the most it may."""

    name: str
    call: int
    estimate_s: float
    limit_s: float
    command: list[str]


def tp_sizes(gpus: int) -> list[int]:
    return [t for t in (1, 2, 4, 8) if t <= gpus]


def plan_stages(gpus: int, gpu_bytes: float, out: Path) -> list[Stage]:
    """The stages for ``gpus`` GPUs of ``gpu_bytes`` each, in run order, by call."""
    if gpus < 4:
        raise ValueError(f"--gpus {gpus}: this benchmark is for 4 or 8 GPUs; "
                         "benchmarks/tensor_parallel.py covers 2")
    top = tp_sizes(gpus)[-1]
    eight = top >= 8
    stages = []

    def add(call: int, name: str, estimate_s: float, limit_s: float, command: list[str]) -> None:
        stages.append(Stage(name, call, estimate_s, limit_s, command))

    def w1(call: int, name: str, model: list[str], flags: list[str], estimate_s: float) -> None:
        add(call, name, estimate_s, 2 * estimate_s,
            bench_command("latency", name, [*model, *W1, *flags], out))

    for tp in tp_sizes(gpus):
        w1(1, f"w1-8b-tp{tp}", MODEL_8B, ["-tp", str(tp)], 50 if tp == 1 else 70)
    w1(1, f"w1-8b-tp{top}-one-shot", MODEL_8B, ["-tp", str(top), "--all-reduce", "one-shot"],
       70)
    for method in ("nccl", "one-shot"):
        name = f"all-reduce-{method}-tp{top}"
        add(1, name, 40, 120, torchrun_command("benchmarks/all_reduce.py", name,
                                               ["--method", method, "--mode", "graph"],
                                               out, nproc=top))
    gptfast = f"peer-gptfast-tp{top}"
    gptfast_command = torchrun_command("benchmarks/gptfast_tp.py", gptfast, [], out, nproc=top)
    if not eight:
        add(1, gptfast, 150, 300, gptfast_command)
    w1(2, f"w1-70b-tp{top}", MODEL_70B, ["-tp", str(top)], 120)
    add(2, f"w2-70b-tp{top}", 220, 420,
        bench_command("throughput", f"w2-70b-tp{top}", [*MODEL_70B, *W2, "-tp", str(top)], out))
    if eight:
        w1(2, "w1-70b-tp4", MODEL_70B, ["-tp", "4"], 120)
        add(3, "w2-70b-tp4-pp2", 240, 420, bench_command(
            "throughput", "w2-70b-tp4-pp2", [*MODEL_70B, *W2, "-tp", "4", "-pp", "2"], out))
        add(3, gptfast, 150, 300, gptfast_command)
        if gpu_bytes >= TP2_70B_MIN_GPU_BYTES:
            w1(4, "w1-70b-tp2", MODEL_70B, ["-tp", "2"], 150)
    # the splits over more than 2 GPUs (the 2-GPU ones are issue 21's run), last
    name = f"gpu-tests-{top}"
    add(max(s.call for s in stages), name, 150, 300, [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TESTS, "-k",
        "more_than_two", f"--junitxml={out / f'{name}.xml'}"])
    return stages


def print_plan(stages: list[Stage], gpus: int, out: Path) -> None:
    calls = sorted({s.call for s in stages})
    print(f"{gpus} GPUs: {len(calls)} calls of at most {DEFAULT_DEADLINE_S:.0f} s each")
    for call in calls:
        mine = [s for s in stages if s.call == call]
        total = sum(s.estimate_s for s in mine)
        print(f"\ncall {call} (~{total:.0f} s): PYTHONPATH=. python benchmarks/multi_gpu.py "
              f"{out} --call {call}")
        for s in mine:
            print(f"  {s.name:28s} ~{s.estimate_s:4.0f} s, limit {s.limit_s:4.0f} s: "
                  f"{' '.join(s.command)}")


def run_stages(stages: list[Stage], out: Path, deadline_s: float) -> bool:
    """Run ``stages`` in order, each while its estimate fits before the deadline."""
    start = time.monotonic()
    ok, skipped = True, []
    for stage in stages:
        left = deadline_s - (time.monotonic() - start)
        if stage.estimate_s > left:
            skipped.append(stage.name)
            continue
        ok &= run_command(stage.name, stage.command, min(stage.limit_s, left), out)
    if skipped:
        print(f"SKIPPED (past the {deadline_s:.0f} s deadline): rerun with --stages "
              f"{' '.join(skipped)}", file=sys.stderr)
    return ok and not skipped


# ------------------------------------------------------------------ summary


def _latency(runs: Runs, name: str) -> dict[str, Any] | None:
    r = runs.runs.get(name)
    return r if r and r.get("benchmark") == "latency" and r.get("decode_tok_s") else None


def scaling_lines(runs: Runs) -> list[str]:
    """The 8B W1 scaling as text bars: decode tok/s per TP size, its speed-up,
    the TPOT the copy rate alone allows (the weights a GPU reads over its copy
    rate), and what the measured all-reduce would add (2 a layer)."""
    points = sorted((world(r), r) for n, r in runs.runs.items()
                    if n.startswith("w1-8b-tp") and not n.endswith("one-shot")
                    and _latency(runs, n))
    if not points:
        return []
    base = points[0][1]["decode_tok_s"] if points[0][0] == 1 else None
    top = max(r["decode_tok_s"] for _, r in points)
    reduce_us = {r.get("world_size"): r["us_per_call"].get("8KiB")
                 for n, r in runs.runs.items()
                 if r.get("benchmark") == "all_reduce" and r.get("method") == "nccl"}
    lines = ["W1 llama-3-8b decode tok/s by TP size (bars: tok/s; bound: TPOT the copy rate "
             "allows; all-reduce: 2 x layers x the measured 8 KiB NCCL all-reduce in a graph)"]
    for tp, r in points:
        bound_ms = r["decode_step_bytes"] / tp / (r["copy_gb_s"] * 1e9) * 1e3
        bar = "#" * round(40 * r["decode_tok_s"] / top)
        extra = ""
        if reduce_us.get(tp) is not None and r.get("model") in PRESETS:
            layers = ModelConfig.from_hf_config(get_preset(r["model"])).num_layers
            extra = f", all-reduce {2 * layers * reduce_us[tp] / 1e3:.2f} ms"
        speedup = f" ({r['decode_tok_s'] / base:.2f}x TP=1)" if base else ""
        lines.append(f"TP={tp} {bar:40s} {r['decode_tok_s']:7.1f}{speedup}; TPOT "
                     f"{r['mean_tpot_ms']:.2f} ms, bound {bound_ms:.2f} ms{extra}")
    for name, tok_s in runs.decode.items():
        if name.startswith("gptfast-tp") and tok_s:
            lines.append(f"gpt-fast {name[len('gptfast-'):].upper()}: {tok_s:.1f} decode tok/s")
    return lines


def write_scaling_plot(runs: Runs, path: Path) -> bool:
    """``path`` (PNG): decode tok/s by TP size, ours, gpt-fast's and linear from
    TP=1; whether matplotlib was there to draw it."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    from matplotlib.figure import Figure

    w1 = sorted((world(r), r) for n, r in runs.runs.items()
                if n.startswith("w1-8b-tp") and not n.endswith("one-shot")
                and _latency(runs, n))
    if not w1:
        return False
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    sizes = [tp for tp, _ in w1]
    ax.plot(sizes, [r["decode_tok_s"] for _, r in w1], "o-", label="kvserve")
    ax.plot(sizes, [tp * r["copy_gb_s"] * 1e9 / r["decode_step_bytes"] for tp, r in w1], "--",
            color="grey", label="copy-rate bound")
    if sizes[0] == 1:
        ax.plot(sizes, [w1[0][1]["decode_tok_s"] * tp for tp in sizes], ":", color="grey",
                label="linear from TP=1")
    peers = sorted((int(n[len("gptfast-tp"):]), v) for n, v in runs.decode.items()
                   if n.startswith("gptfast-tp") and v)
    if peers:
        ax.plot([p for p, _ in peers], [v for _, v in peers], "s", label="gpt-fast")
    card = next(iter(runs.runs.values()))["card"]
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set(xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="tensor-parallel size",
           ylabel="decode tok/s (batch 1)", title=f"W1 llama-3-8b on {card}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# the engine's log lines (model_runner.py, multiproc_executor.py) that time start-up
_LOADED = re.compile(r"weights: ([\d.]+) GB in \S+, loaded in ([\d.]+) s")
_READY = re.compile(r"rank \d+ .* ready in ([\d.]+) s")


def startup_lines(out: Path) -> list[str]:
    """Per run: the slowest rank's weight loading (random weights drawn on the
    device) and its whole start-up, from ``OUT/*.log``."""
    lines = []
    for log in sorted(out.glob("w[12]-*.log")):
        text = log.read_text(errors="replace")
        loaded = [(float(gb), float(s)) for gb, s in _LOADED.findall(text)]
        ready = [float(s) for s in _READY.findall(text)]
        if loaded:
            gb, load_s = max(loaded, key=lambda pair: pair[1])
            whole = f", ready in {max(ready):.1f} s" if ready else ""
            lines.append(f"{log.stem}: {gb:.2f} GB of weights a rank drawn in {load_s:.1f} s"
                         f"{whole}")
    return lines


def summarize(out: Path) -> dict[str, Any]:
    """Start-up times, the scaling plot, then the runs' and the targets' tables (last)."""
    startup = startup_lines(out)
    if startup:
        print("start-up (slowest rank):\n" + "\n".join(startup) + "\n")
    runs = collect(out)
    lines = scaling_lines(runs)
    if lines:
        (out / "w1-8b-scaling.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines) + "\n")
        if write_scaling_plot(runs, out / "w1-8b-scaling.png"):
            print(f"plot: {out / 'w1-8b-scaling.png'}\n")
    return write_summary(out, runs, targets(runs))


def targets(runs: Runs) -> list[tuple[str, str]]:
    decode, output = runs.decode, runs.output
    rows = []
    w1_8 = {world(r): r["decode_tok_s"] for n, r in runs.runs.items()
            if n.startswith("w1-8b-tp") and not n.endswith("one-shot") and _latency(runs, n)}
    for tp in sorted(w1_8):
        if tp > 1:
            rows.append((f"8B W1 TP={tp} / TP=1", ratio(w1_8[tp], w1_8.get(1))))
    for name, tok_s in decode.items():
        if name.startswith("gptfast-tp"):
            tp = int(name[len("gptfast-tp"):])
            rows.append((f"8B W1 TP={tp} / gpt-fast TP={tp}", ratio(w1_8.get(tp), tok_s)))
            rows.append((f"8B W1 TP={tp} one-shot / NCCL",
                         ratio(decode.get(f"w1-8b-tp{tp}-one-shot"), w1_8.get(tp))))
    tp2, tp8 = _latency(runs, "w1-70b-tp2"), _latency(runs, "w1-70b-tp8")
    measured = "— (needs both runs on one card type)"
    if tp2 is not None and tp8 is not None and tp2["card"] == tp8["card"]:
        measured = ratio(tp8["decode_tok_s"], tp2["decode_tok_s"])
    rows.append(("70B W1 TP=8 / TP=2, same card (target >= 1.8x)", measured))
    for tp in (4, 8):
        r = _latency(runs, f"w1-70b-tp{tp}")
        target = " (target >= 65%)" if tp == 4 else ""
        rows.append((f"70B W1 MBU per GPU at TP={tp}{target}",
                     f"{100 * mbu_per_gpu(r):.1f}% of copy" if r else "—"))
    rows.append(("70B W2 TP=4 x PP=2 / TP=8",
                 ratio(output.get("w2-70b-tp4-pp2"), output.get("w2-70b-tp8"))))
    return rows


# ------------------------------------------------------------------ main


def _gpus() -> tuple[int, float]:
    """The CUDA devices here and the memory of the first (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0, 0.0
    return torch.cuda.device_count(), float(torch.cuda.get_device_properties(0).total_memory)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--plan", action="store_true", help="print the calls and exit")
    action.add_argument("--call", type=int, help="run this call's stages, then the summary")
    action.add_argument("--stages", nargs="+", help="run these stages, then the summary")
    action.add_argument("--summary", action="store_true", help="the tables of OUT's JSON")
    parser.add_argument("--gpus", type=int, default=None,
                        help="plan for this many GPUs (default: those CUDA finds)")
    parser.add_argument("--gpu-gb", type=float, default=None,
                        help="with --gpus: each GPU's memory in GB (default: the first's)")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                        help="start no stage whose estimate ends past this many seconds")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summary:
        summarize(args.out)
        return 0
    found, gpu_bytes = _gpus()
    gpus = args.gpus or found
    gpu_bytes = args.gpu_gb * 1e9 if args.gpu_gb else gpu_bytes
    try:
        stages = plan_stages(gpus, gpu_bytes, args.out)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.plan:
        print_plan(stages, gpus, args.out)
        return 0
    if args.call is not None:
        chosen = [s for s in stages if s.call == args.call]
    else:
        known = {s.name: s for s in stages}
        unknown = [n for n in args.stages if n not in known]
        if unknown:
            print(f"unknown stage(s) {unknown} for {gpus} GPUs; known: {', '.join(known)}",
                  file=sys.stderr)
            return 2
        chosen = [known[n] for n in args.stages]
    if not chosen:
        print(f"no call {args.call} for {gpus} GPUs (see --plan)", file=sys.stderr)
        return 2
    ok = run_stages(chosen, args.out, args.deadline_s)
    summarize(args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
