"""What every ``kvserve bench`` result carries and how it is shown: latency
percentiles with vLLM's key names, the run's environment (card, library
versions, commit), the JSON file and a Markdown table for the terminal."""

from __future__ import annotations

import json
import platform
import subprocess
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def latency_stats_ms(prefix: str, values_s: list[float],
                     percentiles: list[float]) -> dict[str, float]:
    """``mean_/median_/std_/p{P}_{prefix}_ms`` of ``values_s`` (0 when empty, as vLLM does)."""
    import numpy as np

    values = np.array(values_s or [0.0]) * 1000.0
    stats = {f"mean_{prefix}_ms": float(values.mean()),
             f"median_{prefix}_ms": float(np.median(values)),
             f"std_{prefix}_ms": float(values.std())}
    for p in percentiles:
        stats[f"p{percentile_key(p)}_{prefix}_ms"] = float(np.percentile(values, p))
    return stats


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return None


def git_commit() -> str | None:
    """The short hash of the checkout kvserve runs from (``+`` when tracked files
    are modified), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+" if dirty else "")


def environment() -> dict[str, Any]:
    """Date, library versions and commit, for the top of a result."""
    from kvserve import __version__

    return {"date": datetime.now().isoformat(timespec="seconds"), "kvserve": __version__,
            "commit": git_commit(), "python": platform.python_version(),
            "torch": _version("torch"), "triton": _version("triton"),
            "transformers": _version("transformers")}


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (nothing when None); NaN or inf is an error."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    print(f"saved {path}")


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    """A two-column Markdown table, ready to paste into docs/benchmarks.md."""
    print(f"\n| {title} | |\n|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")


def run_parts(out: Path, wanted: str, parts: dict[str, Callable[[], Any]], title: str,
              table: Callable[[dict[str, Any]], str]) -> int:
    """A benchmark script's parts: each of the comma-separated ``wanted`` run
    in order, its result in ``out/<part>.json``; then ``out/summary.json``
    with the card and torch version, and ``table`` of every result printed
    under ``title``."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for part in wanted.split(","):
        if part not in parts:
            raise SystemExit(f"--parts: unknown part {part!r}; known: {', '.join(parts)}")
        results[part] = parts[part]()
        (out / f"{part}.json").write_text(json.dumps(results[part], indent=2) + "\n")
    env = {"torch": torch.__version__,
           "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (out / "summary.json").write_text(json.dumps({"env": env, **results}, indent=2) + "\n")
    print(f"\n{title} ({env['card']}, torch {env['torch']})\n")
    print(table(results))
    return 0
