"""Calibration text -> ``[num_samples, seq_len]`` token windows.

``--calib`` is a text file (one document), a ``.jsonl`` file whose lines are
objects with a ``text`` string, or a directory whose ``.py`` / ``.txt`` files
(recursively, sorted) are the documents. Documents are shuffled with the
seed and tokenised with the model's own tokenizer (its special prefix, e.g.
BOS, included; EOS after each) into one stream until it holds twice the
tokens needed or the documents run out; the windows are ``num_samples``
distinct non-overlapping slices of it at seeded positions. Never fetches
anything; does not load the model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

TEXT_SUFFIXES = (".py", ".txt")


def read_calibration_texts(path: Path) -> list[str]:
    """The documents of ``--calib`` (see the module docstring)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        texts = [_read(p) for p in files]
    elif path.is_file() and path.suffix == ".jsonl":
        texts = _read_jsonl(path)
    elif path.is_file():
        texts = [_read(path)]
    else:
        raise ValueError(f"--calib {path}: no such file or directory")
    texts = [t for t in texts if t.strip()]
    if not texts:
        kinds = " / ".join(TEXT_SUFFIXES)
        raise ValueError(f"--calib {path}: no calibration text found (a text file, a .jsonl "
                         f"with a 'text' field, or a directory of {kinds} files)")
    return texts


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--calib: cannot read {path} as UTF-8 text ({e})") from e


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--calib {path}: line {number} is not JSON ({e})") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"--calib {path}: line {number} has no string field 'text'")
        texts.append(record["text"])
    return texts


def load_tokenizer(model_path: Path) -> Any:
    """The checkpoint's own tokenizer; a clear error where it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {model_path} has no usable tokenizer for the calibration "
                         f"text ({e})") from e


def calibration_windows(
    texts: list[str], tokenizer: Any, num_samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """``[num_samples, seq_len]`` int64 windows of the tokenised documents."""
    needed = num_samples * seq_len
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for index in order:
        encoded = tokenizer(texts[index], add_special_tokens=True, verbose=False)
        ids = encoded["input_ids"]
        stream += [*ids, eos] if eos is not None else ids
        if len(stream) >= 2 * needed:
            break
    if len(stream) < needed:
        raise ValueError(f"--calib: {len(stream)} calibration tokens, fewer than --num-samples "
                         f"{num_samples} x --seq-len {seq_len} = {needed}; give more text or "
                         "fewer / shorter samples")
    generator = torch.Generator().manual_seed(seed)
    num_slots = len(stream) // seq_len
    offset = int(torch.randint(len(stream) - num_slots * seq_len + 1, (1,), generator=generator))
    slots = torch.randperm(num_slots, generator=generator)[:num_samples].sort().values
    tokens = torch.tensor(stream[offset:offset + num_slots * seq_len], dtype=torch.int64)
    return tokens.view(num_slots, seq_len)[slots]
