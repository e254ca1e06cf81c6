"""The official ``openai`` client (and raw SSE over httpx) against ``kvserve serve``:
chat and completions, streaming and not, n=2, stop strings, logprobs in both
formats, echo, usage, /v1/models, the tokenizer routes, probes and metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import MODEL_NAME, ServerProcess

IGNORE_EOS: dict[str, Any] = {"ignore_eos": True}
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def client(serve_tiny: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_tiny.url + "/v1", api_key="unused", timeout=60,
                         max_retries=0)


def sse_frames(response: httpx.Response) -> list[str]:
    """The raw SSE events (split on blank lines only, never with ``splitlines``)."""
    text = response.text
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [frame for frame in text.split("\n\n") if frame]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_completion_and_stream_agree(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=12,
                                       temperature=0.0, extra_body=IGNORE_EOS)
    choice = result.choices[0]
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert result.usage is not None and result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12

    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=12, stream=True,
        stream_options={"include_usage": True}, temperature=0.0, extra_body=IGNORE_EOS))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == choice.text
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_and_stream(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                            max_tokens=10, temperature=0.0, extra_body=IGNORE_EOS)
    choice = result.choices[0]
    assert result.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, temperature=0.0, extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens


def test_n2_completion_and_chat(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=6, n=2,
                                       temperature=1.0, seed=7,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage is not None and result.usage.completion_tokens == 12

    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                            max_tokens=5, n=2, stream=True, temperature=1.0,
                                            extra_body={"ignore_eos": True})
    finished = {c.choices[0].index: c.choices[0].finish_reason
                for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def _first_ascii_letter(text: str) -> str:
    letters = [ch for ch in text if ch.isascii() and ch.isalpha()]
    if not letters:
        pytest.skip(f"the random model wrote no ASCII letter to stop on: {text!r}")
    return letters[len(letters) // 2]


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt="the lazy dog", max_tokens=30,
                                     temperature=0.0, extra_body=IGNORE_EOS).choices[0].text
    stop = _first_ascii_letter(full)
    result = client.completions.create(model=MODEL_NAME, prompt="the lazy dog", max_tokens=30,
                                       stop=[stop, "zzzz"], temperature=0.0, extra_body=IGNORE_EOS)
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[:full.index(stop)]
    assert choice.model_dump().get("stop_reason") == stop


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6,
                                       logprobs=3, temperature=0.0, extra_body=IGNORE_EOS)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL_NAME, messages=CHAT,
                                            max_tokens=5, logprobs=True, top_logprobs=3,
                                            temperature=0.0, extra_body=IGNORE_EOS)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5
    for entry in logprobs.content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(ranked[0])


def test_echo_and_token_prompt(client: openai.OpenAI, serve_tiny: ServerProcess) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4,
                                       echo=True, temperature=0.0, extra_body=IGNORE_EOS)
    assert result.choices[0].text.startswith("hello world")
    token_ids = httpx.post(serve_tiny.url + "/tokenize",
                           json={"prompt": "hello world"}, timeout=10).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=token_ids, max_tokens=4,
                                       temperature=0.0, extra_body=IGNORE_EOS)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(token_ids)
    assert "hello world" + by_ids.choices[0].text == result.choices[0].text


def test_batch_prompts(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt=["hello", "the fox"],
                                       max_tokens=3, n=2, temperature=0.0, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage is not None and result.usage.completion_tokens == 12


def test_raw_sse_format(serve_tiny: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    response = httpx.post(serve_tiny.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(response)
    assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames)
    payloads = [json.loads(frame[6:]) for frame in frames[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert len({p["id"] for p in payloads}) == 1


def test_tokenizer_routes_and_probes(serve_tiny: ServerProcess) -> None:
    url = serve_tiny.url
    tokens = httpx.post(url + "/tokenize", json={"prompt": "hello world",
                                                 "return_token_strs": True}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 128
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=10)
    assert text.json() == {"prompt": "hello world"}
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}, timeout=10).json()
    assert chat["count"] > tokens["count"]
    assert httpx.get(url + "/version", timeout=10).json()["version"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/ready", timeout=10).status_code == 200


def test_metrics_exposed(client: openai.OpenAI, serve_tiny: ServerProcess) -> None:
    client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, temperature=0.0,
                              extra_body=IGNORE_EOS)
    text = httpx.get(serve_tiny.url + "/metrics", timeout=10).text
    names = [
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
        "request_success_total", "admission_rejections_total", "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    ]
    for name in names:
        assert f'kvserve:{name}{{' in text, name
    assert f'model_name="{MODEL_NAME}"' in text
    assert 'finished_reason="length"' in text
    assert serve_tiny.metric("kvserve:generation_tokens_total") >= 3
