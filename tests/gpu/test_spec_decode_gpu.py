"""Speculative decoding on a CUDA device (skipped without one), the bundled
model in float32 with the Triton kernels:
greedy output identical with speculation on and off for every method, at
batch 1 and 8, with CUDA graphs (target steps, the proposer's chain steps)
and eagerly, and identical between the two; the proposer's chain graphs
are captured and replayed; seeded sampling reproduces; the oracle at
acceptance 1.0 accepts all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.assets import MODELS_DIR
from kvserve.engine.speculative import EAGLE_HEAD

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [
    "def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n",
    "for i in range(10):\n    print(", "def parse_args(argv):\n    parser = argparse.",
    "    def __repr__(self):\n        return", "import json\n\nwith open(", "x = [",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)


def random_head(tmp_path: Path) -> Path:
    from kvserve.assets import default_model_path
    from kvserve.spec.eagle import write_random_eagle_head

    return write_random_eagle_head(
        json.loads((default_model_path() / "config.json").read_text()), tmp_path / "head", 0.05)


def configs(tmp_path: Path) -> dict[str, dict[str, Any]]:
    bundled_head = MODELS_DIR / EAGLE_HEAD
    head = bundled_head if (bundled_head / "config.json").is_file() else random_head(tmp_path)
    return {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model"},  # the bundled draft
        "eagle": {"method": "eagle", "model": str(head)},
        "oracle": {"method": "oracle", "acceptance_rate": 0.8},
    }


def run(prompts: list[str], enforce_eager: bool, spec: dict[str, Any] | None,
        passes: int = 1, k: int = 4, spy: bool = False) -> tuple[list[list[int]], LLM]:
    # float32: in bf16 a verify step's rows round differently from a plain
    # step's (the skinny GEMM's one-row and many-row tiles, the decode kernel's
    # split count follows the row count), and near-ties of the bundled model
    # flipped greedy tokens at batch 1 and 8 (H100)
    kwargs: dict[str, Any] = {"dtype": "float32", "device": "cuda", "max_num_seqs": 8,
                              "enforce_eager": enforce_eager}
    if spec is not None:
        kwargs["speculative_config"] = {**spec, "num_speculative_tokens": k,
                                        "auto_disable": False}
    llm = LLM(**kwargs)
    if spy:
        spy_on_verify_steps(llm)
    for _ in range(passes):  # the oracle records in the first pass
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def spy_on_verify_steps(llm: LLM) -> None:
    """Count, on the runner, the verify steps laid out one token per row
    (``verify_steps``) and the verify graph replays (``verify_replays``)."""
    engine: Any = llm.engine
    runner = engine.core.executor
    runner.verify_steps = runner.verify_replays = 0
    fill = runner.verify.fill

    def counted_fill(*args: Any) -> Any:
        runner.verify_steps += 1
        return fill(*args)

    runner.verify.fill = counted_fill
    if runner.graphs is not None:
        replay = runner.graphs.replay_verify

        def counted_replay(size: int) -> Any:
            runner.verify_replays += 1
            return replay(size)

        runner.graphs.replay_verify = counted_replay


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_verify_graphs_greedy_identical_to_eager_and_plain(batch: int, k: int) -> None:
    """Verify steps through the verify CUDA graphs (one token per row, the
    decode kernel) against the same steps eagerly and against plain decoding:
    the same greedy tokens; every verify step of the graphed run replayed a
    verify graph of size (batch size padded) x (1 + k)."""
    prompts = PROMPTS[:batch]
    spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    expected, _ = run(prompts, False, None)
    graphed, llm = run(prompts, False, spec, k=k, spy=True)
    engine: Any = llm.engine
    runner = engine.core.executor
    assert runner.graphs.verify_sizes == sorted(
        size * (1 + k) for size in runner.cuda_graph_sizes if size <= 64)
    assert runner.verify_steps > 10
    assert runner.verify_replays == runner.verify_steps
    assert graphed == expected
    eager, llm = run(prompts, True, spec, k=k, spy=True)
    engine = llm.engine
    runner = engine.core.executor
    assert runner.graphs is None and runner.verify_steps > 10
    assert eager == expected


def test_verify_layout_on_cuda_writes_every_row_before_attending() -> None:
    """The Triton backend on a verify step laid out one token per row, given
    the fused rotary: on the GPU its programs run at once, so a decode kernel
    that wrote each row's KV itself would leave the rows after it reading the
    poisoned (NaN) slots. Against the torch reference on the per-request layout."""
    from kvserve.attention.backend import FusedRope, get_attention_backend
    from kvserve.layers.rotary import RotaryEmbedding
    from tests.attention_cases import make_case, verify_layout

    case = make_case([5, 3, 1, 4, 7], [300, 70, 21, 5, 1030], 32, 8, 128, 16, torch.bfloat16,
                     device="cuda")
    cache = case.kv_cache.clone()
    _, num_blocks, block_size, heads, dim = cache.shape
    cache.view(2, num_blocks * block_size, heads, dim)[:, case.metadata.slot_mapping] = (
        float("nan"))
    ref_cache = cache.clone()
    metadata, positions = verify_layout(case, 4)
    num_tokens = case.metadata.num_tokens
    rope = RotaryEmbedding(128, 2048, {}).to("cuda")
    pad = torch.zeros((4, *case.q.shape[1:]), dtype=case.q.dtype, device="cuda")
    q, k, v = (torch.cat([t, pad[:, :t.shape[1]]]) for t in (case.q, case.k, case.v))
    out = get_attention_backend("triton").forward(
        q.clone(), k, v, cache, metadata, 0.1, None,
        FusedRope(positions, rope.cos_sin_cache, 128))[:num_tokens]
    ref_q, ref_k = rope(positions[:num_tokens], case.q, case.k)
    ref = get_attention_backend("torch").forward(ref_q, ref_k, case.v, ref_cache, case.metadata,
                                                 0.1, None)
    assert not out.isnan().any()
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "oracle"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_identical_with_speculation_graphs_on_and_off(
        method: str, batch: int, tmp_path: Path) -> None:
    prompts = PROMPTS[:batch]
    spec = configs(tmp_path)[method]
    passes = 2 if method == "oracle" else 1
    expected, _ = run(prompts, False, None)
    graphed, llm = run(prompts, False, spec, passes)
    assert graphed == expected
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    proposer = llm.engine.core.executor.spec.device_proposer  # type: ignore[attr-defined]
    if proposer is not None:
        assert proposer._graphs, "the proposer's chain steps were captured"
    eager, _ = run(prompts, True, spec, passes)
    assert eager == expected


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_planning_ahead_on_cuda_gives_identical_output(method: str, tmp_path: Path) -> None:
    """Async scheduling (the default on CUDA) plans each step before the
    speculative step in flight is read: the runner carries its tokens and
    moves the rows back by its rejections on the device, in the buffers the
    verify graphs read. Greedy output equal to plain decoding at batch 1 and
    8, with ``plan_ahead`` on and off."""
    from tests.unit.test_spec_decode import spy_on_steps_planned_ahead

    for batch in (1, 8):
        expected, _ = run(PROMPTS[:batch], False, None)
        for plan_ahead in (True, False):
            llm = LLM(dtype="float32", device="cuda", max_num_seqs=8, speculative_config={
                **configs(tmp_path)[method], "num_speculative_tokens": 4,
                "auto_disable": False, "plan_ahead": plan_ahead})
            spy_on_verify_steps(llm)
            planned_ahead = spy_on_steps_planned_ahead(llm)
            outputs = llm.generate(PROMPTS[:batch], GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected
            runner: Any = llm.engine.core.executor
            assert runner.verify_replays > 10
            assert (sum(planned_ahead) > 10) == plan_ahead
            stats = llm.stats()
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_eagle_head_with_aux_layers_proposes_the_same_graphed_and_eager(tmp_path: Path) -> None:
    """A head fusing the streams entering target layers 2, 4 and 5 (written by
    every forward, inside the decode, token and verify graphs too): the same
    proposals at every step with CUDA graphs and without (so no graph reads a
    stale stream), and greedy output equal to plain decoding."""
    from kvserve.assets import default_model_path
    from kvserve.spec.eagle import write_random_eagle_head
    from tests.unit.test_spec_decode import spy_on_proposals

    head = write_random_eagle_head(json.loads((default_model_path() / "config.json").read_text()),
                                   tmp_path / "head", 0.05, aux_layer_ids=(2, 4, 5))
    spec = {"method": "eagle", "model": str(head)}
    expected, _ = run(PROMPTS, False, None)
    seen = {}
    for eager in (False, True):
        kwargs: dict[str, Any] = {
            "dtype": "float32", "device": "cuda", "max_num_seqs": 8, "enforce_eager": eager,
            "speculative_config": {**spec, "num_speculative_tokens": 4, "auto_disable": False}}
        llm = LLM(**kwargs)
        seen[eager] = spy_on_proposals(llm)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert len(seen[False]) > 50
    assert sorted(seen[False]) == sorted(seen[True])


def test_oracle_at_full_acceptance_accepts_everything() -> None:
    _, llm = run(PROMPTS[:4], False, {"method": "oracle", "acceptance_rate": 1.0}, passes=2)
    stats = llm.stats()
    assert stats["spec_decode_acceptance_rate"] == 1.0
    assert stats["spec_decode_mean_accepted_length"] > 4.5


def test_seeded_sampling_reproduces_on_cuda() -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=48,
                             ignore_eos=True) for s in range(4)]
    spec = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 4,
                                   "auto_disable": False}}
    first = LLM(dtype="bfloat16", device="cuda", **spec).generate(PROMPTS[:4], params,
                                                                 use_tqdm=False)
    second = LLM(dtype="bfloat16", device="cuda", **spec).generate(PROMPTS[:4], params,
                                                                  use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]



def test_structured_output_beside_speculation_on_cuda() -> None:
    """The 20 fixed schemas (grammar requests decode one token a step) beside
    plain requests that speculate, with CUDA graphs: every output validates
    and equals the output without speculation."""
    import jsonschema

    from kvserve.core.structured_output import StructuredOutputParams
    from tests.e2e.structured_schemas import SCHEMAS

    params = [SamplingParams(temperature=0.0, max_tokens=160,
                             structured_output=StructuredOutputParams(json=schema))
              for schema in SCHEMAS] + [GREEDY] * 4
    kwargs: dict[str, Any] = {"dtype": "float32", "device": "cuda", "max_num_seqs": 32}
    plain = LLM(**kwargs)
    # the prompt the e2e test sends (a chat turn), whose greedy JSON ends inside max_tokens
    chat = plain.get_tokenizer().apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "Reply with JSON."}], True, {})
    prompts: list[Any] = [chat] * len(SCHEMAS) + PROMPTS[:4]
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(**kwargs, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                            "auto_disable": False})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    for schema, output in zip(SCHEMAS, outputs, strict=False):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
