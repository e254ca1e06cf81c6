"""Reading and checking a PEFT LoRA adapter directory, without torch.

Owns PEFT's layout: ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``target_modules`` and flags) and the tensor names of
``adapter_model.safetensors``
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``), and
which of them kvserve can serve. Every refusal is a ValueError naming the
file, the field, its value and what is allowed. Tensor shapes are checked
against the model by ``LoRAManager``, which loads the tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF module name -> the decoder-layer submodule holding it
SUPPORTED_TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
_TENSOR_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$"
)
# flags whose non-default values change the math in ways we do not implement
_UNSUPPORTED_FLAGS: dict[str, Any] = {
    "use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
    "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
}


@dataclass(frozen=True)
class AdapterConfig:
    """What kvserve uses of ``adapter_config.json``."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """PEFT's ``lora_alpha / r``, applied to ``B @ A``."""
        return self.alpha / self.rank


def adapter_files(path: Path) -> tuple[Path, Path]:
    """``(adapter_config.json, adapter_model.safetensors)`` of an adapter directory,
    both checked to exist."""
    if not path.is_dir():
        raise ValueError(f"lora_path='{path}' is not a directory; pass a PEFT adapter directory "
                         f"holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    config, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config.is_file():
        raise ValueError(f"lora_path='{path}': {CONFIG_FILE} not found; a PEFT adapter directory "
                         f"holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    if not weights.is_file():
        found = " (adapter_model.bin is not supported: save with safetensors)" if (
            path / "adapter_model.bin").is_file() else ""
        raise ValueError(f"lora_path='{path}': {WEIGHTS_FILE} not found{found}")
    return config, weights


def read_adapter_config(path: Path, max_lora_rank: int) -> AdapterConfig:
    """Read and check ``path/adapter_config.json`` against what kvserve serves."""
    config_file, _ = adapter_files(path)
    where = f"{CONFIG_FILE} in '{path}'"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} is not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r} is not supported; allowed: 'LORA'")
    for name, default in _UNSUPPORTED_FLAGS.items():
        value = raw.get(name, default)
        if value and value != default:
            raise ValueError(f"{where}: {name}={value!r} is not supported; allowed: {default!r}")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r={rank!r} is invalid: must be an integer >= 1")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: r={rank} exceeds max_lora_rank={max_lora_rank}; start the "
                         f"engine with max_lora_rank >= {rank} (--max-lora-rank)")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"{where}: lora_alpha={alpha!r} is invalid: must be a number")
    return AdapterConfig(rank, float(alpha), _target_modules(raw.get("target_modules"), where))


def _target_modules(value: Any, where: str) -> tuple[str, ...]:
    allowed = ", ".join(SUPPORTED_TARGET_MODULES)
    if value == "all-linear":
        return tuple(SUPPORTED_TARGET_MODULES)
    if isinstance(value, str):
        raise ValueError(f"{where}: target_modules={value!r} (a regular expression) is not "
                         f"supported; list module names from: {allowed}, or 'all-linear'")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: target_modules={value!r} is invalid: list module names "
                         f"from: {allowed}")
    unsupported = [m for m in value if m not in SUPPORTED_TARGET_MODULES]
    if unsupported:
        raise ValueError(f"{where}: target_modules contains {unsupported}, which kvserve "
                         f"cannot serve; allowed: {allowed}")
    return tuple(value)


def parse_tensor_name(name: str) -> tuple[int, str, str]:
    """``(layer index, HF module name, "A" or "B")`` of a PEFT LoRA tensor name."""
    match = _TENSOR_RE.match(name)
    if match is None or SUPPORTED_TARGET_MODULES.get(match.group(3)) != match.group(2):
        raise ValueError(
            f"{WEIGHTS_FILE}: tensor '{name}' is not a LoRA weight kvserve can serve; expected "
            "base_model.model.model.layers.N.{self_attn,mlp}.MODULE.lora_{A,B}.weight with "
            f"MODULE one of {', '.join(SUPPORTED_TARGET_MODULES)}"
        )
    return int(match.group(1)), match.group(3), match.group(4)
