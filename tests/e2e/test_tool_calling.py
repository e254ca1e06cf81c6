"""Tool calling against a real server with the official ``openai`` client:
named and "required" tool_choice enforced by the grammar (the arguments
always parse and validate), ``parallel_tool_calls``, the template given
the tools, and "auto" with ``--tool-call-parser hermes``, streamed as
OpenAI streams calls (the SDK's accumulated deltas equal the whole
response's calls)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess, launch

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}
MESSAGES: list[Any] = [{"role": "user", "content": "weather in Oslo?"}]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                         max_retries=0)


def _check(call: Any) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_named_and_required(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60,
        temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"  # type: ignore[union-attr]
    _check(call)
    for seed in range(3):
        required = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=90,
            temperature=1.0, seed=seed, tool_choice="required", parallel_tool_calls=False)
        choice = required.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        _check(choice.message.tool_calls[0])
    none = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                          tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None


FORCED_CALL = (r'Ok\. <tool_call>\{"name":"get_time","arguments":'
               r'\{"zone":"(utc|cet)"\}\}</tool_call>')


@pytest.fixture(scope="module")
def hermes_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    server = launch(tiny_model, tmp_path_factory.mktemp("hermes") / "server.log",
                    ["--tool-call-parser", "hermes"])
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_with_the_hermes_parser(hermes_server: ServerProcess, stream: bool) -> None:
    client = _client(hermes_server)
    # the tiny random model is made to answer in the hermes format by a regex
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                                  max_tokens=95, extra_body={"guided_regex": FORCED_CALL})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Ok. "
        assert choice.message.tool_calls is not None
        _check(choice.message.tool_calls[0])
        return
    content, calls, finish = "", {}, None
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            if part.function is not None:
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Ok. " and finish == "tool_calls"
    assert calls[0]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"])["zone"] in ("utc", "cet")


def test_plain_answer_with_tools_is_content(hermes_server: ServerProcess) -> None:
    client = _client(hermes_server)
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=30,
        extra_body={"guided_regex": "It is sunny"})
    choice = result.choices[0]
    assert choice.message.content == "It is sunny" and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
