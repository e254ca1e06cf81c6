"""The whole engine on CPU with tiny random checkpoints: greedy generations
token-for-token equal to HF transformers, and equal to themselves with
chunked prefill, prefix caching, preemption and batching on and off; n > 1,
seeds, stop strings, logprobs, stats and bad input."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams, TextPrompt, TokensPrompt
from kvserve.core.outputs import EngineCoreOutput
from kvserve.engine.args import EngineArgs
from kvserve.engine.input_processor import RequestOutputKind
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from tests.conftest import make_tiny_checkpoint

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    [300, 12, 8, 8, 8, 19, 77, 1, 64, 120, 33, 9, 18, 200, 11, 4, 90, 91, 92, 93, 5],
    [11, 12],
    list(range(20, 57)),
]


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never mask EOS
    return model


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "variant", ["llama", "llama_mqa", "llama_tied", "llama31", "mistral", "qwen2", "qwen3"]
)
def test_greedy_batch_matches_transformers(
    variant: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(variant)
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=24)
    ours = token_ids(llm, PROMPTS, GREEDY_32)
    for prompt, tokens in zip(PROMPTS, ours):
        assert tokens == hf_greedy(path, prompt, 32), (variant, prompt)


@pytest.fixture(scope="module")
def reference_outputs(tiny_checkpoint: Callable[[str], Path]) -> list[list[int]]:
    llm = LLM(model=str(tiny_checkpoint("llama")), enable_chunked_prefill=False,
              enable_prefix_caching=False, max_num_batched_tokens=512)
    return token_ids(llm, PROMPTS, GREEDY_32)


@pytest.mark.parametrize("budget", [1, 5, 16, 100])
def test_chunked_prefill_sizes_give_identical_output(
    budget: int, tiny_checkpoint: Callable[[str], Path], reference_outputs: list[list[int]]
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), max_num_batched_tokens=budget, block_size=4)
    assert token_ids(llm, PROMPTS, GREEDY_32) == reference_outputs


def test_prefix_cache_cold_warm_and_after_abort(
    tiny_checkpoint: Callable[[str], Path], reference_outputs: list[list[int]]
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), block_size=4)
    assert token_ids(llm, PROMPTS, GREEDY_32) == reference_outputs
    hits_before = llm.stats()["prefix_cache_hits"]
    assert token_ids(llm, PROMPTS, GREEDY_32) == reference_outputs
    assert llm.stats()["prefix_cache_hits"] > hits_before
    # abort a request mid-generation, then run everything again
    engine = llm.engine
    engine.add_request(PROMPTS[3], GREEDY_32, request_id="to-abort")
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("to-abort")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert token_ids(llm, PROMPTS, GREEDY_32) == reference_outputs
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_forced_preemption_gives_identical_output(
    tiny_checkpoint: Callable[[str], Path], reference_outputs: list[list[int]]
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), block_size=4, num_kv_blocks=20)
    assert token_ids(llm, PROMPTS, GREEDY_32) == reference_outputs
    assert llm.stats()["num_preemptions"] > 0


def test_alone_equals_inside_a_batch(
    tiny_checkpoint: Callable[[str], Path], reference_outputs: list[list[int]]
) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), block_size=4)
    for prompt, expected in zip(PROMPTS, reference_outputs):
        assert token_ids(llm, [prompt], GREEDY_32) == [expected]
    many = PROMPTS * 6
    assert token_ids(llm, many, GREEDY_32) == reference_outputs * 6


def test_seeded_sampling_is_reproducible_and_survives_preemption(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    roomy = LLM(model=str(tiny_checkpoint("llama")), block_size=4)
    tight = LLM(model=str(tiny_checkpoint("llama")), block_size=4, num_kv_blocks=20)
    first = token_ids(roomy, PROMPTS, params)
    assert token_ids(roomy, PROMPTS, params) == first
    assert token_ids(tight, PROMPTS, params) == first
    assert tight.stats()["num_preemptions"] > 0


def test_n_samples_logprobs_and_stats(tiny_checkpoint: Callable[[str], Path]) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=7, logprobs=2,
                            ignore_eos=True)
    [output] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for completion in output.outputs:
        assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
        assert completion.logprobs is not None and len(completion.logprobs) == 5
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry and len(entry) <= 3
            assert all(lp.logprob <= 0.0 for lp in entry.values())
    assert output.metrics.ttft_s is not None and output.metrics.ttft_s >= 0
    assert output.metrics.queue_s is not None and output.metrics.queue_s >= 0
    assert output.metrics.queue_s <= output.metrics.ttft_s
    assert output.tpot_s is not None and output.tpot_s >= 0
    stats = llm.stats()
    for key in ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "prefix_cache_queries",
                "prefix_cache_hits", "num_preemptions", "num_requests_running",
                "num_requests_waiting"):
        assert key in stats
    assert stats["num_steps"] > 0 and stats["step_s"] > 0
    assert 0.0 < stats["device_s"] <= stats["step_s"]
    assert stats["host_s"] == pytest.approx(stats["step_s"] - stats["device_s"])
    assert 0.0 < stats["host_share"] <= 1.0
    # the forward runs on the host here, so the time spent waiting for outputs is ~0
    assert 0.0 <= stats["wait_s"] <= stats["step_s"]
    assert stats["host_busy_s"] == pytest.approx(stats["step_s"] - stats["wait_s"])
    assert 0.0 < stats["host_busy_share"] <= 1.0


@pytest.fixture(scope="module")
def tokenized_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tok"), with_tokenizer=True)


def test_text_prompts_stop_strings_and_chat(tokenized_checkpoint: Path) -> None:
    llm = LLM(model=str(tokenized_checkpoint))
    free = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert len(free.outputs[0].token_ids) == 20
    starts = [i for i in range(3, len(text) - 3)
              if "\ufffd" not in text[i:i + 3] and text.index(text[i:i + 3]) == i]
    assert starts, text
    stop = text[starts[0]:starts[0] + 3]
    cut = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=20,
                                                     ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    [reply] = llm.chat([{"role": "user", "content": "hi"}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(reply.outputs[0].token_ids) == 4


def test_vllm_prompt_dicts_match_bare_prompts(tokenized_checkpoint: Path) -> None:
    """``{"prompt": text}`` and ``{"prompt_token_ids": ids}`` (vLLM's TextPrompt and
    TokensPrompt), alone or in a list, run as the bare text and ids do."""
    llm = LLM(model=str(tokenized_checkpoint))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [bare_text, bare_ids] = llm.generate(["hello world", [5, 6, 7]], params, use_tqdm=False)
    [one] = llm.generate(TextPrompt(prompt="hello world"), params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "hello world"}, TokensPrompt(prompt_token_ids=[5, 6, 7])],
                         params, use_tqdm=False)
    for out in (one, dicts[0]):
        assert out.prompt == "hello world"
        assert out.outputs[0].token_ids == bare_text.outputs[0].token_ids
    assert dicts[1].prompt_token_ids == [5, 6, 7]
    assert dicts[1].outputs[0].token_ids == bare_ids.outputs[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "needle"),
    [
        ([], SamplingParams(max_tokens=4), "prompt"),
        (list(range(3, 200)), SamplingParams(max_tokens=4), "max_model_len"),
        ([3, 4], SamplingParams(max_tokens=127), "max_tokens"),
        ([3, 10_000], SamplingParams(max_tokens=4), "prompt\\[1\\]"),
        ([3, 4, -1], SamplingParams(max_tokens=4), "prompt\\[2\\]=-1"),
        ([3, 4.0], SamplingParams(max_tokens=4), "prompt\\[1\\]=4.0"),
        ([3, "5"], SamplingParams(max_tokens=4), "prompt\\[1\\]='5'"),
        ({"prompt_token_ids": [3, 10_000]}, SamplingParams(max_tokens=4), "prompt\\[1\\]"),
        ({"prompt_ids": [3, 4]}, SamplingParams(max_tokens=4), "'prompt_ids' is not supported"),
        ({"prompt": "a", "prompt_token_ids": [3]}, SamplingParams(max_tokens=4), "exactly one"),
        ({"prompt_token_ids": "3 4"}, SamplingParams(max_tokens=4), "must be a list"),
        ({"prompt": [3, 4]}, SamplingParams(max_tokens=4), "'prompt' must be a string"),
    ],
)
def test_bad_requests_fail_clearly_and_others_finish(
    prompt: Any, params: SamplingParams, needle: str,
    tiny_checkpoint: Callable[[str], Path], reference_outputs: list[list[int]],
) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_checkpoint("llama"))))
    engine.add_request(PROMPTS[0], GREEDY_32, request_id="good")
    engine.step()
    with pytest.raises(ValueError, match=needle):
        engine.add_request(prompt, params)
    finished = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished = output
    assert finished is not None and finished.outputs[0].token_ids == reference_outputs[0]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params(make: Callable[[], SamplingParams], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make()


def test_bad_models(tmp_path: Path, tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))
    with pytest.raises(ValueError, match="load_format"):
        LLM(model="llama-3-8b")
    weird = tmp_path / "weird"
    weird.mkdir()
    config = (tiny_checkpoint("llama") / "config.json").read_text()
    (weird / "config.json").write_text(config.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(weird))


@pytest.mark.parametrize("stop", [None, ["\n"]])
def test_final_only_outputs_equal_streamed_ones(
    tokenized_checkpoint: Path, stop: list[str] | None
) -> None:
    """``LLM.generate`` reports each request once and decodes its text at the
    end; text, ids and finish reasons equal those of a request stepped with
    per-step outputs."""
    llm = LLM(model=str(tokenized_checkpoint))
    prompts = ["hello world", "the prompt", "a b c d"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop)
    final = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    streamed: dict[str, object] = {}
    num_outputs = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_outputs += 1
            if out.finished:
                streamed[out.request_id] = out
    assert num_outputs > len(prompts)  # streamed requests report every step
    for request_id, out in zip(ids, final):
        other = streamed[request_id]
        assert [(c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in other.outputs  # type: ignore[attr-defined]
        ]


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_output_kinds_carry_the_same_completion(tokenized_checkpoint: Path,
                                                steps_per_call: int) -> None:
    """DELTA outputs concatenate to the CUMULATIVE one (text, ids, logprobs);
    FINAL_ONLY reports once; the input processor leaves the caller's params alone.
    Also when one engine step receives several core steps' outputs at once, as
    from a core process whose outputs queued up while the API side was busy."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tokenized_checkpoint),
                                                   max_model_len=24))
    core_step = engine.core.step

    def several_steps() -> list[EngineCoreOutput]:
        return [output for _ in range(steps_per_call) for output in core_step()]

    engine.core.step = several_steps  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=1,
                            stop=["zz"])
    ids = {kind: engine.add_request("hello world", params, output_kind=kind)
           for kind in RequestOutputKind}
    assert params.max_tokens is None  # resolved on a copy
    seen: dict[str, list[RequestOutput]] = {request_id: [] for request_id in ids.values()}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    cumulative = seen[ids[RequestOutputKind.CUMULATIVE]][-1].outputs[0]
    deltas = [o.outputs[0] for o in seen[ids[RequestOutputKind.DELTA]]]
    assert "".join(d.text for d in deltas) == cumulative.text
    assert [t for d in deltas for t in d.token_ids] == cumulative.token_ids
    assert [e for d in deltas for e in d.logprobs or []] == cumulative.logprobs
    final = seen[ids[RequestOutputKind.FINAL_ONLY]]
    assert len(final) == 1 and final[0].outputs[0].token_ids == cumulative.token_ids
    assert len(deltas) > 1
