"""The markdown table of a set of training-run directories, one row each: shared by
``family_table.py`` and ``eagle_table.py``. A directory without its result file is a
variant that failed: it gets a row saying so, and the exit status becomes 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def print_table(header: list[str], align: list[str], dirs: list[Path], result_file: str,
                row: Callable[[Path], str]) -> int:
    """Print the header, then ``row(dir)`` for each directory holding ``result_file``;
    1 if any lacks it, else 0."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(align) + "|")
    missing = 0
    for run in dirs:
        if (run / result_file).is_file():
            print(row(run))
        else:
            print(f"| {run.name} | no {result_file}: the run failed (see its log) |")
            missing += 1
    return 1 if missing else 0
