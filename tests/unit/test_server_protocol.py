"""The server's in-process pieces: request models and the error envelope, the
fault-injection hook, admission, per-request metrics, the engine client's
watchdog, and the FastAPI app itself over httpx's ASGI transport with a tiny
real engine (auth, body limit, probes, draining, SSE framing, 500 hygiene)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve import LLM
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import EngineDeadError, ThreadedEngineClient
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.envs import FaultInjection, parse_fault_injection
from kvserve.server.api import build_app
from kvserve.server.faults import inject_faults
from kvserve.server.protocol import (
    MAX_ECHO_CHARS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    loc_to_param,
)
from kvserve.server.state import Admission, ServerConfig, ServerState, Ticket

KEY = "sekret-key"

# ------------------------------------------------------------ protocol


def parse_error(model: type[Any], body: dict[str, Any] | bytes) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        model.parse(raw)
    return info.value


def test_loc_to_param() -> None:
    assert loc_to_param(("messages", 0, "content")) == "messages[0].content"
    assert loc_to_param(("stop_token_ids", 2)) == "stop_token_ids[2]"
    assert loc_to_param(()) is None


def test_prompt_shapes_are_normalised() -> None:
    def prompts(value: Any) -> Any:
        return CompletionRequest.parse(json.dumps({"prompt": value}).encode()).prompt

    assert prompts("hi") == ["hi"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    bad_prompts: list[Any] = ["", [], ["a", [1]], [[]], [True], {"a": 1}]
    for bad in bad_prompts:
        assert parse_error(CompletionRequest, {"prompt": bad}).param == "prompt"


def test_errors_name_the_field_and_bound_the_echo() -> None:
    error = parse_error(CompletionRequest, {"prompt": "x", "temperature": "x" * 5000})
    assert error.status == 400 and error.param == "temperature"
    assert len(error.message) < MAX_ECHO_CHARS + 200
    error = parse_error(CompletionRequest, {"prompt": "x", "stop": ["a"] * 5})
    assert error.param == "stop" and "at most 4" in error.message
    assert parse_error(CompletionRequest, b'{"prompt": "x", "top_p": NaN}').param == "body"
    assert parse_error(CompletionRequest, b"[]").message == "the request body must be a JSON object"
    error = parse_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert error.param == "messages[0].content"


def test_chat_content_parts_and_cross_field_checks() -> None:
    body = ChatCompletionRequest.parse(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode())
    assert body.messages[0].content == "ab"
    body = ChatCompletionRequest.parse(b'{"messages": [{"role": "user", "content": "x"}], '
                                       b'"top_logprobs": 3}')
    with pytest.raises(APIError) as info:
        body.check()
    assert info.value.param == "top_logprobs"
    body = ChatCompletionRequest.parse(b'{"messages": [{"role": "user", "content": "x"}], '
                                       b'"logprobs": true, "max_completion_tokens": 7}')
    assert body.num_top_logprobs == 0 and body.requested_max_tokens() == 7
    assert CompletionRequest.parse(b'{"prompt": "x"}').requested_max_tokens() == 16


def test_fault_injection_parsing() -> None:
    assert parse_fault_injection("") == FaultInjection()
    assert not FaultInjection().enabled
    spec = parse_fault_injection("raise_on_step=5, step_delay_s=0.1")
    assert spec == FaultInjection(raise_on_step=5, step_delay_s=0.1) and spec.enabled
    for bad in ("raise_on_step=0", "hang_on_step=x", "explode=1", "step_delay_s"):
        with pytest.raises(ValueError, match="KVSERVE_FAULT_INJECT"):
            parse_fault_injection(bad)


def test_admission_is_all_or_nothing() -> None:
    admission = Admission(capacity=4)
    first, second = Ticket("a", 3, ["a-0"]), Ticket("b", 2, ["b-0"])
    assert admission.admit(first)
    assert not admission.admit(second) and admission.num_seqs == 3
    admission.release(first)
    admission.release(first)
    assert admission.num_seqs == 0 and admission.admit(second)


def _output(request_id: str, reasons: list[str | None], new: int) -> RequestOutput:
    completions = [CompletionOutput(i, "", [1] * new, reason, delta_token_ids=[1] * new)
                   for i, reason in enumerate(reasons)]
    return RequestOutput(request_id, None, [1, 2, 3], completions,
                         all(r is not None for r in reasons), RequestMetrics(arrival_s=0.0))


def test_request_timer_counts_each_choice_once() -> None:
    state = ServerState(ServerConfig(["m"]))
    timer = state.metrics.timer(num_choices=3)
    timer.observe(_output("r-0", [None, None], 1))
    timer.observe(_output("r-0", ["stop", "length"], 1))
    timer.close("abort")
    timer.close("error")
    text = state.metrics.render().decode()
    assert 'kvserve:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'kvserve:request_success_total{finished_reason="abort",model_name="m"} 1.0' in text
    assert 'kvserve:request_success_total{finished_reason="error",model_name="m"} 0.0' in text
    assert 'kvserve:generation_tokens_total{model_name="m"} 4.0' in text
    assert 'kvserve:time_to_first_token_seconds_count{model_name="m"} 1.0' in text


# ------------------------------------------------------------ engine client watchdog


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"), with_tokenizer=True)


def make_engine(model: Path, faults: FaultInjection | None = None) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), max_num_seqs=4,
                                                   num_kv_blocks=64))
    inject_faults(engine.core.executor, faults or FaultInjection())
    return engine


async def _drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


@pytest.mark.parametrize("faults", [FaultInjection(raise_on_step=2),
                                    FaultInjection(hang_on_step=2)], ids=["raise", "hang"])
def test_client_fails_requests_on_a_dead_or_hung_step(tiny_model: Path,
                                                       faults: FaultInjection) -> None:
    client = ThreadedEngineClient(make_engine(tiny_model, faults), watchdog_s=0.5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    process = client.processor.process
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(_drain(client.generate(process([5, 6, 7], params, "a"))), 10))
    health = client.health()
    assert not health.alive and health.error
    with pytest.raises(EngineDeadError):  # new requests fail at once
        asyncio.run(asyncio.wait_for(_drain(client.generate(process([5, 6], params, "b"))), 5))
    client.shutdown(timeout_s=0.1)


# ------------------------------------------------------------ the app in-process


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[ServerState]:
    engine = make_engine(tiny_model)
    client = ThreadedEngineClient(engine)
    state = ServerState(ServerConfig(["tiny"], api_keys=[KEY, "other"], max_num_seqs=4,
                                     max_queued_requests=4, max_request_body_bytes=4096),
                        client=client)
    yield state
    client.shutdown()


def call(state: ServerState, method: str, path: str, key: str | None = KEY,
         **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as client:
            return await client.request(method, path, headers=headers, timeout=30, **kwargs)

    return asyncio.run(asyncio.wait_for(go(), 60))


COMPLETION = {"prompt": "hello world", "max_tokens": 5, "ignore_eos": True}


def test_api_key_required_except_probes(served: ServerState) -> None:
    for key in (None, "wrong", KEY[:-1]):
        response = call(served, "POST", "/v1/completions", key=key, json=COMPLETION)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert call(served, "GET", "/v1/models", key=key).status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert call(served, "GET", path, key=None).status_code == 200
    assert call(served, "POST", "/v1/completions", key="other", json=COMPLETION).is_success


def test_completion_and_sse_framing(served: ServerState) -> None:
    result = call(served, "POST", "/v1/completions", json=COMPLETION).json()
    assert result["usage"]["completion_tokens"] == 5
    assert result["choices"][0]["finish_reason"] == "length"
    options = {"include_usage": True, "continuous_usage_stats": True}
    response = call(served, "POST", "/v1/completions",
                    json={**COMPLETION, "stream": True, "n": 2, "logprobs": 1,
                          "stream_options": options})
    frames = [f for f in response.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    payloads = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    assert all("usage" in p for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 10
    tokens: dict[int, int] = {0: 0, 1: 0}
    for payload in payloads[:-1]:
        choice = payload["choices"][0]
        tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
    assert tokens == {0: 5, 1: 5}


def test_body_limit_is_413(served: ServerState) -> None:
    response = call(served, "POST", "/v1/completions",
                    json={**COMPLETION, "prompt": "x" * 5000})
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"


def test_n_beyond_capacity_is_400(served: ServerState) -> None:
    response = call(served, "POST", "/v1/completions", json={**COMPLETION, "n": 9})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_internal_errors_are_generic(served: ServerState,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: Any) -> Any:
        raise RuntimeError("secret detail at /home/me/kvserve.py")

    assert served.client is not None
    monkeypatch.setattr(served.client.processor, "tokenize", explode)
    response = call(served, "POST", "/v1/completions", json=COMPLETION)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == (
        "The server had an error while processing your request.")
    assert "secret" not in response.text


def test_draining_and_loading_are_503(served: ServerState) -> None:
    served.draining = True
    try:
        response = call(served, "POST", "/v1/completions", json=COMPLETION)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert call(served, "GET", "/ready").status_code == 503
        assert call(served, "GET", "/health").status_code == 200
    finally:
        served.draining = False
    loading = ServerState(ServerConfig(["tiny"]))
    assert call(loading, "GET", "/health").status_code == 503
    assert call(loading, "POST", "/v1/completions", json=COMPLETION).status_code == 503
    text = loading.metrics.render().decode()
    assert 'kvserve:admission_rejections_total{model_name="tiny",reason="loading"} 1.0' in text


def test_dry_fields_reach_the_sampler_and_bad_ones_name_the_field(
        served: ServerState, tiny_model: Path) -> None:
    body = {"prompt": [7, 7, 7, 7, 7, 7, 7, 7], "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "dry_multiplier": 2.0, "dry_allowed_length": 2,
            "dry_sequence_breakers": []}
    response = call(served, "POST", "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    llm = LLM(model=str(tiny_model), num_kv_blocks=64)
    fields = {k: v for k, v in body.items() if k != "prompt"}
    fields["temperature"] = 0.0
    [dry] = llm.generate([body["prompt"]], SamplingParams(**fields), use_tqdm=False)
    [plain] = llm.generate([body["prompt"]], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert response.json()["choices"][0]["text"] == dry.outputs[0].text != plain.outputs[0].text
    for field, value in (("dry_base", 1.0), ("dry_allowed_length", 0),
                         ("dry_sequence_breakers", [""])):
        response = call(served, "POST", "/v1/completions", json={**body, field: value})
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]
