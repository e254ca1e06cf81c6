"""``kvserve plan --calibrate``: measure this machine's card once and cache it.

Measures the device-to-device copy rate and the matmul rates (bf16 and,
on CUDA cards that have it, FP8; float32 on the CPU, the engine's dtype
there) with ``device_rates``, and the device's memory, and writes them to
``<user cache>/calibration.json`` (``envs.user_cache_dir``), one entry per
card name. Later plans read it:
``--gpu NAME`` takes the calibrated rates of a card that matches NAME's
table entry over the shipped table's, and ``--gpu local`` plans for the
calibrated card itself (one not in the table too). The step model's
efficiencies are not measured here: they come from a fitted sweep
(``kvserve plan --fit``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from kvserve.envs import user_cache_dir
from kvserve.plan.counts import PlanError
from kvserve.plan.gpus import GpuSpec, gpu_for_device_name

CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class Calibration:
    """What ``--calibrate`` measured on one card."""

    card: str  # the device's name, as CUDA (or the CPU) reports it
    gpu: str | None  # its entry in the GPU table, if any
    device: str  # "cuda" or "cpu"
    memory_gb: float
    copy_gb_s: float
    matmul_tflop_s: float  # bf16 on CUDA, float32 (the engine's dtype there) on the CPU
    matmul_dtype: str
    fp8_tflop_s: float | None
    measured_at: str

    @property
    def source(self) -> str:
        return f"calibrated on this machine ({self.card}, {self.measured_at}; {cache_path()})"

    def as_gpu(self) -> GpuSpec:
        """The card as a table entry (``--gpu local``): its measured rates stand
        in for the spec sheet's, which may be unknown."""
        return GpuSpec("local", f"{self.card} (calibrated)", self.memory_gb, self.copy_gb_s,
                       self.matmul_tflop_s, self.fp8_tflop_s)


def cache_path() -> Path:
    return user_cache_dir() / CALIBRATION_FILE


def _read_all() -> dict[str, dict[str, object]]:
    path = cache_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError("--calibrate", f"cannot read {path}: {e}; delete it and calibrate "
                                       "again") from e
    return data if isinstance(data, dict) else {}


def load_all() -> list[Calibration]:
    """Every card calibrated on this machine, the most recent first."""
    entries = []
    for card, record in _read_all().items():
        try:
            entries.append(Calibration(**record))  # type: ignore[arg-type]
        except TypeError as e:
            raise PlanError("--calibrate", f"{cache_path()}: the entry of '{card}' is not a "
                                           f"calibration ({e}); calibrate again") from e
    return sorted(entries, key=lambda c: c.measured_at, reverse=True)


def find(gpu_name: str) -> Calibration | None:
    """The calibration of a card matching table entry ``gpu_name`` ("local":
    the most recent of any card), or None."""
    for entry in load_all():
        if gpu_name == "local" or entry.gpu == gpu_name:
            return entry
    return None


def _memory_gb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def calibrate(device: str) -> Calibration:
    """Measure the card (``device`` "cuda" or "cpu") and cache what was measured."""
    import torch

    from kvserve.bench.device_rates import (
        copy_rate_gb_s,
        device_name,
        fp8_matmul_tflop_s,
        matmul_tflop_s,
    )

    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--calibrate", "no CUDA device is available; use --device cpu to "
                                       "calibrate the CPU")
    target = torch.device(device)
    card = device_name(target)
    spec = gpu_for_device_name(card) if device == "cuda" else None
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    entry = Calibration(
        card=card, gpu=spec.name if spec else None, device=device,
        memory_gb=_memory_gb(device), copy_gb_s=copy_rate_gb_s(device=target),
        matmul_tflop_s=matmul_tflop_s(device=target, dtype=dtype),
        matmul_dtype=str(dtype).removeprefix("torch."),
        fp8_tflop_s=fp8_matmul_tflop_s() if device == "cuda" else None,
        measured_at=datetime.now().isoformat(timespec="seconds"))
    records = _read_all()
    records[card] = asdict(entry)
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")
    return entry
