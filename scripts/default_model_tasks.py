"""Task data for the bundled model: end-of-unit stop examples and a chat instruction set.

Owns the two corpus-derived data sets of issue 28 and their tensors, used by
scripts/train_default_model.py and benchmarks/bundled_model_quality.py:

- stop examples: each top-level `def`, `async def` or `class` of a file (decorators
  included), cut where `ast` says it ends, encoded `<|bos|> unit <|eos|>`, so a completion
  of a signature learns to end with the body;
- instruction pairs: user = a top-level function's docstring summary (with the signature or
  not, by a hash of the function's path and name), assistant = the function's source,
  rendered with the tokenizer's chat template, loss on the assistant tokens only.

Pure data: no model, no training loop, no kvserve import (it runs on a bare training machine).
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100
UNIT_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
FUNCTION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)
# How a user message opens, chosen per pair by hash; "" keeps the bare summary.
REQUEST_PREFIXES = ("", "Write a function that does this: ", "Write a Python function. ")


def _parse(text: str) -> ast.Module | None:
    if "\r" in text:  # ast's line numbers count a lone \r; split("\n") would not
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class Unit:
    """One top-level definition: its source (decorators through its last line, newline
    included), its kind, name, first line after the decorators and docstring (or None)."""

    path: str
    name: str
    kind: str  # "def" or "class" (async def counts as def)
    source: str
    signature: str
    docstring: str | None


def top_level_units(path: str, text: str) -> list[Unit]:
    """The top-level defs and classes of a file in source order; [] if it does not parse.
    A unit whose last line also holds other code (`def f(): pass; x = 1`) is skipped."""
    tree = _parse(text)
    if tree is None:
        return []
    lines = text.split("\n")
    units = []
    for node in tree.body:
        if not isinstance(node, UNIT_TYPES) or node.end_lineno is None:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        last_line = lines[node.end_lineno - 1]
        if last_line.encode()[node.end_col_offset or 0 :].strip():
            continue
        source = "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
        doc = ast.get_docstring(node, clean=True)
        units.append(
            Unit(
                path=path,
                name=node.name,
                kind="class" if isinstance(node, ast.ClassDef) else "def",
                source=source,
                signature=lines[node.lineno - 1].rstrip(),
                docstring=doc,
            )
        )
    return units


def stop_examples(files: list[tuple[str, str]], max_chars: int) -> list[str]:
    """Every top-level def and class of the files whose source has at most max_chars
    characters (longer ones never reach their end inside a training window)."""
    return [
        u.source for path, text in files for u in top_level_units(path, text)
        if len(u.source) <= max_chars
    ]


def summary_line(doc: str) -> str:
    return next((line.strip() for line in doc.split("\n") if line.strip()), "")


@dataclass(frozen=True)
class Instruction:
    """One chat pair: the user's request and the function that answers it."""

    path: str
    name: str
    user: str
    assistant: str
    with_signature: bool


def instruction_pairs(files: list[tuple[str, str]], max_chars: int) -> list[Instruction]:
    """A pair per top-level function with a docstring summary of at least 3 words and a
    source of at most max_chars. Half of the requests (by hash) also give the signature;
    the request's opening is one of REQUEST_PREFIXES (by hash too)."""
    pairs = []
    for path, text in files:
        for u in top_level_units(path, text):
            if u.kind != "def" or not u.docstring or len(u.source) > max_chars:
                continue
            summary = summary_line(u.docstring)
            if len(summary.split()) < 3:
                continue
            h = _hash(f"{path}::{u.name}")
            user = REQUEST_PREFIXES[h % len(REQUEST_PREFIXES)] + summary
            with_sig = (h >> 8) % 2 == 0
            if with_sig:
                user += f"\n\n{u.signature}"
            pairs.append(Instruction(path, u.name, user, u.source, with_sig))
    return pairs


def encode_examples(
    encode: Callable[[list[str]], list[list[int]]], texts: list[str], eos_id: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """`<|bos|> text <|eos|>` per example (encode adds <|bos|>), at most max_len tokens each
    (longer ones dropped), concatenated: the uint16 stream and each example's start offset."""
    chunks, starts, pos = [], [], 0
    for ids in encode(texts):
        if len(ids) + 1 > max_len:
            continue
        chunks.append(np.asarray([*ids, eos_id], dtype=np.uint16))
        starts.append(pos)
        pos += len(ids) + 1
    if not chunks:
        return np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.int64)
    return np.concatenate(chunks), np.asarray(starts, dtype=np.int64)


def conversation(pair: Instruction, earlier: Instruction | None = None) -> list[dict[str, str]]:
    """The messages asking for ``pair``: its request alone, or after ``earlier``'s request
    and answer (a second turn)."""
    history = [] if earlier is None else [{"role": "user", "content": earlier.user},
                                          {"role": "assistant", "content": earlier.assistant}]
    return [*history, {"role": "user", "content": pair.user}]


def second_turns(pairs: list[Instruction], max_chars: int = 1500
                 ) -> list[tuple[Instruction, Instruction]]:
    """(pair, earlier) with each pair asked after the next one in the list (cyclically)
    whose function has at most max_chars: second turns whose history holds another
    function and leaves room in the context. [] if no other pair is short enough."""
    short = [i for i, p in enumerate(pairs) if len(p.assistant) <= max_chars]
    turns = []
    for i, pair in enumerate(pairs):
        k = bisect.bisect_right(short, i)
        j = short[k] if k < len(short) else (short[0] if short else i)
        if j != i:
            turns.append((pair, pairs[j]))
    return turns


def chat_example(
    render: Callable[[list[dict[str, str]], bool], list[int]], pair: Instruction,
    earlier: Instruction | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and its labels: the last assistant turn's tokens
    (its content and closing <|end|>) are labels; everything the user, the template or an
    ``earlier`` turn wrote is IGNORE_INDEX. `render(messages, add_generation_prompt)` applies
    the chat template."""
    messages = conversation(pair, earlier)
    prompt = render(messages, True)
    full = render([*messages, {"role": "assistant", "content": pair.assistant}], False)
    if full[: len(prompt)] != prompt:
        raise ValueError(f"chat template: the prompt of {pair.path}::{pair.name} is not a prefix")
    labels = [IGNORE_INDEX] * len(prompt) + full[len(prompt) :]
    return full, labels


def sft_batches(
    examples: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int, seed: int
) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """A seeded sampler of right-padded (input ids, labels) batches, labels shifted by one so
    that labels[:, t] is the target of input position t; padding is IGNORE_INDEX."""
    rng = np.random.default_rng(seed)

    def draw() -> tuple[np.ndarray, np.ndarray]:
        picks = rng.integers(0, len(examples), batch_size)
        width = max(len(examples[i][0]) for i in picks) - 1
        ids = np.full((batch_size, width), pad_id, dtype=np.int64)
        labels = np.full((batch_size, width), IGNORE_INDEX, dtype=np.int64)
        for row, i in enumerate(picks):
            full, lab = examples[i]
            ids[row, : len(full) - 1] = full[:-1]
            labels[row, : len(full) - 1] = lab[1:]
        return ids, labels

    return draw
