"""The Responses API's pieces without a server: input items as chat
messages (a turn's calls in one assistant message), errors spelled with
the Responses field names, and the stored responses' LRU bounds."""

from __future__ import annotations

import pytest

from kvserve.server.protocol import APIError
from kvserve.server.responses import ResponseStore, responses_error
from kvserve.server.responses_protocol import ResponsesRequest, input_messages


def test_items_become_chat_messages() -> None:
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    messages = input_messages([
        {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": "thinking", "id": "msg_1"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "[]"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call", "call_id": "c3", "name": "h", "arguments": "{}"},
    ])
    assert messages == [
        {"role": "developer", "content": "ab"},
        {"role": "assistant", "content": "thinking", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[]"}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "{}"}}]},
    ]


@pytest.mark.parametrize(("items", "param"), [
    ([{"type": "reasoning"}], "input[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": "x"}, {"type": "function_call_output", "output": "1"}],
     "input[1].call_id"),
])
def test_bad_items_name_themselves(items: list[dict[str, object]], param: str) -> None:
    with pytest.raises(APIError) as raised:
        input_messages(items)
    assert raised.value.status == 400 and raised.value.param == param


def test_chat_fields() -> None:
    body = ResponsesRequest.model_validate({
        "input": "x", "max_output_tokens": 7, "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    body.check()
    fields = body.chat_fields([{"role": "user", "content": "x"}])
    assert fields["max_tokens"] == 7
    assert fields["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert fields["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_errors_use_the_responses_names() -> None:
    error = responses_error(APIError(400, "max_tokens=9 is too many", "max_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens=9 is too many")
    assert responses_error(APIError(400, "bad", "messages[3].content")).param == "input"
    assert responses_error(APIError(400, "response_format: x", "response_format")).param == (
        "text.format")
    assert responses_error(APIError(400, "t", "temperature")).param == "temperature"


def _response(i: int, size: int = 10) -> dict[str, object]:
    return {"id": f"resp_{i}", "text": "x" * size}


def test_store_evicts_least_recently_used() -> None:
    store = ResponseStore(max_responses=3)
    for i in range(3):
        store.put(_response(i), [], [])
    assert store.get("resp_0") is not None  # now the most recent
    store.put(_response(3), [], [])
    assert store.get("resp_1") is None and len(store) == 3
    assert all(store.get(f"resp_{i}") is not None for i in (0, 2, 3))


def test_store_bounds_characters() -> None:
    store = ResponseStore(max_responses=100, max_chars=200)
    for i in range(5):
        store.put(_response(i, 50), [{"role": "user", "content": "y"}], [])
    assert store.num_chars <= 200 and store.get("resp_4") is not None
    assert store.get("resp_0") is None
    store.put(_response(9, 500), [], [])  # larger than the whole store: not kept
    assert store.get("resp_9") is None and store.get("resp_4") is not None
