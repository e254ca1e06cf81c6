"""``kvserve serve --enable-lora --lora-modules NAME=PATH`` with the official
``openai`` client: /v1/models lists the adapter under its base model, a
completion naming the adapter gets the adapter's greedy text (checked against
the offline engine on the merged checkpoint), and an unknown name is a 404."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_lora_adapter, merge_lora
from tests.e2e.conftest import MODEL_NAME, ServerProcess

PROMPT = [5, 17, 99, 3, 250, 7, 42]
MAX_TOKENS = 12


def offline_text(model: Path) -> str:
    llm = LLM(model=str(model), num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_adapter_is_listed_and_selected_by_model_name(
    tiny_model: Path, tmp_path: Path, start_server: Callable[..., ServerProcess],
) -> None:
    adapter = make_lora_adapter(tiny_model, tmp_path / "adapter", seed=5)
    server = start_server(["--enable-lora", "--max-loras", "1",
                           "--lora-modules", f"tiny-lora={adapter}"])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60,
                           max_retries=0)
    cards = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL_NAME, None),
                                                      ("tiny-lora", MODEL_NAME)]
    assert client.models.retrieve("tiny-lora").id == "tiny-lora"

    texts = {}
    for model in ("tiny-lora", MODEL_NAME):
        completion = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert completion.model == model
        texts[model] = completion.choices[0].text
    assert texts["tiny-lora"] == offline_text(merge_lora(tiny_model, adapter, tmp_path / "m"))
    assert texts[MODEL_NAME] == offline_text(tiny_model)

    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other-lora", prompt=PROMPT, max_tokens=2)
    assert "tiny-lora" in str(info.value)


def test_lora_modules_without_enable_lora_exit_at_once(
    start_server: Callable[..., ServerProcess], tmp_path: Path,
) -> None:
    server = start_server(["--lora-modules", f"x={tmp_path}"], wait_ready=False)
    assert server.wait_exit(60) == 2
    assert "--lora-modules needs --enable-lora" in server.log()
