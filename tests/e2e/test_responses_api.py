"""``/v1/responses`` against a real server with the official ``openai``
client: the output equals the chat completion of the same conversation
(greedy), streamed events come in OpenAI's order and add up to the
non-streamed response, ``text.format`` constrains the output,
``previous_response_id`` continues a stored conversation (and GET returns
it), function tools give ``function_call`` items whose results go back as
``function_call_output``, and bad input is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any, Union

import httpx
import jsonschema
import openai
import pytest
from pydantic import TypeAdapter

from kvserve.server.responses_protocol import STREAM_EVENTS, ResponseObject
from tests.e2e.conftest import MODEL_NAME, ServerProcess

SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME_TOOL: dict[str, Any] = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                         max_retries=0)


def _chat(client: openai.OpenAI, messages: list[Any], max_tokens: int) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                          max_tokens=max_tokens, temperature=0.0).choices[0]


def _same_as_chat(response: Any, choice: Any) -> None:
    assert response.output_text == choice.message.content
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_text_and_message_items_equal_chat(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    response = client.responses.create(model=MODEL_NAME, input="def add(a, b):",
                                        max_output_tokens=6, temperature=0.0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL_NAME and isinstance(response.created_at, float | int)
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    _same_as_chat(response, _chat(client, [{"role": "user", "content": "def add(a, b):"}], 6))
    usage = response.usage
    assert usage is not None and usage.output_tokens <= 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    items: Any = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "hi "}, {"type": "input_text", "text": "x"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
        {"role": "user", "content": "and?"}]
    response = client.responses.create(model=MODEL_NAME, input=items, instructions="system says",
                                       max_output_tokens=5, temperature=0.0)
    _same_as_chat(response, _chat(client, [
        {"role": "system", "content": "system says"}, {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi x"}, {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and?"}], 5))


def test_stream_events_add_up(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, input="x = ", max_output_tokens=8,
                                  temperature=0.0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == whole.output_text == final.output_text
    assert final.status == whole.status and final.usage is not None and whole.usage is not None
    # the second run reads the prompt from the prefix cache
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)


def test_raw_bodies_match_the_documented_models(serve_tiny: ServerProcess) -> None:
    """What the OpenAPI document says of a response and each event (with
    and without tools), checked on the raw bodies; the stream has no [DONE]."""
    events = TypeAdapter(Union[tuple(STREAM_EVENTS)])  # noqa: UP007
    for extra in ({}, {"tools": [TIME_TOOL], "tool_choice": "required"}):
        body = {"model": MODEL_NAME, "input": "x", "max_output_tokens": 30, **extra}
        reply = httpx.post(serve_tiny.url + "/v1/responses", json=body, timeout=60)
        ResponseObject.model_validate(reply.json())
        with httpx.stream("POST", serve_tiny.url + "/v1/responses",
                          json={**body, "stream": True}, timeout=60) as stream:
            lines = [line for line in stream.iter_lines() if line]
        for name, data in zip(lines[::2], lines[1::2], strict=True):
            event = json.loads(data.removeprefix("data: "))
            assert name == "event: " + event["type"]
            events.validate_python(event)


def test_text_format_and_stream_helper(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    text: Any = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA,
                            "strict": True}}
    for seed in range(3):
        response = client.responses.create(model=MODEL_NAME, input="trip?", text=text,
                                           max_output_tokens=60, temperature=1.0,
                                           extra_body={"seed": seed})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
    with client.responses.stream(model=MODEL_NAME, input="trip?", text=text,
                                 max_output_tokens=60, temperature=0.0) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    response = client.responses.create(model=MODEL_NAME, input="{", max_output_tokens=60,
                                       text={"format": {"type": "json_object"}})
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_previous_response_id_and_retrieve(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    first = client.responses.create(model=MODEL_NAME, input="one", max_output_tokens=4,
                                    temperature=0.0, instructions="only for the first")
    second = client.responses.create(model=MODEL_NAME, input="two", max_output_tokens=4,
                                     temperature=0.0, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    _same_as_chat(second, _chat(client, [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "two"}], 4))
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_nope")
    assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_delete_and_cancel(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    items: Any = [{"role": "user", "content": "first", "id": "msg_mine"},
                  {"type": "message", "role": "assistant", "content": "second"},
                  {"role": "user", "content": [{"type": "input_text", "text": "third"}]}]
    response = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=2)
    listed = client.responses.input_items.list(response.id)
    assert [item.content[0].text for item in listed.data] == ["third", "second", "first"]
    assert listed.data[-1].id == "msg_mine" and listed.last_id == "msg_mine"
    assert listed.has_more is False
    first_page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.role for item in first_page.data] == ["user", "assistant"]
    assert first_page.has_more is True
    rest = client.responses.input_items.list(response.id, order="asc", after=first_page.last_id)
    assert [item.content[0].text for item in rest.data] == ["third"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.input_items.list(response.id, limit=0)
    assert raised.value.body["param"] == "limit"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.cancel(response.id)
    assert "background" in raised.value.message
    client.responses.delete(response.id)
    for call in (client.responses.retrieve, client.responses.delete,
                 client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=response.id)


def test_function_calls_and_their_outputs(serve_tiny: ServerProcess) -> None:
    client = _client(serve_tiny)
    tools: Any = [TIME_TOOL]
    named = client.responses.create(model=MODEL_NAME, input="time?", tools=tools,
                                    tool_choice={"type": "function", "name": "get_time"},
                                    max_output_tokens=40, temperature=1.0)
    [call] = named.output
    assert call.type == "function_call" and call.name == "get_time"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TIME_TOOL["parameters"])
    assert named.tool_choice.name == "get_time"  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL_NAME, input="time?", tools=tools,
                                          tool_choice="required", max_output_tokens=60,
                                          temperature=0.0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    streamed = events[-1].response.output[0]  # type: ignore[union-attr]
    assert streamed.arguments == events[3].delta  # type: ignore[union-attr]
    follow_up: Any = ["time?", call, {"type": "function_call_output", "call_id": call.call_id,
                                      "output": "12:00"}]
    follow_up[0] = {"role": "user", "content": "time?"}
    answer = client.responses.create(model=MODEL_NAME, input=follow_up, tools=tools,
                                     tool_choice="none", max_output_tokens=4, temperature=0.0)
    _same_as_chat(answer, client.chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0.0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in TIME_TOOL.items()
                                                 if k != "type"}}],
        messages=[{"role": "user", "content": "time?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": "get_time", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}],
    ).choices[0])


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "temperature": 3}, "temperature"),
])
def test_bad_input_is_a_400_naming_the_field(serve_tiny: ServerProcess, body: dict[str, Any],
                                             param: str) -> None:
    reply = httpx.post(serve_tiny.url + "/v1/responses", json={"model": MODEL_NAME, **body},
                       timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"]
