"""What third-party clients send, against a real ``kvserve serve``: prompt
scoring with ``echo`` + ``logprobs`` (lm-evaluation-harness's loglikelihood
request, and ``max_tokens: 0``), streamed and not, equal to the offline
engine's prompt logprobs for the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import MODEL_NAME, ServerProcess


@pytest.fixture(scope="module")
def client(serve_tiny: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_tiny.url + "/v1", api_key="unused", timeout=60,
                         max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> LLM:
    return LLM(model=str(tiny_model))


def test_echo_logprobs_equal_the_offline_prompt_logprobs(
    client: openai.OpenAI, offline: LLM
) -> None:
    prompt = "the quick brown fox jumps"
    # lm-evaluation-harness's loglikelihood request
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                       logprobs=1, echo=True, temperature=0.0, seed=1234)
    choice = result.choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    [expected] = offline.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=1, logprobs=1), use_tqdm=False)
    prompt_ids = expected.prompt_token_ids
    assert expected.prompt_logprobs is not None
    token_logprobs = choice.logprobs.token_logprobs
    assert token_logprobs is not None and len(token_logprobs) == len(prompt_ids) + 1
    assert token_logprobs[0] is None and choice.logprobs.top_logprobs is not None
    assert choice.logprobs.top_logprobs[0] is None
    for j in range(1, len(prompt_ids)):
        entry = expected.prompt_logprobs[j]
        assert entry is not None
        assert token_logprobs[j] == pytest.approx(entry[prompt_ids[j]].logprob, abs=1e-5)
    tokens = choice.logprobs.tokens
    offsets = choice.logprobs.text_offset
    assert tokens is not None and offsets is not None
    assert "".join(tokens[:len(prompt_ids)]) == prompt
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    generated = expected.outputs[0]
    assert generated.logprobs is not None
    assert token_logprobs[-1] == pytest.approx(
        generated.logprobs[0][generated.token_ids[0]].logprob, abs=1e-5)

    # max_tokens 0: the prompt and its logprobs only
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0,
                                       logprobs=2, echo=True)
    only = scored.choices[0]
    assert only.text == prompt and only.finish_reason == "length"
    assert only.logprobs is not None and only.logprobs.token_logprobs is not None
    assert only.logprobs.token_logprobs == pytest.approx(token_logprobs[:-1], abs=1e-5)
    assert scored.usage is not None and scored.usage.completion_tokens == 0


def _stream(serve_tiny: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(serve_tiny.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    frames = [f for f in response.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-1]]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_equals_the_response(
    serve_tiny: ServerProcess, client: openai.OpenAI, max_tokens: int
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": ["hello world", "a paged kv"],
                            "max_tokens": max_tokens, "echo": True, "logprobs": 1, "n": 2,
                            "temperature": 0.0, "ignore_eos": True}
    whole = httpx.post(serve_tiny.url + "/v1/completions", json=body, timeout=60).json()
    chunks = _stream(serve_tiny, {**body, "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"]
                == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        streamed_logprobs = [lp for c in mine if c["logprobs"]
                             for lp in c["logprobs"]["token_logprobs"]]
        assert streamed_logprobs == choice["logprobs"]["token_logprobs"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 4 * max_tokens
    # the openai SDK parses it
    parsed = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"})
    assert len(parsed.choices) == 4


def test_explicit_nulls_mean_the_defaults(serve_tiny: ServerProcess) -> None:
    completion = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
    nullable = ["n", "echo", "logprobs", "stream", "stream_options", "temperature", "top_p",
                "stop", "seed", "presence_penalty", "frequency_penalty", "user", "logit_bias",
                "best_of", "suffix", "ignore_eos", "min_tokens"]
    response = httpx.post(serve_tiny.url + "/v1/completions",
                          json={**completion, **dict.fromkeys(nullable)}, timeout=30)
    assert response.status_code == 200, response.text
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    nullable_chat = ["n", "logprobs", "top_logprobs", "stream", "tools", "tool_choice",
                     "response_format", "max_completion_tokens", "seed", "stop"]
    response = httpx.post(serve_tiny.url + "/v1/chat/completions",
                          json={**chat, **dict.fromkeys(nullable_chat)}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["refusal"] is None


def test_logit_bias_history_roles_and_cached_tokens(client: openai.OpenAI) -> None:
    forced = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3,
                                       temperature=0.0, logit_bias={"300": 100},
                                       extra_body={"ignore_eos": True})
    tokens = client.completions.create(model=MODEL_NAME, prompt=[300, 300, 300], max_tokens=1,
                                       echo=True)
    assert forced.choices[0].text == tokens.choices[0].text[:len(forced.choices[0].text)]
    history: list[Any] = [
        {"role": "developer", "content": "answer briefly"},
        {"role": "user", "content": "what is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    first = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4)
    again = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4)
    assert first.choices[0].message.refusal is None
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 < details.cached_tokens < again.usage.prompt_tokens


def test_tokenizer_info(serve_tiny: ServerProcess) -> None:
    info = httpx.get(serve_tiny.url + "/tokenizer_info", timeout=10).json()
    assert info["tokenizer_class"] and info["eos_token"] == "</s>"
    assert info["model_max_length"] == 128 and "chat_template" in info
