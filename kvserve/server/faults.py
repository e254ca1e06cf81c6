"""Test-only fault injection: make the model's forward raise, hang or slow down.

``kvserve serve`` calls ``inject_faults`` at start-up with what
``KVSERVE_FAULT_INJECT`` asks for (see ``kvserve/envs.py``); with the
variable unset nothing is wrapped. The e2e tests use it to check that a
forward that raises or hangs fails every in-flight request, turns
``/health`` to 503 and ends the process with a non-zero status.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from kvserve.envs import FaultInjection

logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The exception an injected ``raise_on_step`` fault raises."""


def inject_faults(executor: Any, faults: FaultInjection) -> None:
    """Wrap ``executor.execute_model`` so that it obeys ``faults`` (no-op if none)."""
    if not faults.enabled:
        return
    logger.warning("fault injection is on (%s): a testing hook, never for production", faults)
    original = executor.execute_model
    calls = itertools.count(1)
    never = threading.Event()

    def execute_model(scheduler_output: Any) -> Any:
        step = next(calls)
        if faults.step_delay_s:
            time.sleep(faults.step_delay_s)
        if step == faults.raise_on_step:
            raise InjectedFault(f"injected fault: forward {step} raised")
        if step == faults.hang_on_step:
            logger.warning("injected fault: forward %d hangs", step)
            never.wait()
        return original(scheduler_output)

    executor.execute_model = execute_model
