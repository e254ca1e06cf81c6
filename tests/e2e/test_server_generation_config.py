"""``kvserve serve`` on a model whose generation_config.json recommends
sampling defaults, with the engine core in the server's process and in its
own: the start-up log names the defaults, a request without max_tokens or
temperature gets them (greedy, 5 tokens: the offline engine's text), and a
request's own values win; ``--generation-config vllm`` ignores the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import MODEL_NAME, launch

PROMPT = [5, 17, 99, 3, 250, 7, 42]


@pytest.fixture(scope="module")
def tuned_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_model, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5, "do_sample": True}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("engine_core", ["inproc", "process"])
def test_requests_get_the_models_defaults(tuned_model: Path, tmp_path: Path,
                                          engine_core: str) -> None:
    expected = LLM(model=str(tuned_model), num_kv_blocks=32).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    server = launch(tuned_model, tmp_path / "server.log",
                    ["--engine-core", engine_core, "--num-kv-blocks", "64"])
    try:
        assert "default sampling parameters from the model's generation config: " \
               "temperature=0.0, max_tokens=5" in server.log()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                               max_retries=0)
        completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT)
        assert completion.choices[0].text == expected.text
        assert completion.usage is not None
        assert completion.usage.completion_tokens == len(expected.token_ids)
        longer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=9,
                                           extra_body={"ignore_eos": True})
        assert longer.usage is not None and longer.usage.completion_tokens == 9
    finally:
        server.stop()


def test_generation_config_vllm_ignores_the_file(tuned_model: Path, tmp_path: Path) -> None:
    server = launch(tuned_model, tmp_path / "server.log", ["--generation-config", "vllm"])
    try:
        assert "default sampling parameters" not in server.log()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                               max_retries=0)
        completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                               extra_body={"ignore_eos": True})
        assert completion.usage is not None and completion.usage.completion_tokens == 16
    finally:
        server.stop()
