"""What the host machine offers an engine that runs on the CPU: memory and cores.

- ``available_memory_bytes``: what the kernel says can be allocated now
  (``MemAvailable``), capped by the process's cgroup memory limit;
- ``usable_cores``: the cores this process may run on (its affinity, the
  cgroup CPU quota), and ``idle_cores``: how many of them sat idle over a
  short sample of ``/proc/stat``;
- ``configure_cpu_threads``: torch's intra-op thread count for the engine.

The thread rule (decision 0020): an explicit ``--num-cpu-threads``,
else ``OMP_NUM_THREADS`` when set, else the cores idle at start-up (at least
one, at most the usable ones). More threads than idle cores make every op's
barrier wait for a descheduled thread: decode of the bundled model fell from
about 30 to 6 tokens/s with 2 threads on a busy 2-core machine. It is
decided once per process (torch's setting is global) and logged. Linux files
are read when present; elsewhere the figures are None and the rules fall
back to torch's defaults. Imports torch only to apply the thread count.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve import envs

logger = logging.getLogger(__name__)

IDLE_SAMPLE_S = 0.2
# a core counts as idle from this share of a core up (1.75 idle cores -> 2 threads)
IDLE_ROUNDING = 0.25
# a cgroup memory limit at or above this means "no limit"
_NO_LIMIT_BYTES = 1 << 60


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _meminfo_bytes(field: str) -> int | None:
    text = _read("/proc/meminfo")
    for line in (text or "").splitlines():
        name, _, value = line.partition(":")
        if name == field and value.split():
            return int(value.split()[0]) * 1024
    return None


def _cgroup_memory_room() -> int | None:
    """Limit minus usage of the process's memory cgroup (v2, then v1), or None."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None:
            continue
        if limit.strip() == "max" or int(limit) >= _NO_LIMIT_BYTES:
            return None
        return max(0, int(limit) - int(usage))
    return None


def available_memory_bytes() -> int | None:
    """Bytes the process can still allocate without swapping, or None if unknown."""
    known = [value for value in (_meminfo_bytes("MemAvailable"), _cgroup_memory_room())
             if value is not None]
    return min(known) if known else None


def total_memory_bytes() -> int | None:
    return _meminfo_bytes("MemTotal")


def _cpu_quota() -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max``, v1 ``cfs_quota_us``), or None."""
    text = _read("/sys/fs/cgroup/cpu.max")
    if text is not None and text.split()[0] != "max":
        quota, period = text.split()[:2]
        return int(quota) / int(period)
    quota_text = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    period_text = _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota_text is not None and period_text is not None and int(quota_text) > 0:
        return int(quota_text) / int(period_text)
    return None


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by the CPU quota."""
    cores = len(_affinity())
    quota = _cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """Per CPU in ``cpus``: (idle + iowait jiffies, all jiffies), from /proc/stat."""
    times: dict[int, tuple[int, int]] = {}
    for line in (_read("/proc/stat") or "").splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or len(fields) < 5:
            continue
        cpu = int(name[3:])
        if cpu in cpus:
            values = [int(v) for v in fields]
            times[cpu] = (values[3] + values[4], sum(values[:8]))
    return times


def idle_cores(sample_s: float = IDLE_SAMPLE_S) -> float | None:
    """Cores of this process's affinity that sat idle over ``sample_s`` seconds
    (a fraction of a core counts as such), or None where /proc/stat is missing."""
    cpus = _affinity()
    before = _cpu_times(cpus)
    if not before:
        return None
    time.sleep(sample_s)
    after = _cpu_times(cpus)
    idle = 0.0
    for cpu, (idle_before, total_before) in before.items():
        idle_after, total_after = after.get(cpu, (idle_before, total_before))
        if total_after > total_before:
            idle += (idle_after - idle_before) / (total_after - total_before)
    return idle


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count and why it was chosen."""

    num_threads: int
    reason: str


def choose_num_threads(requested: int | None, env_threads: int | None, usable: int,
                       idle: float | None) -> ThreadChoice:
    """The rule of the module docstring, on figures measured by the caller."""
    if requested is not None:
        return ThreadChoice(requested, "--num-cpu-threads")
    if env_threads is not None:
        return ThreadChoice(env_threads, "OMP_NUM_THREADS")
    if idle is None:
        return ThreadChoice(usable, f"{usable} usable core{'s' if usable != 1 else ''}")
    num = max(1, min(usable, int(idle + IDLE_ROUNDING)))
    return ThreadChoice(num, f"{idle:.1f} of {usable} usable cores idle at start-up")


_chosen: dict[int | None, ThreadChoice] = {}


def configure_cpu_threads(requested: int | None) -> ThreadChoice:
    """Set torch's intra-op threads for a CPU engine (decided and logged once
    per process for each ``requested``)."""
    import torch

    choice = _chosen.get(requested)
    if choice is None:
        env_threads = envs.omp_num_threads()
        idle = None if requested is not None or env_threads is not None else idle_cores()
        choice = choose_num_threads(requested, env_threads, usable_cores(), idle)
        _chosen[requested] = choice
        logger.info("CPU: torch uses %d thread%s (%s%s)", choice.num_threads,
                    "s" if choice.num_threads != 1 else "", choice.reason,
                    "" if requested is not None else "; --num-cpu-threads to change")
    torch.set_num_threads(choice.num_threads)
    return choice
