"""``speculative_config`` as users write it (a dict, or JSON on the command
line, with vLLM's keys) resolved into a checked ``SpeculativeConfig``.

Resolution reads the draft's or head's ``config.json`` (and compares
tokenizer files) but loads no weights, so a draft that cannot serve the
target is refused at start-up with the field, the value and what is
allowed: a vocabulary or tokenizer that differs from the target's, a
context shorter than ``max_model_len``, an EAGLE head whose hidden size is
not the target's. The bundled target uses the bundled draft by default.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvserve.assets import DEFAULT_MODEL, DRAFT_MODEL, MODELS_DIR, bundled_model_path
from kvserve.config import SPEC_METHODS, ModelConfig, SpeculativeConfig
from kvserve.models.source import resolve_model_config

KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
        "acceptance_rate", "forced_acceptance", "disable_by_batch_size", "auto_disable", "seed",
        "plan_ahead")
# the EAGLE head trained for the bundled target by scripts/train_eagle_head.py
EAGLE_HEAD = "kvserve-code-eagle-head"


def parse_speculative_config(raw: dict[str, Any] | str) -> dict[str, Any]:
    """A dict from the command line's JSON (or the dict given), keys checked."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config={raw!r} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config={raw!r} is invalid: must be a JSON object / dict")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: "
                         f"{', '.join(KEYS)}")
    return dict(raw)


def resolve_speculative_config(
    raw: dict[str, Any] | str | None, target: ModelConfig, target_path: Path | None,
    max_model_len: int,
) -> SpeculativeConfig | None:
    """The checked config, or None when speculation is off."""
    if raw is None:
        return None
    values = parse_speculative_config(raw)
    method = values.get("method")
    if method is None:  # vLLM: a model alone means a draft model; lookup keys mean n-gram
        method = ("draft_model" if values.get("model") else
                  "ngram" if "prompt_lookup_max" in values or "prompt_lookup_min" in values
                  else None)
        if method is None:
            raise ValueError("speculative_config.method is required: one of "
                             f"{', '.join(SPEC_METHODS)}")
    values["method"] = method
    if "num_speculative_tokens" not in values:
        raise ValueError("speculative_config.num_speculative_tokens is required: the tokens "
                         "proposed per step (k)")
    for field in ("prompt_lookup_min", "prompt_lookup_max"):  # vLLM: one given sets both
        other = "prompt_lookup_max" if field == "prompt_lookup_min" else "prompt_lookup_min"
        if field in values and other not in values:
            values[other] = values[field]
    if method in ("draft_model", "eagle"):
        values["model"] = str(_resolve_network(method, values.get("model"), target,
                                               target_path, max_model_len))
    elif values.get("model") is not None:
        raise ValueError(f"speculative_config.model={values['model']!r} is invalid with "
                         f"method={method!r}, which runs no network")
    try:
        return SpeculativeConfig(**values)
    except TypeError as e:  # a value of the wrong type
        raise ValueError(f"speculative_config: {e}") from e


def _is_bundled_target(target_path: Path | None) -> bool:
    return target_path is not None and target_path.resolve() == (MODELS_DIR / DEFAULT_MODEL
                                                                  ).resolve()


def _resolve_network(method: str, model: str | None, target: ModelConfig,
                     target_path: Path | None, max_model_len: int) -> Path | str:
    """The draft's or head's directory (or a preset draft), checked against the target."""
    if model is None:
        if method == "draft_model" and _is_bundled_target(target_path):
            model = str(bundled_model_path(DRAFT_MODEL))
        elif method == "eagle" and _is_bundled_target(target_path) and (
                MODELS_DIR / EAGLE_HEAD / "config.json").is_file():
            model = str(MODELS_DIR / EAGLE_HEAD)
        else:
            what = ("a draft model directory with the target's tokenizer" if method ==
                    "draft_model" else "an EAGLE head directory (scripts/train_eagle_head.py)")
            raise ValueError(f"speculative_config.model is required for method={method!r}: "
                             f"{what}")
    if method == "eagle":
        return _check_eagle_head(Path(model).expanduser(), target)
    draft, draft_path = resolve_model_config(model)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model={model!r}: the draft's vocab_size={draft.vocab_size} "
            f"differs from the target's vocab_size={target.vocab_size}; a draft must share "
            "the target's tokenizer")
    if draft_path is not None and target_path is not None:
        draft_tok, target_tok = _tokenizer_digest(draft_path), _tokenizer_digest(target_path)
        if draft_tok is not None and target_tok is not None and draft_tok != target_tok:
            raise ValueError(
                f"speculative_config.model={model!r}: the draft's tokenizer.json differs from "
                "the target's; a draft must share the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model={model!r}: the draft's max_position_embeddings="
            f"{draft.max_position_embeddings} is below max_model_len={max_model_len}; lower "
            "max_model_len or use a draft with a longer context")
    return draft_path if draft_path is not None else model


def _tokenizer_digest(path: Path) -> str | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _check_eagle_head(path: Path, target: ModelConfig) -> Path:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_config.model={str(path)!r}: {config_file} not found; an "
                         "EAGLE head directory holds config.json and model.safetensors")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"speculative_config.model: {config_file} is not valid JSON ({e})"
                         ) from e
    if config.get("architectures") != ["EagleHead"]:
        raise ValueError(f"speculative_config.model={str(path)!r}: architectures="
                         f"{config.get('architectures')!r} is not an EAGLE head "
                         "(['EagleHead'])")
    for field, expected in (("hidden_size", target.hidden_size),
                            ("vocab_size", target.vocab_size)):
        if config.get(field) != expected:
            raise ValueError(
                f"speculative_config.model={str(path)!r}: the head's {field}="
                f"{config.get(field)} does not fit the target's {field}={expected}")
    return path
