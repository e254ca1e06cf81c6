"""The decode path's kernels compile for sm_90 on a machine with no GPU
(``tests/compile_kernels_sm90.py``, in a process without the interpreter).
The interpreter tests run the kernels but never trace their
programmatic-dependent-launch branches, and the interpreter accepts code the
compiler rejects. Skipped without Triton or without its bundled ``ptxas``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_decode_kernels_compile_for_hopper() -> None:
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file() and not os.environ.get("TRITON_PTXAS_PATH"):
        pytest.skip(f"no ptxas at {ptxas} and TRITON_PTXAS_PATH unset")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.compile_kernels_sm90"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiled for sm_90" in result.stdout
