"""Speculative decoding through the whole engine on CPU, tiny random
checkpoints: greedy output (token ids, text, finish reasons) identical with
speculation on and off for every method, at batch 1 and 6, with preemption,
prefix caching, chunked prefill, async scheduling (planning each step
before the one in flight is read, for proposers on the device), penalties,
``min_tokens``, stop strings and ``max_tokens`` landing mid-proposal; a draft model equal to
the target has every proposal accepted, and a draft's proposals are its own
greedy continuation (checked against transformers); seeded sampling
reproduces; ``speculative_config`` is checked at start-up."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.engine.outputs import RequestOutput
from kvserve.spec.eagle import write_random_eagle_head
from kvserve.spec.oracle import PrefixCoin
from tests.conftest import make_tiny_checkpoint

PROMPTS = [
    [5, 17, 99, 3, 250, 7, 42],
    [300, 12, 8, 8, 8, 19, 77, 1, 64, 120, 33, 9, 18, 200, 11, 4, 90, 91, 92, 93, 5],
    [11, 12],
    list(range(20, 57)),
    [5, 17, 99, 3, 250, 7, 42, 8, 8, 8, 8, 1],  # shares a prefix with the first
    [7, 7, 7, 7, 7, 7, 7, 7, 7],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)


def summary(outputs: list[RequestOutput]) -> list[list[tuple[Any, ...]]]:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def spec(method: str, k: int = 3, **extra: Any) -> dict[str, Any]:
    return {"method": method, "num_speculative_tokens": k, "auto_disable": False, **extra}


def spy_on_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """A list that collects (the request's tokens, its proposals) each time
    the runner reads a speculative step's proposals."""
    runner: Any = llm.engine.core.executor
    seen: list[tuple[list[int], list[int]]] = []
    read = runner.spec._read

    def spy(step: Any, output: Any, record: Any) -> None:
        read(step, output, record)
        for request_id, proposals in output.spec_token_ids.items():
            row = runner.rows[request_id]
            seen.append((runner.batch.token_ids[row, :runner.batch.num_tokens[row]].tolist(),
                         proposals))

    runner.spec._read = spy
    return seen


def count_verify_layout_steps(llm: LLM) -> Callable[[], int]:
    """A counter of the runner's steps laid out one token per row."""
    buffers: Any = llm.engine.core.executor.verify
    count = [0]
    fill = buffers.fill

    def spy(*args: Any) -> Any:
        count[0] += 1
        return fill(*args)

    buffers.fill = spy
    return lambda: count[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("target"), with_tokenizer=True)


@pytest.fixture(scope="module")
def random_head(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained EAGLE head for the tiny target (its proposals are poor;
    the output must not care)."""
    path = tmp_path_factory.mktemp("head")
    write_random_eagle_head(json.loads((target / "config.json").read_text()), path, 0.1)
    return path


@pytest.fixture(scope="module")
def near_draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on its matrices: a draft that is right about
    half the time, so verifications accept some proposals and reject others."""
    path = tmp_path_factory.mktemp("near")
    shutil.copytree(target, path, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for file in path.glob("*.safetensors"):
        weights = load_file(file)
        save_file({name: w + 0.05 * w.std() * torch.randn(w.shape, generator=generator)
                   if w.dim() > 1 else w for name, w in weights.items()}, file,
                  metadata={"format": "pt"})
    return path


def generate(path: Path, params: SamplingParams | list[SamplingParams],
             prompts: list[Any] = PROMPTS, **kwargs: Any) -> tuple[list[Any], LLM]:
    llm = LLM(model=str(path), block_size=4, **kwargs)
    outputs = summary(llm.generate(prompts, params, use_tqdm=False))
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # nothing leaked
    return outputs, llm


def method_configs(target: Path, head: Path) -> dict[str, dict[str, Any]]:
    return {
        "ngram": spec("ngram", prompt_lookup_min=1, prompt_lookup_max=3),
        "draft_model": spec("draft_model", model=str(target)),  # the target drafts itself
        "eagle": spec("eagle", model=str(head)),
        "oracle": spec("oracle", acceptance_rate=0.7),
    }


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "oracle"])
@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_output_is_identical_with_speculation(
        target: Path, random_head: Path, method: str, batch: int) -> None:
    prompts = PROMPTS[:batch]
    expected, _ = generate(target, GREEDY, prompts)
    config = method_configs(target, random_head)[method]
    # a tight pool preempts; shared prefixes hit the prefix cache; small chunks
    kwargs = dict(num_kv_blocks=24 if batch > 1 else 64, max_num_batched_tokens=16,
                  speculative_config=config)
    llm = LLM(model=str(target), block_size=4, **kwargs)
    num_verify_steps = count_verify_layout_steps(llm)
    if method == "oracle":  # the first pass records, the second replays
        assert summary(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert summary(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert num_verify_steps() > 0  # steps laid out one token per row (verify_layout.py)
    if batch > 1:
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    if method in ("draft_model", "oracle"):
        assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
@pytest.mark.parametrize("batch", [1, 6])
def test_planning_ahead_gives_identical_output(target: Path, near_draft: Path,
                                              random_head: Path, method: str,
                                              batch: int) -> None:
    """With async scheduling and proposals made on the device, each step is
    planned and queued before the speculative step in flight is read (the
    runner carries its tokens and moves the rows back by its rejections on
    the device): greedy output identical to plain decoding, with preemption,
    prefix caching and small chunks, and with ``plan_ahead`` off."""
    prompts = PROMPTS[:batch]
    expected, _ = generate(target, GREEDY, prompts)
    config = spec(method, model=str(near_draft if method == "draft_model" else random_head))
    for plan_ahead in (True, False):
        llm = LLM(model=str(target), block_size=4, async_scheduling=True,
                  num_kv_blocks=24 if batch > 1 else 64, max_num_batched_tokens=16,
                  speculative_config={**config, "plan_ahead": plan_ahead})
        planned_ahead = spy_on_steps_planned_ahead(llm)
        assert summary(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["spec_decode_num_accepted_tokens"] > 0 or method == "eagle"
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert (sum(planned_ahead) > 10) == plan_ahead
        if batch > 1:
            assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def spy_on_steps_planned_ahead(llm: LLM) -> list[bool]:
    """Per ``Scheduler.schedule`` call: whether a speculative step was in
    flight, not yet read, when it planned."""
    core: Any = llm.engine.core.core
    planned_ahead: list[bool] = []
    schedule = core.scheduler.schedule

    def spy() -> Any:
        planned_ahead.append(any(out.is_spec_step for out, _ in core._in_flight))
        return schedule()

    core.scheduler.schedule = spy
    return planned_ahead


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_forced_oracle_accepts_what_its_coin_says(target: Path, alpha: float,
                                                  async_scheduling: bool) -> None:
    """Also when each step is planned before the one in flight is read (its
    placeholder proposals stay on the device)."""
    config = spec("oracle", k=4, acceptance_rate=alpha, forced_acceptance=True)
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    outputs, llm = generate(target, params, PROMPTS[:2], speculative_config=config,
                            async_scheduling=async_scheduling)
    assert all(len(o[0][0]) == 90 for o in outputs)
    stats = llm.stats()
    drafted = stats["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0  # no first pass: it proposes from the first step
    if alpha in (0.0, 1.0):
        assert accepted == alpha * drafted
    else:
        assert abs(stats["spec_decode_num_accepted_tokens_per_pos"][0]
                   / stats["spec_decode_num_drafted_tokens_per_pos"][0] - alpha) < 0.05


@pytest.mark.parametrize("alpha", [0.6, 0.8, 0.95])
def test_oracle_coin_gives_each_acceptance_length_its_iid_share(alpha: float) -> None:
    """A verification of k proposals accepts exactly j with probability
    alpha^j (1 - alpha), all k with alpha^k; the quasi-random coin is within
    1% of that after 1,000 verifications, for every j and every seed tried."""
    k, num = 6, 1000
    for seed in range(5):
        coin = PrefixCoin(alpha, seed)
        counts = np.zeros(k + 1)
        for _ in range(num):
            correct = coin.draw(k)
            counts[k if correct.all() else int(np.argmin(correct))] += 1
        expected = [alpha ** j * (1 - alpha) for j in range(k)] + [alpha ** k]
        assert np.abs(counts / num - expected).max() < 0.01


def test_forced_acceptance_is_only_for_the_oracle(target: Path) -> None:
    with pytest.raises(ValueError, match="forced_acceptance"):
        LLM(model=str(target), speculative_config=spec("ngram", forced_acceptance=True))


def test_a_draft_equal_to_the_target_is_always_accepted(target: Path) -> None:
    outputs, llm = generate(target, GREEDY, PROMPTS[:3],
                            speculative_config=spec("draft_model", k=4, model=str(target)))
    assert outputs == generate(target, GREEDY, PROMPTS[:3])[0]
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_mean_accepted_length"] > 4.0


def test_draft_proposals_are_its_greedy_continuation(target: Path, tmp_path: Path) -> None:
    """Every proposal the engine's draft makes equals transformers' greedy
    continuation of the draft on the request's tokens, through rollbacks."""
    import transformers

    draft_path = make_tiny_checkpoint("llama", tmp_path / "draft", seed=3, with_tokenizer=True)
    shutil.copy(target / "tokenizer.json", draft_path / "tokenizer.json")
    llm = LLM(model=str(target), block_size=4,
              speculative_config=spec("draft_model", k=3, model=str(draft_path)))
    seen = spy_on_proposals(llm)
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(draft_path).eval()
    assert len(seen) > 10
    for tokens, proposals in seen:
        continuation = list(tokens)
        for _ in proposals:  # the draft's argmax, recomputed from scratch each time
            with torch.no_grad():
                logits = reference(torch.tensor([continuation])).logits[0, -1]
            continuation.append(int(logits.argmax()))
        assert continuation[len(tokens):] == proposals


def hard_params(stops: list[list[str] | None]) -> list[SamplingParams]:
    """Penalties (which must count accepted proposals), ``min_tokens`` masking
    stop ids, several ``max_tokens``, optional stop strings."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    return [
        SamplingParams(max_tokens=20, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, stop=stops[0], **greedy),
        SamplingParams(temperature=0.0, max_tokens=17, min_tokens=9, stop_token_ids=[8, 7, 100],
                       stop=stops[1]),
        SamplingParams(max_tokens=21, stop=stops[2], **greedy),
        SamplingParams(max_tokens=19, repetition_penalty=2.0, stop=stops[3], **greedy),
        SamplingParams(max_tokens=5, stop=stops[4], **greedy),
        SamplingParams(max_tokens=22, frequency_penalty=1.0, stop=stops[5], **greedy),
    ]


@pytest.mark.slow
def test_penalties_min_tokens_stop_strings_and_async(target: Path) -> None:
    plain, _ = generate(target, hard_params([None] * 6))
    texts = [completions[0][1] for completions in plain]
    # a stop string from the middle of each plain completion
    params = hard_params([[t[len(t) // 2:len(t) // 2 + 2]] if len(t) > 4 else None
                          for t in texts])
    expected, _ = generate(target, params)
    assert sum(c[0][3] is not None for c in expected) >= 3  # stop strings did stop them
    for async_scheduling in (False, True):
        got, _ = generate(target, params, async_scheduling=async_scheduling,
                          speculative_config=spec("ngram", k=4, prompt_lookup_min=1))
        assert got == expected
        got, llm = generate(target, params, async_scheduling=async_scheduling,
                            speculative_config=spec("draft_model", k=4, model=str(target)))
        assert got == expected
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    # the oracle proposes the plain (penalised, masked) output itself: every position of a
    # verification must see the proposals before it as outputs to accept them all
    llm = LLM(model=str(target), block_size=4,
              speculative_config=spec("oracle", k=4, acceptance_rate=1.0))
    assert summary(llm.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert summary(llm.generate(PROMPTS, params, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 20


def test_min_tokens_masks_each_position_by_its_own_count(target: Path) -> None:
    """A stop id the model produces right after ``min_tokens``: a verification
    must mask it at the positions still below ``min_tokens`` and no others."""
    free = summary(LLM(model=str(target), block_size=4).generate(
        PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False))
    params = [SamplingParams(temperature=0.0, max_tokens=16, min_tokens=m,
                             stop_token_ids=[c[0][0][m + 1]], ignore_eos=True)
              for m, c in zip((5, 6, 7, 8), free, strict=True)]
    expected, _ = generate(target, params, PROMPTS[:4])
    assert sum(c[0][2] == "stop" for c in expected) >= 2
    llm = LLM(model=str(target), block_size=4,
              speculative_config=spec("oracle", k=4, acceptance_rate=1.0))
    for _ in range(2):
        assert summary(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_seeded_sampling_reproduces(target: Path) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True)
              for s in (1, 2, 3)]
    config = spec("draft_model", model=str(target))
    first, _ = generate(target, params, PROMPTS[:3], speculative_config=config)
    second, _ = generate(target, params[::-1], PROMPTS[2::-1], speculative_config=config)
    assert first == second[::-1]
    assert len({str(o) for o in first}) == 3


def test_logprobs_requests_run_without_speculation(target: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    llm = LLM(model=str(target), block_size=4,
              speculative_config=spec("draft_model", model=str(target)))
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    plain = LLM(model=str(target), block_size=4).generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].logprobs for o in outputs] == [o.outputs[0].logprobs for o in plain]
    assert llm.stats()["spec_decode_num_draft_tokens"] == 0


@pytest.mark.parametrize(("config", "match"), [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa' is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, r"must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min=5"),
    ({"method": "oracle", "num_speculative_tokens": 2, "acceptance_rate": 1.5},
     "acceptance_rate=1.5"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "model is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "runs no network"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_refused(target: Path, config: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model=str(target), speculative_config=config)


def test_mismatched_draft_or_head_is_refused(target: Path, tmp_path: Path,
                                             random_head: Path) -> None:
    other_vocab = make_tiny_checkpoint("llama", tmp_path / "vocab")
    config = json.loads((other_vocab / "config.json").read_text())
    config["vocab_size"] = 200
    (other_vocab / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_size=200 differs"):
        LLM(model=str(target), speculative_config=spec("draft_model", model=str(other_vocab)))
    other_tokenizer = make_tiny_checkpoint("llama", tmp_path / "tok", with_tokenizer=True)
    tokenizer = json.loads((other_tokenizer / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {f"x{t}": i for t, i in tokenizer["model"]["vocab"].items()}
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"tokenizer\.json differs"):
        LLM(model=str(target), speculative_config=spec("draft_model", model=str(other_tokenizer)))
    head = tmp_path / "head"
    shutil.copytree(random_head, head)
    head_config = json.loads((head / "config.json").read_text())
    head_config["hidden_size"] = 48
    (head / "config.json").write_text(json.dumps(head_config))
    with pytest.raises(ValueError, match="hidden_size=48 does not fit"):
        LLM(model=str(target), speculative_config=spec("eagle", model=str(head)))


def test_bundled_target_drafts_with_the_bundled_draft() -> None:
    from kvserve.assets import DRAFT_MODEL
    from kvserve.engine.args import EngineArgs

    config = EngineArgs(speculative_config={"method": "draft_model",
                                            "num_speculative_tokens": 4}).create_engine_config()
    assert config.speculative_config is not None
    assert Path(str(config.speculative_config.model)).name == DRAFT_MODEL


def spy_steps(llm: LLM) -> Callable[[], list[int]]:
    """Wrap the scheduler's policy to record each step's k."""
    scheduler: Any = llm.engine.core.scheduler
    chosen: list[int] = []
    choose = scheduler.spec_policy.num_spec_tokens

    def record(batch_size: int) -> int:
        chosen.append(choose(batch_size))
        return chosen[-1]

    scheduler.spec_policy.num_spec_tokens = record
    return lambda: chosen


def test_disable_by_batch_size(target: Path) -> None:
    llm = LLM(model=str(target), block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                  "disable_by_batch_size": 3})
    chosen = spy_steps(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (5, 9, 13, 30)]
    outputs = summary(llm.generate(PROMPTS[:4], params, use_tqdm=False))
    assert outputs == generate(target, params, PROMPTS[:4])[0]
    assert chosen()[0] == 0 and chosen()[-1] == 2  # 4 requests: off; the last one alone: on


def test_structured_output_requests_run_without_speculation(target: Path) -> None:
    """Grammar requests beside speculating ones: each output matches its
    schema and equals the output without speculation (the grammar's rows
    are masked in the verifying step, their matchers advance)."""
    import jsonschema

    from kvserve.core.structured_output import StructuredOutputParams

    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                               "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    structured = SamplingParams(temperature=0.0, max_tokens=40,
                                structured_output=StructuredOutputParams(json=schema))
    biased = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                            logit_bias={7: 100.0})
    params = [structured, GREEDY, structured, biased, GREEDY]
    expected, _ = generate(target, params, PROMPTS[:5])
    outputs, llm = generate(target, params, PROMPTS[:5],
                            speculative_config=spec("draft_model", model=str(target)))
    assert outputs == expected
    for i in (0, 2):
        jsonschema.validate(json.loads(outputs[i][0][1]), schema)
    assert outputs[3][0][0] == [7] * 8
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_async_scheduling_queues_the_next_step_before_reporting_a_speculative_one(
        target: Path) -> None:
    """With async scheduling a speculative step stays in flight: the call
    that reports it has already planned and queued the next step from it (a
    synchronous run reports it in the call that queued it). Output identical."""
    prompts = PROMPTS[:3]
    expected, _ = generate(target, GREEDY, prompts)
    for async_scheduling in (False, True):
        llm = LLM(model=str(target), block_size=4, async_scheduling=async_scheduling,
                  speculative_config=spec("ngram", prompt_lookup_min=1))
        left_in_flight = spy_on_speculative_steps_left_in_flight(llm)
        assert summary(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.stats()["spec_decode_num_draft_tokens"] > 0
        assert any(left_in_flight) == async_scheduling


def spy_on_speculative_steps_left_in_flight(llm: LLM) -> list[bool]:
    """Per ``EngineCore.step`` call: whether it returned with a speculative
    step still in flight."""
    core: Any = llm.engine.core.core  # the EngineCore behind the in-process client
    left_in_flight: list[bool] = []
    step = core.step

    def spy() -> Any:
        outputs = step()
        left_in_flight.append(any(out.is_spec_step for out, _ in core._in_flight))
        return outputs

    core.step = spy
    return left_in_flight
