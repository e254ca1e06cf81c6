"""``kvserve plan``: KV-cache size, fit and roofline arithmetic from a model's architecture.

Pure arithmetic (no torch): ``gpus`` holds the GPU table, ``planner`` the
formulas, ``cli`` the command, ``plot`` the optional matplotlib figure.
"""

from __future__ import annotations

from kvserve.plan.cli import add_plan_parser, run_plan
from kvserve.plan.gpus import GPUS, GpuSpec, get_gpu
from kvserve.plan.planner import (
    Hardware,
    Plan,
    PlanError,
    PlanInputs,
    compute_plan,
    count_params,
)

__all__ = [
    "GPUS",
    "GpuSpec",
    "Hardware",
    "Plan",
    "PlanError",
    "PlanInputs",
    "add_plan_parser",
    "compute_plan",
    "count_params",
    "get_gpu",
    "run_plan",
]
