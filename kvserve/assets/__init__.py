"""Data shipped inside the wheel: the bundled model family (see
``assets/models/*/README.md`` and ``scripts/train_default_model.py``)."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "kvserve-code-14m"
DRAFT_MODEL = "kvserve-code-draft-2m"
LORA_ADAPTER = "kvserve-code-lora-tests"


def bundled_model_path(name: str) -> Path:
    """Path of a bundled model directory; a clear error if it is absent."""
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model: the bundled model '{name}' is missing from {MODELS_DIR}; "
            "reinstall kvserve or pass --model"
        )
    return path


def default_model_path() -> Path:
    return bundled_model_path(DEFAULT_MODEL)
