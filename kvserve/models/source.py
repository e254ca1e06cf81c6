"""From a model argument (a preset name or a local directory) to its
architecture: reads ``config.json`` or the preset, nothing else. Imports no
torch, so ``kvserve plan`` and the engine's argument parsing stay light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig
from kvserve.models.presets import PRESETS, get_preset, is_preset


def resolve_model_config(model: str) -> tuple[ModelConfig, Path | None]:
    """A preset name -> (its config, None); a local directory -> (its config.json, the path)."""
    if is_preset(model):
        return ModelConfig.from_hf_config(get_preset(model), source=f"preset '{model}'"), None
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model: '{path}' is not an existing directory nor a preset "
            f"({', '.join(sorted(PRESETS))}); hub downloads are not supported, "
            "pass a local checkpoint directory"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"model: {config_file} not found; a checkpoint directory needs config.json"
        )
    try:
        hf_config: Any = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model: {config_file} is not valid JSON ({e})") from e
    if not isinstance(hf_config, dict):
        raise ValueError(f"model: {config_file} must hold a JSON object")
    return ModelConfig.from_hf_config(hf_config, source=str(config_file)), path
