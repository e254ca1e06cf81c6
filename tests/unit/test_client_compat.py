"""The small things real clients send: ``logit_bias`` (validated, applied
before sampling, greedy included, logprobs still raw), explicit ``null``
meaning the default (and the JSON schema saying so), chat history with
``developer`` / ``tool`` messages and assistant ``tool_calls``, and the
error envelope's ``code`` typed as OpenAI types it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.sampling.sampler import Sampler, SamplingBatch, SamplingRows
from kvserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)


def _batch(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, [[]] * n, [[]] * n, [None] * n, vocab, "cpu")


def test_logit_bias_moves_greedy_and_random_rows_but_not_logprobs() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0.0, logit_bias={2: 100.0}, logprobs=1),
              SamplingParams(temperature=0.0, logit_bias={0: -100.0}),
              SamplingParams(temperature=1.0, logit_bias={3: 100.0}, seed=1)]
    assert not SamplingRows.of(params, 4).argmax_only.any()
    out = Sampler()(logits, _batch(params, 4))
    assert out.sampled_token_ids.tolist() == [2, 1, 3]
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0, 0].item() == pytest.approx(raw[2].item())  # the unbiased logprob


@pytest.mark.parametrize(("bias", "needle"), [({-1: 1.0}, "logit_bias"),
                                              ({5: 100.5}, r"logit_bias\[5\]")])
def test_logit_bias_validation(bias: dict[int, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(logit_bias=bias)


def test_logit_bias_in_the_engine(tiny_checkpoint: Callable[[str], Path]) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [plain] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    biased = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            logit_bias={first: -100.0, 42: 100.0})
    [out] = llm.generate([[5, 6, 7]], biased, use_tqdm=False)
    assert out.outputs[0].token_ids == [42] * 6
    with pytest.raises(ValueError, match="logit_bias: token id 384"):
        llm.generate([[5]], SamplingParams(logit_bias={384: 1.0}), use_tqdm=False)


def _parse(model: type[Any], body: dict[str, Any]) -> Any:
    return model.parse(json.dumps(body).encode())


def test_null_means_default_and_the_schema_says_so() -> None:
    nulls = {"n": None, "echo": None, "stream": None, "logprobs": None, "max_tokens": None,
             "ignore_eos": None, "min_tokens": None, "priority": None, "best_of": None,
             "skip_special_tokens": None, "stream_options": None, "logit_bias": None}
    body = _parse(CompletionRequest, {"prompt": "x", **nulls})
    assert (body.n, body.echo, body.stream, body.min_tokens, body.skip_special_tokens) == (
        1, False, False, 0, True)
    chat = _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                          "logprobs": None, "n": None, "top_logprobs": None})
    assert chat.logprobs is False and chat.n == 1
    schema = CompletionRequest.model_json_schema()
    n = schema["properties"]["n"]
    assert {"type": "null"} in n["anyOf"] and n["default"] == 1
    # a required field stays required and not nullable
    assert "prompt" in schema["required"]
    assert {"type": "null"} not in schema["properties"]["prompt"].get("anyOf", [])


def test_chat_history_with_developer_tool_and_tool_calls() -> None:
    chat = _parse(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    rendered = [m.to_template() for m in chat.messages]
    assert rendered[0] == {"role": "system", "content": "be brief"}
    assert rendered[2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": {"city": "Oslo"}}
    assert rendered[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_error_code_is_a_string_or_null() -> None:
    assert error_body(400, "bad", "n")["error"]["code"] is None
    assert error_body(401, "key")["error"]["code"] == "invalid_api_key"
    assert APIError(404, "m", "model", code="model_not_found").body()["error"]["code"] == (
        "model_not_found")
