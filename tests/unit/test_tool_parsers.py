"""Tool-call parsers (hermes / Qwen, llama3_json, mistral), the stream's
content boundary, and the schema that forces "required" / named calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.server.tool_parsers import (
    ToolCalling,
    forced_calls_schema,
    get_tool_parser,
    parse_forced_calls,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _calls(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict[str, object]]]]:
    content, calls = get_tool_parser(parser).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert _calls("hermes", text) == ("Let me check.\n", [("get_weather", {"city": "Oslo"}),
                                                        ("get_time", {})])
    assert _calls("qwen", "no calls here") == ("no calls here", [])
    assert _calls("hermes", "<tool_call>{broken</tool_call>") == (
        "<tool_call>{broken</tool_call>", [])


def test_llama3_json() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; ' \
           '{"name": "get_time", "parameters": {}}'
    assert _calls("llama3_json", text) == (None, [("get_weather", {"city": "Oslo"}),
                                                  ("get_time", {})])
    assert _calls("llama3_json", "It is sunny.") == ("It is sunny.", [])
    assert _calls("llama3_json", '{"not": "a call"}') == ('{"not": "a call"}', [])


def test_mistral() -> None:
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert _calls("mistral", text) == ("Sure. ", [("get_weather", {"city": "Oslo"})])
    assert _calls("mistral", "[TOOL_CALLS]oops") == ("[TOOL_CALLS]oops", [])
    with pytest.raises(ValueError, match="tool-call-parser"):
        get_tool_parser("nope")


def test_stream_content_stops_before_a_marker() -> None:
    hermes = get_tool_parser("hermes")
    assert hermes.content_end("Hello <tool") == len("Hello ")
    assert hermes.content_end("Hello <tool_call>{") == len("Hello ")
    assert hermes.content_end("Hello <b>") == len("Hello <b>")
    llama = get_tool_parser("llama3_json")
    assert llama.content_end(' {"name"') == 0 and llama.content_end("Hi") == 2


def test_forced_calls_schema_and_parse() -> None:
    schema = forced_calls_schema([WEATHER, TIME], None, parallel=False)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good * 2, schema)  # parallel_tool_calls false: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    assert forced_calls_schema([WEATHER, TIME], "get_time", True) == {"type": "object"}
    [call] = parse_forced_calls(json.dumps(good), None)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    calling = ToolCalling("named", "get_time", None, parallel=True)
    content, calls = calling.extract("{}")
    assert content is None and calls[0].name == "get_time"
    assert calling.finish_reason("stop", calls) == "stop"
    assert ToolCalling("required", None, None, True).finish_reason("stop", calls) == (
        "tool_calls")
