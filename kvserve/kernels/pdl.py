"""Programmatic dependent launch (PDL) for the decode path's kernels on Hopper.

A kernel launched with ``launch_pdl=True`` may start while the kernel before
it is still running: its programs do what needs nothing from that kernel
(load constant weights, read the step's block table), call ``gdc_wait()``
before reading anything it wrote, and call ``gdc_launch_dependents()`` once
the next kernel may start doing the same. A kernel before which nothing
triggers (a torch op, a copy) starts as usual, so PDL kernels mix freely
with others; every PDL kernel waits before its first dependent read, so the
order of results is the stream's. CUDA graphs keep the dependency.

``use_pdl(device)`` is the launchers' switch: a CUDA device of compute
capability 9.0 or later (``set_pdl(False)`` turns it off, for comparisons).
"""

from __future__ import annotations

import functools

import torch

_enabled = True


def set_pdl(enabled: bool) -> None:
    """Turn programmatic dependent launch on or off for later launches (and captures)."""
    global _enabled
    _enabled = enabled


@functools.lru_cache(maxsize=8)
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def use_pdl(device: torch.device) -> bool:
    """Whether a launch on ``device`` uses programmatic dependent launch."""
    return _enabled and _supported(device)
