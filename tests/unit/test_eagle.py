"""The EAGLE head: its proposals in the engine equal a dense recomputation of
the head on the request's tokens (so its KV at the target's block ids, its
catch-up over every step and its chain are right), and
``scripts/train_eagle_head.py`` trains, saves, reloads and measures a head
on a tiny target (CPU, a few steps); the shipped head serves the bundled
target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.spec.eagle import (
    EagleHead,
    eagle_head_config,
    head_model_config,
    load_eagle_head,
    restrict_draft_vocab,
    save_eagle_head,
    write_random_eagle_head,
)
from tests.conftest import load_file_module, make_tiny_checkpoint
from tests.unit.test_spec_decode import spy_on_proposals

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_eagle_head.py"
PROMPTS = [[5, 17, 99, 3, 250, 7, 42], [300, 12, 8, 8, 8, 19, 77, 1, 64], [11, 12, 13]]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_file_module(SCRIPT, "train_eagle_head")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("target"), with_tokenizer=True)


def dense_proposals(script: ModuleType, reference: Any, head: EagleHead, tokens: list[int],
                    num: int) -> list[int]:
    """The head's chain on ``tokens`` recomputed from scratch with dense
    attention and transformers' target features (fused with its
    ``hidden_states`` of the aux layers, when the head has some)."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        out = reference.model(input_ids=ids, output_hidden_states=True)
        aux = torch.stack([out.hidden_states[i][0] for i in head.aux_layer_ids], dim=1) \
            if head.aux_layer_ids else None
        features = head.target_features(out.last_hidden_state[0], aux)  # f_0 .. f_m
        last = len(tokens) - 1
        inputs = list(tokens[1:])  # x_{t+1} for rows t = 0 .. last - 1
        feats = [features[t] for t in range(last)]
        proposals: list[int] = []
        for _ in range(num):
            embeds = reference.model.embed_tokens(torch.tensor([inputs]))
            out = script.head_forward(head, embeds, torch.stack(feats).unsqueeze(0), 0)[0, -1]
            proposals.append(int(reference.lm_head(out).argmax()))
            inputs.append(proposals[-1])
            feats.append(out)
    return proposals


@pytest.mark.parametrize("aux", [(), (0, 1)])
def test_eagle_proposals_match_a_dense_reference(script: ModuleType, target: Path,
                                                 tmp_path: Path, aux: tuple[int, ...]) -> None:
    """Also for a head that fuses the streams entering target layers 0 and 1
    (what the engine keeps in every forward, eager here)."""
    import transformers

    config = eagle_head_config(json.loads((target / "config.json").read_text()), aux)
    torch.manual_seed(1)
    head = EagleHead(head_model_config(config, "test"), aux)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.15) if param.dim() > 1 else param.fill_(1.0)
    save_eagle_head(head, config, tmp_path / "head")
    llm = LLM(model=str(target), block_size=4, num_kv_blocks=40, max_num_batched_tokens=8,
              speculative_config={"method": "eagle", "model": str(tmp_path / "head"),
                                  "num_speculative_tokens": 3, "auto_disable": False})
    seen = spy_on_proposals(llm)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    dense = load_eagle_head(tmp_path / "head", torch.device("cpu"), torch.float32,
                            reference.config.num_hidden_layers)
    assert dense.aux_layer_ids == aux
    attn = dense.layer.self_attn
    attn.attn = script.DenseCausalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                            attn.head_dim ** -0.5)
    assert len(seen) > 10
    for tokens, proposals in seen:
        assert dense_proposals(script, reference, dense, tokens, len(proposals)) == proposals


@pytest.mark.parametrize("ids", [(2,), (1, 5), (1, 0), [1.0], "1"])
def test_a_head_whose_aux_layers_do_not_fit_fails_at_start_up(target: Path, tmp_path: Path,
                                                              ids: Any) -> None:
    """The tiny target has 2 layers: a layer past them, unsorted or non-int ids
    are refused at start-up with the field named."""
    path = tmp_path / "head"
    config = json.loads((target / "config.json").read_text())
    write_random_eagle_head(config, path, 0.1)
    head_config = json.loads((path / "config.json").read_text())
    head_config["eagle_aux_hidden_state_layer_ids"] = list(ids) if isinstance(ids, tuple) else ids
    (path / "config.json").write_text(json.dumps(head_config))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(model=str(target), speculative_config={"method": "eagle", "model": str(path),
                                                   "num_speculative_tokens": 2})


def test_aux_layers_auto_is_vllms_choice(script: ModuleType) -> None:
    """--aux-layers auto: layers 2, L // 2 and L - 3 of an L-layer target (fewer when
    they coincide); explicit ids and none pass through."""
    assert script.aux_layers("auto", 8) == (2, 4, 5)
    assert script.aux_layers("auto", 32) == (2, 16, 29)
    assert script.aux_layers("auto", 4) == (1, 2) and script.aux_layers("auto", 2) == (1,)
    assert script.aux_layers("1,3", 8) == (1, 3) and script.aux_layers("none", 8) == ()
    assert script.parse_args([]).aux_layers == "auto"


@pytest.mark.slow
@pytest.mark.parametrize("aux", ["none", "1"])
def test_train_eagle_head_toy_run(target: Path, tmp_path: Path, aux: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        body = "\n".join(f"def f{i}_{j}(x, y):\n    return x * {j} + y\n" for j in range(60))
        (corpus / f"module_{i}.py").write_text(body)
    out = tmp_path / "head"
    subprocess.run([sys.executable, str(SCRIPT), "--toy", "--target", str(target),
                    "--corpus-dir", str(corpus), "--out", str(out), "--aux-layers", aux],
                   check=True, cwd=REPO)
    log = json.loads((out / "train_log.json").read_text())
    head_config = json.loads((out / "config.json").read_text())
    assert head_config.get("eagle_aux_hidden_state_layer_ids", []) == ([] if aux == "none"
                                                                      else [1])
    assert log["train"]["steps"] == 3 and len(log["heldout_agreement"]) == 2
    assert 0.0 <= log["engine"]["eagle"]["acceptance_rate"] <= 1.0
    assert log["engine"]["eagle"]["mean_accepted_length"] >= 1.0
    assert "mean accepted length" in (out / "README.md").read_text()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(target)).generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(model=str(target), speculative_config={
        "method": "eagle", "model": str(out), "num_speculative_tokens": 2,
        "auto_disable": False}).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    if aux == "none":
        return
    # the trained head given a draft vocabulary without training: the 50 most frequent
    # training tokens, the rest of the head as it was
    restricted = tmp_path / "restricted"
    subprocess.run([sys.executable, str(SCRIPT), "--toy", "--target", str(target),
                    "--corpus-dir", str(corpus), "--out", str(restricted), "--from-head",
                    str(out), "--draft-vocab", "50"], check=True, cwd=REPO)
    assert json.loads((restricted / "config.json").read_text())["draft_vocab_size"] == 50
    log = json.loads((restricted / "train_log.json").read_text())
    assert log["train"]["steps"] == 0 and 0 < log["draft_vocab"]["train_token_share"] <= 1
    assert "draft vocabulary" in (restricted / "README.md").read_text()
    spec = LLM(model=str(target), speculative_config={
        "method": "eagle", "model": str(restricted), "num_speculative_tokens": 2,
        "auto_disable": False}).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_bundled_head_speculates_for_the_bundled_target() -> None:
    """``method: eagle`` on the bundled target finds the shipped head without a
    ``model``: greedy output identical to plain decoding, and its first
    proposals accepted far above an untrained head's (~0)."""
    prompts = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 3,
                                                "auto_disable": False})
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.stats()
    drafted = stats["spec_decode_num_drafted_tokens_per_pos"][0]
    assert drafted > 20
    assert stats["spec_decode_num_accepted_tokens_per_pos"][0] / drafted > 0.3


def test_eagle_table_reads_heads_and_flags_a_failed_one(tmp_path: Path) -> None:
    """benchmarks/eagle_table.py: a row of the head's training log and, when its
    benchmark ran, of real.json; exit 1 naming a head without train_log.json."""
    head = tmp_path / "aux"
    (tmp_path / "aux-real").mkdir(parents=True)
    head.mkdir()
    (head / "train_log.json").write_text(json.dumps({
        "args": {"aux_layers": [2, 4, 5]}, "train": {"steps": 7000},
        "heldout_agreement": [0.7, 0.65, 0.6],
        "engine": {"eagle": {"alpha_first": 0.71, "mean_accepted_length": 3.04}}}))
    (tmp_path / "aux-real" / "real.json").write_text(json.dumps({
        "plain": {"decode_tok_s": 1200.0},
        "eagle": {"alpha_first": 0.7, "mean_accepted_length": 3.1, "decode_tok_s": 480.0,
                  "same_tokens_as_plain": False}}))
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "eagle_table.py"),
                            str(head), str(tmp_path / "failed")],
                           capture_output=True, text=True, check=False)
    assert table.returncode == 1
    rows = table.stdout.splitlines()
    assert rows[2] == ("| aux | 2,4,5 | 7000 | 0.70 0.65 0.60 | 0.71 / 3.04 "
                       "| 0.70 / 3.10 / 480 of 1200 tok/s (tokens differ) |")
    assert rows[3] == "| failed | no train_log.json: the run failed (see its log) |"


def restricted_head(target: Path, path: Path, token_ids: list[int]) -> tuple[EagleHead, Any]:
    """A random head for the tiny target restricted to ``token_ids``, written to
    ``path``; with the target (transformers) whose LM head it takes rows of."""
    from transformers import AutoModelForCausalLM

    config = json.loads((target / "config.json").read_text())
    write_random_eagle_head(config, path, 0.1)
    head = load_eagle_head(path, torch.device("cpu"), torch.float32, 2)
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    restricted, head_config = restrict_draft_vocab(
        head, json.loads((path / "config.json").read_text()),
        reference.get_output_embeddings().weight, torch.tensor(token_ids))
    save_eagle_head(restricted, head_config, path)
    return restricted, reference


def test_a_draft_vocabulary_proposes_the_targets_argmax_over_its_tokens(
        target: Path, tmp_path: Path) -> None:
    """``restrict_draft_vocab``: each proposal is the target LM head's argmax
    over the kept tokens (a target id); the head saves and reloads as it was."""
    kept = [3, 5, 7, 11, 42, 99, 250, 300, 301, 17]
    head, reference = restricted_head(target, tmp_path / "head", kept)
    features = torch.randn(64, head.config.hidden_size)

    class Target:
        @staticmethod
        def compute_logits(x: torch.Tensor) -> torch.Tensor:
            return reference.lm_head(x)

    with torch.no_grad():
        full = reference.lm_head(features)
        masked = torch.full_like(full, float("-inf"))
        masked[:, sorted(kept)] = full[:, sorted(kept)]
        got = head.propose(features, Target())  # type: ignore[arg-type]
        assert got.tolist() == masked.argmax(dim=-1).tolist()
        assert set(got.tolist()) <= set(kept)
        loaded = load_eagle_head(tmp_path / "head", torch.device("cpu"), torch.float32, 2)
        assert loaded.propose(features, Target()).tolist() == got.tolist()  # type: ignore[arg-type]
    assert json.loads((tmp_path / "head" / "config.json").read_text())["draft_vocab_size"] == 10


def test_greedy_output_is_identical_with_a_draft_vocabulary_head(target: Path,
                                                                 tmp_path: Path) -> None:
    restricted_head(target, tmp_path / "head", list(range(0, 384, 3)))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(target)).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(target), speculative_config={
        "method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
        "auto_disable": False})
    seen = spy_on_proposals(llm)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert seen and all(t % 3 == 0 for _, proposals in seen for t in proposals)


@pytest.mark.parametrize(("change", "message"), [
    ({"draft_vocab_size": 0}, "draft_vocab_size'=0 is invalid"),
    ({"draft_vocab_size": 10**6}, "draft_vocab_size'=1000000 is invalid"),
    ({"d2t": 10**6}, "'d2t' maps draft ids outside the target's vocabulary"),
])
def test_a_bad_draft_vocabulary_fails_at_start_up(target: Path, tmp_path: Path,
                                                  change: dict[str, int], message: str) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "head"
    restricted_head(target, path, [1, 2, 3])
    if "d2t" in change:
        weights = load_file(str(path / "model.safetensors"))
        weights["d2t"] = weights["d2t"] + change["d2t"]
        save_file(weights, str(path / "model.safetensors"))
    else:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(target), speculative_config={"method": "eagle", "model": str(path),
                                                   "num_speculative_tokens": 2})
