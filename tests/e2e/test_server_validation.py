"""Table-driven validation against a running server: one bad value per field,
each a 400 (404 for the model, 413 for the body size) with the OpenAI error
envelope and ``param`` naming the field. Never a 422, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}

# (case id, route, fields replacing the base body, expected param)
BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str]] = [
    ("temperature-high", {"temperature": 2.5}, "temperature"),
    ("temperature-negative", {"temperature": -0.1}, "temperature"),
    ("temperature-type", {"temperature": "hot"}, "temperature"),
    ("top_p-zero", {"top_p": 0}, "top_p"),
    ("top_p-high", {"top_p": 1.5}, "top_p"),
    ("top_k", {"top_k": -2}, "top_k"),
    ("min_p", {"min_p": 1.5}, "min_p"),
    ("n-zero", {"n": 0}, "n"),
    ("n-above-cap", {"n": 1000}, "n"),
    ("max_tokens-zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens-float", {"max_tokens": 1.5}, "max_tokens"),
    ("max_tokens-beyond-context", {"max_tokens": 1000}, "max_tokens"),
    ("presence_penalty", {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("repetition_penalty", {"repetition_penalty": 0}, "repetition_penalty"),
    ("seed", {"seed": 2**64}, "seed"),
    ("stop-too-many", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop-empty", {"stop": [""]}, "stop"),
    ("stop_token_ids", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("logprobs-high", {"logprobs": 21}, "logprobs"),
    ("min_tokens", {"min_tokens": 10}, "min_tokens"),
    ("prompt-empty", {"prompt": ""}, "prompt"),
    ("prompt-empty-list", {"prompt": []}, "prompt"),
    ("prompt-bad-token", {"prompt": [1, 99999]}, "prompt"),
    ("prompt-too-long", {"prompt": [5] * 200}, "prompt"),
    ("prompt-type", {"prompt": {"text": "hi"}}, "prompt"),
    ("stream_options-without-stream", {"stream_options": {"include_usage": True}},
     "stream_options"),
    ("best_of", {"best_of": 3}, "best_of"),
    ("logit_bias-key", {"logit_bias": {"x": 10}}, "logit_bias"),
    ("logit_bias-value", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias-token", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("suffix", {"suffix": "x"}, "suffix"),
]
BAD_CHATS: list[tuple[str, dict[str, Any], str]] = [
    ("top_logprobs-high", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs-without-logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("messages-empty", {"messages": []}, "messages"),
    ("messages-role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("messages-image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content"),
    ("max_completion_tokens", {"max_completion_tokens": 1000}, "max_completion_tokens"),
    ("temperature", {"temperature": 3}, "temperature"),
    ("tools-auto-without-parser", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("tools-bad-name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("tool_choice-unknown", {"tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("tool_choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("functions", {"functions": [{"name": "f"}]}, "functions"),
    ("response_format-type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("response_format-no-schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, "response_format.json_schema"),
    ("response_format-bad-schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format"),
    ("structured-twice", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("guided_regex-bad", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("guided_grammar-bad", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ("structured_outputs-empty", {"structured_outputs": {}}, "structured_outputs"),
    ("stream-type", {"stream": "maybe"}, "stream"),
]


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["code"] is None or isinstance(error["code"], str)  # as OpenAI types it
    assert error["param"] == param, error


@pytest.fixture(scope="module")
def http(serve_tiny: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=serve_tiny.url, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "param"), [c[1:] for c in BAD_COMPLETIONS],
                         ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_field(http: httpx.Client, fields: dict[str, Any], param: str,
                              stream: bool) -> None:
    body = {**COMPLETION, **fields}
    if stream and "stream_options" not in fields:
        body["stream"] = True
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(("fields", "param"), [c[1:] for c in BAD_CHATS],
                         ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_field(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json={**CHAT, **fields}), 400, param)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(http: httpx.Client, route: str) -> None:
    body = {**(COMPLETION if route == "/v1/completions" else CHAT), "model": "gpt-4"}
    assert_error(http.post(route, json=body), 404, "model")
    assert_error(http.get("/v1/models/gpt-4"), 404, "model")


@pytest.mark.parametrize("content", [b"{bad json", b"[1, 2]", b'{"prompt": NaN}', b""])
def test_malformed_body_is_400(http: httpx.Client, content: bytes) -> None:
    response = http.post("/v1/completions", content=content,
                         headers={"content-type": "application/json"})
    assert_error(response, 400, "body")


def test_missing_field_and_content_type(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400, "prompt")
    response = http.post("/v1/completions", content=b"prompt=hi",
                         headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(response, 400, "body")


def test_body_too_large_is_413(http: httpx.Client) -> None:
    body = {**COMPLETION, "prompt": "x" * 100_000}  # the test server allows 64 KiB
    assert_error(http.post("/v1/completions", json=body), 413, "body")

    def chunks() -> Any:  # no Content-Length: counted while reading
        for _ in range(20):
            yield b" " * 8192

    response = http.post("/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"})
    assert_error(response, 413, "body")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404, None)
    response = http.get("/v1/completions")
    assert_error(response, 405, None)
    assert response.headers["allow"] == "POST"


def test_server_still_serves(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
