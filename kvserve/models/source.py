"""From a model argument (a preset name, a local directory or a Hugging
Face hub id) to its architecture: reads ``config.json`` or the preset,
nothing else. A hub id resolves to its snapshot in the hub's cache
(``kvserve/models/hub.py``), downloaded first if needed. Imports no torch,
so ``kvserve plan`` and the engine's argument parsing stay light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvserve.config import ModelConfig
from kvserve.models.hub import HubOptions, is_hub_id, snapshot
from kvserve.models.presets import PRESETS, get_preset, is_preset


def resolve_model_path(model: str, hub: HubOptions | None = None, weights: bool = False,
                       field: str = "model") -> Path:
    """A local directory as it is; a hub id as its snapshot directory (with its
    safetensors weights when ``weights``). ValueError naming ``field`` when it
    is neither."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(model):  # a path ("./x", "/x", "~/x") never is one
        try:
            return snapshot(model, hub or HubOptions(), weights)
        except ValueError as exc:
            if "/" in model:
                raise
            # a bare name is as likely a mistyped preset as a hub model
            raise ValueError(f"{exc}; presets: {', '.join(sorted(PRESETS))}") from None
    raise ValueError(
        f"{field}: '{path}' is not an existing directory, a preset "
        f"({', '.join(sorted(PRESETS))}) or a Hugging Face hub id (org/name)"
    )


def resolve_model_config(model: str, hub: HubOptions | None = None,
                         weights: bool = False) -> tuple[ModelConfig, Path | None]:
    """A preset name -> (its config, None); a local directory or a hub id ->
    (its config.json, its directory)."""
    if is_preset(model):
        return ModelConfig.from_hf_config(get_preset(model), source=f"preset '{model}'"), None
    path = resolve_model_path(model, hub, weights)
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
