"""The ``poisoned_empty`` fixture leaves ``with torch.device(...)`` blocks
working for later tests: torch caches the constructors such a block
redirects the first time it redirects one, and a cache filled while the
fixture's wrapper stood in for ``torch.empty`` put every later
``torch.empty`` on the CPU (an engine built on CUDA in a later test got
CPU parameters). Run in a fresh process, where that cache starts empty."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_blocks_still_place_torch_empty_after_the_fixture() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/unit/device_blocks_after_poisoned_empty.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout
