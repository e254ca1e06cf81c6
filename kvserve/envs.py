"""The only reader of ``os.environ`` in kvserve: one typed accessor per variable.

Everything configurable lives in flags; environment variables are kept for
secrets (so keys stay out of ``ps``) and for test-only hooks:

- ``KVSERVE_API_KEY``: default for ``kvserve serve --api-key`` (comma-separated
  for several keys).
- ``OPENAI_API_KEY``: default for ``kvserve bench serve --api-key``.
- ``OMP_NUM_THREADS``: when set, an engine on the CPU keeps torch's thread
  count (which honours it) instead of choosing one.
- ``KVSERVE_FAULT_INJECT``: **testing hook**, never set it in production. A
  comma-separated list of ``raise_on_step=K`` (the K-th forward raises),
  ``hang_on_step=K`` (the K-th forward blocks for good) and ``step_delay_s=X``
  (every forward sleeps X seconds first, to keep requests in flight),
  ``kv_send_delay_s=X`` (a prefill engine waits X seconds before sending
  the KV blocks of each pull: a slow or dying transfer). Read
  by ``kvserve serve`` at start-up and applied by wrapping the executor's
  ``execute_model`` (``kvserve/server/faults.py``).
- ``XDG_CACHE_HOME``: where the user's cache lives (``user_cache_dir``).
- torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` (or
  ``GROUP_RANK``) and ``NNODES`` (or ``WORLD_SIZE / LOCAL_WORLD_SIZE``): the
  defaults of ``--master-addr``, ``--master-port``, ``--node-rank`` and
  ``--nnodes`` (``torchrun_defaults``).

Worker processes of a parallel engine start from a forkserver: they take the
engine process's variables as they were when it started them
(``environ_snapshot`` / ``restore_environ``), and NVLink multicast is
switched off in each (``disable_nvlink_multicast``: it must stay off on the
machines we run on).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FAULT_INJECT_VAR = "KVSERVE_FAULT_INJECT"


@dataclass(frozen=True)
class FaultInjection:
    """What ``KVSERVE_FAULT_INJECT`` asks for (steps are counted from 1)."""

    raise_on_step: int | None = None
    hang_on_step: int | None = None
    step_delay_s: float = 0.0
    # a prefill engine waits this long before sending the KV of each pull
    kv_send_delay_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return (self.raise_on_step is not None or self.hang_on_step is not None
                or self.step_delay_s > 0)


def parse_fault_injection(text: str) -> FaultInjection:
    """Parse ``"raise_on_step=5,step_delay_s=0.1"``; ValueError naming the bad item."""
    values: dict[str, int | float | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        try:
            if not sep:
                raise ValueError
            if key in ("raise_on_step", "hang_on_step"):
                number: int | float = int(raw)
                if number < 1:
                    raise ValueError
            elif key in ("step_delay_s", "kv_send_delay_s"):
                number = float(raw)
                if not number >= 0:
                    raise ValueError
            else:
                raise KeyError(key)
        except KeyError:
            raise ValueError(
                f"{FAULT_INJECT_VAR}: unknown item '{item}'; known: raise_on_step=K, "
                "hang_on_step=K, step_delay_s=X, kv_send_delay_s=X"
            ) from None
        except ValueError:
            raise ValueError(
                f"{FAULT_INJECT_VAR}: '{item}' is invalid: steps must be integers >= 1, "
                "step_delay_s a number >= 0"
            ) from None
        values[key] = number
    return FaultInjection(**values)  # type: ignore[arg-type]


def fault_injection() -> FaultInjection:
    """The fault-injection testing hook (disabled when the variable is unset)."""
    return parse_fault_injection(os.environ.get(FAULT_INJECT_VAR, ""))


def _split_keys(text: str | None) -> list[str]:
    return [key.strip() for key in (text or "").split(",") if key.strip()]


def kvserve_api_keys() -> list[str]:
    """API keys from ``KVSERVE_API_KEY`` (comma-separated); empty when unset."""
    return _split_keys(os.environ.get("KVSERVE_API_KEY"))


def openai_api_key() -> str | None:
    """``OPENAI_API_KEY``, the key ``kvserve bench serve`` sends by default."""
    return os.environ.get("OPENAI_API_KEY") or None


def user_cache_dir() -> Path:
    """Where kvserve caches what it measured (``kvserve plan --calibrate``):
    ``$XDG_CACHE_HOME/kvserve``, by default ``~/.cache/kvserve``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve"


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer; None when unset or not one."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def torchrun_defaults() -> dict[str, str | int]:
    """What torchrun's variables say of the node layout: those of ``master_addr``,
    ``master_port``, ``node_rank`` and ``nnodes`` that are set."""
    env = os.environ
    found: dict[str, str | int] = {}
    if env.get("MASTER_ADDR"):
        found["master_addr"] = env["MASTER_ADDR"]
    for key, names in (("master_port", ("MASTER_PORT",)),
                       ("node_rank", ("NODE_RANK", "GROUP_RANK")), ("nnodes", ("NNODES",))):
        value = next((env[name] for name in names if env.get(name, "").isdigit()), None)
        if value is not None:
            found[key] = int(value)
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if "nnodes" not in found and world.isdigit() and local.isdigit() and int(local) > 0:
        found["nnodes"] = max(1, int(world) // int(local))
    return found


def environ_snapshot() -> dict[str, str]:
    """This process's environment, for a worker process to start from."""
    return dict(os.environ)


def restore_environ(snapshot: dict[str, str]) -> None:
    """Make this process's environment ``snapshot`` (a worker, at its start)."""
    os.environ.clear()
    os.environ.update(snapshot)


def disable_nvlink_multicast() -> None:
    """Keep NCCL's NVLink SHARP (NVLS) and torch's symmetric-memory multicast
    off in this process, whatever the environment says."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
