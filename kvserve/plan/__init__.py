"""``kvserve plan``'s arithmetic: KV-cache size, fit, the roofline and the
step model that predicts kvserve's decode step and prefill on a card.

Pure arithmetic (no torch, no I/O, no runtime package: DESIGN.md section 1):
``gpus`` holds the GPU table (spec sheets and measured rates), ``counts`` the
inputs and byte / FLOP counts, ``step_model`` the engine's step on a card,
``planner`` the plan, ``utilization`` the one MBU and MFU, ``compare``
predicted beside measured, ``fit`` the step model's constants from a sweep,
``report`` the text, ``plot`` the optional matplotlib figures. The command
and the measuring live in ``kvserve/bench`` (``plan_cli``, ``plan_measure``).
"""

from __future__ import annotations

from kvserve.param_count import count_params
from kvserve.plan.counts import Hardware, PlanError, PlanInputs
from kvserve.plan.gpus import GPUS, GpuSpec, get_gpu
from kvserve.plan.planner import Plan, compute_plan

__all__ = [
    "GPUS",
    "GpuSpec",
    "Hardware",
    "Plan",
    "PlanError",
    "PlanInputs",
    "compute_plan",
    "count_params",
    "get_gpu",
]
