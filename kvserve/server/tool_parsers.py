"""Tool calls in model output: the formats of the model families kvserve
loads, chosen with ``--tool-call-parser``, and the JSON schema that makes
``tool_choice: "required"`` or a named function always parse.

- ``hermes`` (Qwen 2.5 / 3, Hermes): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call, text around them is content;
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole answer is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``),
  optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A parser returns the content left and the calls; output that does not
parse as its format is plain content (a model may answer in words). The
start marker tells a stream when to stop sending content and hold the rest
for the calls. Nothing here generates or touches the engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """Base: ``start`` marks where calls begin in the text."""

    start = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of ``text`` (a stream so far) can go out as content: up to
        the start marker, or up to a prefix of it still being written."""
        index = text.find(self.start)
        if index >= 0:
            return index
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class HermesToolParser(ToolParser):
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        # the text before the calls as it is (a stream has sent it so)
        return text[:text.find(self.start)] or None, calls


class Llama3JsonToolParser(ToolParser):
    start = "{"

    def content_end(self, text: str) -> int:
        # the answer is either all calls or all content: hold it while it may be a call
        stripped = text.removeprefix("<|python_tag|>").lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        index = 0
        while index < len(body):
            try:
                obj, end = decoder.raw_decode(body, index)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            index = end
            while index < len(body) and body[index] in " \n\t;":
                index += 1
        return None, calls


class MistralToolParser(ToolParser):
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        index = text.find(self.start)
        if index < 0:
            return text, []
        try:
            objs = json.loads(text[index + len(self.start):].strip())
        except ValueError:
            return text, []
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call(obj) for obj in objs]
        if not calls or any(call is None for call in calls):
            return text, []
        return text[:index] or None, [c for c in calls if c is not None]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser={name!r} is invalid: choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def forced_calls_schema(tools: list[dict[str, Any]], name: str | None,
                        parallel: bool) -> dict[str, Any]:
    """The JSON schema of the output for ``tool_choice`` "required" (an array
    of ``{"name", "arguments"}``, one item unless ``parallel``) or a named
    function (that function's arguments object)."""
    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object"}

    if name is not None:
        return parameters(next(t for t in tools if t["function"]["name"] == name))
    items = {"anyOf": [{
        "type": "object", "required": ["name", "arguments"], "additionalProperties": False,
        "properties": {"name": {"const": tool["function"]["name"]},
                       "arguments": parameters(tool)}} for tool in tools]}
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else
                                                                {"maxItems": 1})}


def parse_forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls of an output generated under ``forced_calls_schema`` (an
    output cut short by ``max_tokens`` is returned as the text it is)."""
    if name is not None:
        return [ToolCall(name, text)]
    try:
        objs = json.loads(text)
    except ValueError:
        return []
    return [call for call in map(_call, objs if isinstance(objs, list) else [])
            if call is not None]


@dataclass
class ToolCalling:
    """How one chat request's output turns into tool calls."""

    mode: str  # "auto" (the parser decides), "required", or "named"
    name: str | None  # the named function
    parser: ToolParser | None  # for "auto"
    parallel: bool  # parallel_tool_calls: more than one call allowed

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the calls of a finished output."""
        if self.mode == "auto":
            assert self.parser is not None
            content, calls = self.parser.parse(text)
        else:
            calls = parse_forced_calls(text, self.name)
            content = None if calls else text
        return content, calls if self.parallel else calls[:1]

    def streamable(self, text: str) -> int:
        """How much of a stream's text so far may go out as content."""
        if self.mode != "auto":
            return 0  # the whole output is the call
        assert self.parser is not None
        return self.parser.content_end(text)

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a named
        function forced by tool_choice finishes with "stop")."""
        return "tool_calls" if calls and reason == "stop" and self.mode != "named" else reason
