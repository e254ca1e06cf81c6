"""A model's recommended sampling defaults, from its ``generation_config.json``
(vLLM's ``--generation-config auto | vllm | <folder>``).

``read_sampling_defaults`` reads the file once, at start-up, and keeps the
keys vLLM takes from it: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``); other keys
(``do_sample``, token ids, beam settings) are ignored, as vLLM ignores them.
``"auto"`` reads the model's directory, ``"vllm"`` reads nothing (the
engine's own defaults), any other value is a folder holding the file. A
request's own values always win: the defaults fill only the fields a
request leaves unset (``LLM.generate`` without ``sampling_params``, a server
request without the field). Nothing here changes a request.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
MODES = ("auto", "vllm")

# generation_config key -> (SamplingParams field, its type, its lowest allowed value,
# whether that lowest value is allowed)
_KEYS: dict[str, tuple[str, type, float, bool]] = {
    "temperature": ("temperature", float, 0.0, True),
    "top_p": ("top_p", float, 0.0, False),
    "top_k": ("top_k", int, -1, True),
    "min_p": ("min_p", float, 0.0, True),
    "repetition_penalty": ("repetition_penalty", float, 0.0, False),
    "max_new_tokens": ("max_tokens", int, 1, True),
}


def read_sampling_defaults(mode: str, model_path: str | None) -> dict[str, Any]:
    """The sampling defaults ``mode`` asks for (empty when there are none);
    ValueError naming the file and key when the file is malformed."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        if model_path is None:  # a preset with random weights: no directory
            return {}
        file = Path(model_path) / GENERATION_CONFIG_FILE
        if not file.is_file():
            return {}
    else:
        folder = Path(mode).expanduser()
        file = folder / GENERATION_CONFIG_FILE
        if not file.is_file():
            raise ValueError(f"generation_config='{mode}' is invalid: must be 'auto', 'vllm' or "
                             f"a folder holding {GENERATION_CONFIG_FILE}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation_config: {file} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {file} must hold a JSON object")
    return {field: _checked(file, key, raw[key], kind, low, low_ok)
            for key, (field, kind, low, low_ok) in _KEYS.items() if raw.get(key) is not None}


def _checked(file: Path, key: str, value: Any, kind: type, low: float, low_ok: bool) -> Any:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (number and float(value).is_integer()):
        raise ValueError(f"generation_config: {file}: {key}={value!r} must be an integer")
    if not number or not math.isfinite(value) or value < low or (value == low and not low_ok):
        bound = f">= {low:g}" if low_ok else f"> {low:g}"
        raise ValueError(f"generation_config: {file}: {key}={value!r} must be a number {bound}")
    return int(value) if kind is int else float(value)


def describe(defaults: dict[str, Any]) -> str:
    """``temperature=0.7, max_tokens=128`` (for the start-up log)."""
    return ", ".join(f"{name}={value}" for name, value in defaults.items())
