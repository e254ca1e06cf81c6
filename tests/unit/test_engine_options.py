"""Engine options a vLLM user expects, on a tiny checkpoint: ``max_logprobs``
(the engine's limit, -1 for the vocabulary), ``chat_template`` (inline or a
file, checked for Jinja syntax up front), and the progress an unfinished
request reports (what the offline progress bar draws)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.args import EngineArgs, read_chat_template
from kvserve.engine.llm_engine import LLMEngine

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>"


@pytest.fixture
def model(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", True)


def test_max_logprobs_is_the_engines_limit(model: Path) -> None:
    llm = LLM(model=str(model), max_logprobs=2, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"logprobs=3 is invalid: .* at most 2 .*max-logprobs"):
        llm.generate("hello", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    [output] = llm.generate("hello", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    assert output.outputs[0].logprobs is not None


def test_max_logprobs_minus_one_allows_the_vocabulary(model: Path) -> None:
    llm = LLM(model=str(model), max_logprobs=-1, num_kv_blocks=16)
    vocab_size = llm.engine.config.model_config.vocab_size
    [output] = llm.generate("hello", SamplingParams(max_tokens=1, logprobs=25), use_tqdm=False)
    logprobs = output.outputs[0].logprobs
    assert logprobs is not None and len(logprobs[0]) >= 25
    with pytest.raises(ValueError, match=f"at most {vocab_size} "):
        llm.generate("hello", SamplingParams(max_tokens=1, logprobs=vocab_size + 1),
                     use_tqdm=False)


def test_chat_template_replaces_the_tokenizers(model: Path, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), chat_template=TEMPLATE,
                                                   num_kv_blocks=16))
    assert engine.tokenizer.render_chat_template(messages) == "[user]hi>"
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE.replace(">", "!"))
    assert read_chat_template(str(path)) == TEMPLATE.replace(">", "!")


@pytest.mark.parametrize(("value", "match"), [
    ("plain words", "not a file, nor a Jinja template"),
    ("{% for m in messages %}{{ m }}", "not a valid Jinja template"),
])
def test_a_bad_chat_template_fails_before_the_model_loads(value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="/not/loaded", chat_template=value).create_engine_config()


def test_the_byte_tokenizer_refuses_a_chat_template() -> None:
    with pytest.raises(ValueError, match="chat_template: this model has no tokenizer files"):
        LLMEngine.from_engine_args(EngineArgs(model="qwen2.5-0.5b", load_format="dummy",
                                              chat_template=TEMPLATE, max_model_len=64,
                                              num_kv_blocks=4, max_num_seqs=2))


def test_progress_counts_output_tokens_against_the_budget(model: Path) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), num_kv_blocks=16))
    request_id = engine.add_request("hello", SamplingParams(n=2, max_tokens=5, ignore_eos=True,
                                                            seed=0))
    assert engine.progress(request_id) == (0, 10)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(engine.progress(request_id))
    assert seen[-1] is None
    counts = [p[0] for p in seen[:-1] if p is not None]
    assert counts == sorted(counts) and counts[-1] >= 8
