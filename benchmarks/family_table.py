"""Issue 28's figures of trained bundled-family directories, one row each (markdown).

Reads each directory's ``metrics.json`` (``scripts/train_default_model.py``) and, when
present, its EAGLE head's ``train_log.json`` (``scripts/train_eagle_head.py``): held-out
bits per byte against the model before issue 28 (the run's own held-out files), the
stop / parse / chat (first and second turn) shares at the penalty the run chose, the
draft's α, the head's α and tokens per verification, and the training time.

    python benchmarks/family_table.py runs/v/*/ [--baseline-bpb 1.2047]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from variant_table import print_table

# the target's held-out bits per byte before issue 28 (decision 0041's baseline, 3.12 files)
BASELINE_BPB = 1.204660328456503


def row(run: Path, baseline: float) -> str:
    metrics: dict[str, Any] = json.loads((run / "metrics.json").read_text())
    bpb = metrics["target"]["heldout_bits_per_byte"]
    penalty = metrics["generation_defaults"]["chosen"]
    shares = next(r for r in metrics["stop_and_chat"] if r["repetition_penalty"] == penalty)
    head_log = run / "kvserve-code-eagle-head" / "train_log.json"
    head = "—"
    if head_log.is_file():
        eagle = json.loads(head_log.read_text())["engine"]["eagle"]
        head = f"{eagle['alpha_first']:.2f} / {eagle['mean_accepted_length']:.2f}"
    second = (f"{shares['second_turn_answer_share']:.0%} / {shares['second_turn_stop_share']:.0%}"
              if "second_turn_answer_share" in shares else "—")  # runs before the measure
    return (f"| {run.name} | {bpb:.3f} ({bpb / baseline - 1:+.1%}) | {penalty} "
            f"| {shares['stop_share']:.0%} / {shares['parse_share_of_stopped']:.0%} "
            f"| {shares['chat_function_share']:.0%} / {shares['chat_stop_share']:.0%} "
            f"| {second} "
            f"| {metrics['acceptance']['alpha']:.3f} | {head} | {metrics['total_s']:.0f} s |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="directories of training runs")
    parser.add_argument("--baseline-bpb", type=float, default=BASELINE_BPB)
    args = parser.parse_args(argv)
    return print_table(
        ["run", "bits per byte (vs before issue 28)", "penalty", "signatures stop / parse",
         "chat: function / stops", "second turn: answers / stops", "draft α",
         "EAGLE α / tokens per verification", "family time"],
        ["---"] + ["---:"] * 8, args.runs, "metrics.json",
        lambda run: row(run, args.baseline_bpb))

if __name__ == "__main__":
    sys.exit(main())
