"""A model's generation_config.json as sampling defaults (``--generation-config
auto | vllm | <folder>``, as vLLM's): the six keys vLLM takes are read and
checked, ``vllm`` ignores the file, a folder replaces the model's; offline
``LLM.generate`` without parameters and the server's requests without the
fields use them, and a request's own values always win."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.client import ThreadedEngineClient
from kvserve.engine.generation_config import read_sampling_defaults
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.api import build_app
from kvserve.server.state import ServerConfig, ServerState

GENERATION = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
              "repetition_penalty": 1.2, "max_new_tokens": 5, "do_sample": True,
              "bos_token_id": 1, "num_beams": 4}
DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
            "repetition_penalty": 1.2, "max_tokens": 5}
PROMPT = [5, 17, 99, 3, 250, 7, 42]


def write_generation_config(folder: Path, values: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


@pytest.fixture(scope="module")
def tuned_model(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Path:
    """A tiny Llama (with a tokenizer) whose generation_config recommends GENERATION."""
    path = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_checkpoint("llama", with_tokenizer=True), path)
    return write_generation_config(path, GENERATION)


def test_the_six_keys_are_read_and_the_rest_ignored(tuned_model: Path, tmp_path: Path) -> None:
    assert read_sampling_defaults("auto", str(tuned_model)) == DEFAULTS
    assert read_sampling_defaults("vllm", str(tuned_model)) == {}
    other = write_generation_config(tmp_path / "other", {"temperature": 0.3})
    assert read_sampling_defaults(str(other), str(tuned_model)) == {"temperature": 0.3}
    assert read_sampling_defaults("auto", str(tmp_path)) == {}  # no file: no defaults
    assert read_sampling_defaults("auto", None) == {}  # a preset: no directory


@pytest.mark.parametrize(("values", "message"), [
    ({"temperature": -1}, "temperature=-1 must be a number >= 0"),
    ({"top_p": 0}, "top_p=0 must be a number > 0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5 must be an integer"),
    ({"top_k": "50"}, "top_k='50' must be an integer"),
    ({"repetition_penalty": True}, "repetition_penalty=True must be a number > 0"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path: Path, values: dict[str, Any],
                                               message: str) -> None:
    write_generation_config(tmp_path, values)
    with pytest.raises(ValueError, match=message):
        read_sampling_defaults("auto", str(tmp_path))


def test_a_folder_without_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be 'auto', 'vllm' or a folder holding"):
        read_sampling_defaults(str(tmp_path / "nowhere"), None)


def test_offline_generate_uses_the_defaults_unless_given_params(tuned_model: Path) -> None:
    llm = LLM(model=str(tuned_model), num_kv_blocks=32)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    greedy_5 = SamplingParams(**DEFAULTS)
    [default] = llm.generate([PROMPT], use_tqdm=False)
    [explicit] = llm.generate([PROMPT], greedy_5, use_tqdm=False)
    assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert 1 <= len(default.outputs[0].token_ids) <= 5
    [given] = llm.generate([PROMPT], SamplingParams(max_tokens=9, ignore_eos=True),
                           use_tqdm=False)
    assert len(given.outputs[0].token_ids) == 9  # the request's own value wins
    plain = LLM(model=str(tuned_model), num_kv_blocks=32, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def _post(state: ServerState, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as client:
            return await client.post(path, json=body, timeout=60)

    response = asyncio.run(asyncio.wait_for(go(), 120))
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_server_requests_use_the_defaults_for_unset_fields(tuned_model: Path) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tuned_model), num_kv_blocks=64))
    client = ThreadedEngineClient(engine)
    state = ServerState(ServerConfig(["tiny"]), client=client)
    offline = LLM(model=str(tuned_model), num_kv_blocks=32)
    greedy = offline.generate([PROMPT], SamplingParams(**DEFAULTS), use_tqdm=False)[0]
    try:
        # completions: max_tokens 5 instead of OpenAI's 16, greedy (temperature 0)
        result = _post(state, "/v1/completions", {"prompt": PROMPT})
        assert result["choices"][0]["text"] == greedy.outputs[0].text
        assert result["usage"]["completion_tokens"] == len(greedy.outputs[0].token_ids)
        result = _post(state, "/v1/completions",
                       {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True})
        assert result["usage"]["completion_tokens"] == 8
        # chat: 5 instead of the rest of the context
        chat = _post(state, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert chat["usage"]["completion_tokens"] == 5
        chat = _post(state, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                      "max_completion_tokens": 7})
        assert chat["usage"]["completion_tokens"] == 7
    finally:
        client.shutdown()
