"""A fixed set of 20 JSON schemas for structured-output checks: objects,
nesting, arrays, enums, consts, numbers with bounds, nullable and optional
fields, ``anyOf``, ``$ref``. Strings and arrays are bounded so a small
model always finishes inside ``max_tokens``."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "point"},
                                      "x": {"type": "integer", "minimum": -9, "maximum": 9},
                                      "y": {"type": "integer", "minimum": -9, "maximum": 9}},
     "required": ["kind", "x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME,
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                "maximum": 999},
                                         "name": NAME},
        "required": ["id", "name"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"note": {"anyOf": [NAME, {"type": "null"}]}},
     "required": ["note"], "additionalProperties": False},
    {"type": "object", "properties": {"a": NAME, "b": {"type": "boolean"}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none", "many"]}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"lang": {"enum": ["python", "c", "go"]},
                                      "lines": {"type": "integer", "minimum": 1,
                                                "maximum": 500}},
     "required": ["lang", "lines"], "additionalProperties": False},
    {"type": "boolean"},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"], "additionalProperties": False}}},
     "required": ["points"], "additionalProperties": False},
    {"$defs": {"leaf": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                "maximum": 9}},
                        "required": ["id"], "additionalProperties": False}},
     "type": "object", "properties": {"first": {"$ref": "#/$defs/leaf"},
                                      "second": {"$ref": "#/$defs/leaf"}},
     "required": ["first", "second"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]},
                                      "priority": {"type": "integer", "minimum": 1,
                                                   "maximum": 5},
                                      "title": NAME},
     "required": ["status", "priority", "title"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["ratio"], "additionalProperties": False},
]
