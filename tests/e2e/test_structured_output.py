"""Structured output end to end on the bundled model with the official
``openai`` client: every response over 20 fixed JSON schemas validates
(jsonschema), streamed with ``n > 1`` too, and with speculative decoding on
(plain requests speculating in the same steps; the greedy outputs equal the
server's without speculation); ``json_object``, and vLLM's
``structured_outputs`` / ``guided_*`` fields for regex, choice and grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from kvserve.assets import DEFAULT_MODEL, MODELS_DIR
from tests.e2e.conftest import MODEL_NAME, ServerProcess, launch
from tests.e2e.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = launch(MODELS_DIR / DEFAULT_MODEL,
                    tmp_path_factory.mktemp("bundled") / "server.log",
                    ["--max-num-seqs", "16"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(bundled: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=bundled.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def _format(schema: dict[str, Any], index: int) -> Any:
    return {"type": "json_schema",
            "json_schema": {"name": f"schema_{index}", "schema": schema, "strict": True}}


MESSAGES: list[Any] = [{"role": "user", "content": "Reply with JSON."}]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_json_schema_response_validates(client: openai.OpenAI, index: int) -> None:
    schema = SCHEMAS[index]
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=160, temperature=0.8, seed=index,
        response_format=_format(schema, index))
    choice = result.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_n2_and_completions(client: openai.OpenAI) -> None:
    schema = SCHEMAS[16]
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=160, temperature=1.0, seed=3, n=2,
        stream=True, response_format=_format(schema, 16)))
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    result = client.completions.create(
        model=MODEL_NAME, prompt="def f():", max_tokens=120, temperature=0.8, seed=1,
        extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(result.choices[0].text), dict)


@pytest.mark.parametrize(("fields", "check"), [
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z") "!"'}},
     lambda t: re.fullmatch(r"x[yz]!", t)),
    ({"structured_outputs": {"choice": ["on", "off"]}}, lambda t: t in ("on", "off")),
    ({"guided_json": {"type": "object", "properties": {"k": {"enum": [1, 2]}},
                      "required": ["k"], "additionalProperties": False}},
     lambda t: json.loads(t)["k"] in (1, 2)),
])
def test_vllm_fields(client: openai.OpenAI, fields: dict[str, Any], check: Any) -> None:
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40,
                                            temperature=1.0, seed=2, extra_body=fields)
    text = result.choices[0].message.content
    assert text is not None and check(text), text


def _greedy(client: openai.OpenAI, index: int) -> str:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=160, temperature=0.0,
        response_format=_format(SCHEMAS[index], index))
    assert result.choices[0].finish_reason == "stop"
    return result.choices[0].message.content or ""


def test_every_schema_validates_beside_speculation(
        client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory) -> None:
    config = {"method": "draft_model", "num_speculative_tokens": 3, "auto_disable": False}
    server = launch(MODELS_DIR / DEFAULT_MODEL, tmp_path_factory.mktemp("spec") / "server.log",
                    ["--max-num-seqs", "16", "--speculative-config", json.dumps(config)])
    try:
        spec_client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                    timeout=120, max_retries=0)

        def plain(_: int) -> Any:
            return spec_client.completions.create(model=MODEL_NAME, prompt="def f(x):",
                                                  max_tokens=32, temperature=0.0)

        with ThreadPoolExecutor(8) as pool:  # plain requests speculate in the same steps
            plains = [pool.submit(plain, i) for i in range(4)]
            texts = list(pool.map(lambda i: _greedy(spec_client, i), range(len(SCHEMAS))))
            for future in plains:
                future.result()
        drafted = server.metric("kvserve:spec_decode_num_draft_tokens_total")
    finally:
        server.stop()
    assert drafted > 0
    for schema, text in zip(SCHEMAS, texts, strict=True):
        jsonschema.validate(json.loads(text), schema)
    with ThreadPoolExecutor(8) as pool:
        assert texts == list(pool.map(lambda i: _greedy(client, i), range(len(SCHEMAS))))
