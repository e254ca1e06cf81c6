"""EAGLE head variants side by side, one row each (markdown).

Reads each head directory's ``train_log.json`` (``scripts/train_eagle_head.py``: training
steps, held-out teacher-forced top-1 agreement per chained step, the engine's α and tokens
per verification on the script's held-out prompts) and, when present, the benchmark of
``benchmarks/spec_decode.py --parts real`` in ``DIR-real/real.json`` (α, tokens per
verification, tok/s against plain decoding, greedy tokens as plain).

    python benchmarks/eagle_table.py runs/h/final-only runs/h/aux-2-4-5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from variant_table import print_table


def row(head: Path) -> str:
    log: dict[str, Any] = json.loads((head / "train_log.json").read_text())
    aux = log["args"].get("aux_layers") or []
    agreement = " ".join(f"{a:.2f}" for a in log["heldout_agreement"])
    eagle = log["engine"]["eagle"]
    cells = [head.name, ",".join(map(str, aux)) or "—", str(log["train"]["steps"]), agreement,
             f"{eagle['alpha_first']:.2f} / {eagle['mean_accepted_length']:.2f}"]
    real = head.parent / f"{head.name}-real" / "real.json"
    if real.is_file():
        bench = json.loads(real.read_text())
        e = bench["eagle"]
        cells.append(f"{e['alpha_first']:.2f} / {e['mean_accepted_length']:.2f} / "
                     f"{e['decode_tok_s']:.0f} of {bench['plain']['decode_tok_s']:.0f} tok/s"
                     f"{'' if e['same_tokens_as_plain'] else ' (tokens differ)'}")
    else:
        cells.append("—")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+", type=Path, help="head directories")
    args = parser.parse_args(argv)
    return print_table(
        ["head", "aux layers", "steps", "held-out top-1 agreement per step",
         "α / tokens per verification (script's prompts)",
         "benchmark: α / tokens per verification / speed"],
        ["---", "---", "---:", "---", "---:", "---:"], args.heads, "train_log.json", row)

if __name__ == "__main__":
    sys.exit(main())
