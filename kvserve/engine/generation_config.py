"""A model's recommended sampling defaults, from its ``generation_config.json``
(vLLM's ``--generation-config auto | vllm | <folder>``).

``read_sampling_defaults`` reads the file once, at start-up, and keeps the
keys vLLM takes from it: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``), and
llama.cpp's DRY keys (``dry_multiplier``, ``dry_base``, ``dry_allowed_length``,
``dry_penalty_last_n``, ``dry_sequence_breakers``); other keys (``do_sample``,
token ids, beam settings) are ignored, as vLLM ignores them.
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
    "dry_multiplier": ("dry_multiplier", float, 0.0, True),
    "dry_base": ("dry_base", float, 1.0, False),
    "dry_allowed_length": ("dry_allowed_length", int, 1, True),
    "dry_penalty_last_n": ("dry_penalty_last_n", int, -1, True),
}
# generation_config keys holding lists of strings
_STRING_LIST_KEYS = ("dry_sequence_breakers",)


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
    defaults = {field: _checked(file, key, raw[key], kind, low, low_ok)
                for key, (field, kind, low, low_ok) in _KEYS.items() if raw.get(key) is not None}
    for key in _STRING_LIST_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"generation_config: {file}: {key}={value!r} must be a list of "
                             "non-empty strings")
        defaults[key] = list(value)
    return defaults


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
