"""What a request's output must match: a JSON schema, any JSON object, a
regular expression, one of a few strings, or an EBNF grammar.

``StructuredOutputParams`` is plain data on ``SamplingParams`` (vLLM's
``structured_outputs`` names): it validates its own shape here, while the
grammar itself is compiled by ``engine/structured_output.py`` and enforced
by the sampler. Pure Python: no torch, no xgrammar here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or its JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (EBNF, xgrammar's dialect)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"json: the schema is not valid JSON: {exc}") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"json={self.json!r} is invalid: a JSON schema must be an object")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice: must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} is invalid: must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity (kind, canonical text): equal keys, one grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return "json", json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return "choice", json.dumps(value)
        return self.kind, "" if value is True else str(value)
