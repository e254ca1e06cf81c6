"""Module-level guard for the CPU kernel tests: run Triton kernels under
``TRITON_INTERPRET=1``, or skip the module, saying why (no Triton; CUDA present,
where the compiled kernels are tested instead since the interpreter switch is
process-wide; Triton imported earlier in the process without the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch


def require_interpreter(gpu_tests: str) -> None:
    """Call at the top of a test module, before any kernel module is imported."""
    if torch.cuda.is_available():
        pytest.skip(f"CUDA present: {gpu_tests} tests the compiled kernels",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when a kernel is decorated
    pytest.importorskip("triton")

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        # triton's own jit functions were decorated without the interpreter
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process; "
                    "run with TRITON_INTERPRET=1 in the environment", allow_module_level=True)
