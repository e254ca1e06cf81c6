"""scripts/train_default_model.py end to end on its --tiny config (CPU, a few steps).

One subprocess run writes the three directories (pre-training, chat stage, stop examples);
the tests check that transformers (and kvserve) loads
the target and draft with the shared tokenizer and chat template, that the LoRA adapter is
in PEFT's layout, and that the JSON logs and model card say what the issue asks for. The
docstring rewrite of the training files (`--docstrings summary`) is unit-tested on its own.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

from tests.conftest import load_file_module

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_default_model.py"


@pytest.fixture(scope="module")
def tdm() -> ModuleType:
    """The script as a module (it is not a package and must not import kvserve)."""
    return load_file_module(SCRIPT, "train_default_model")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default_model")
    run_tiny(out)
    return out


def run_tiny(out: Path, *extra: str) -> None:
    """The script with ``--tiny`` on the CPU into ``out``; fails the test if it fails."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", *extra, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def model_dirs(out: Path) -> dict[str, Path]:
    metrics = json.loads((out / "metrics.json").read_text())
    return {key: out / name for key, name in metrics["names"].items()}


@pytest.mark.slow
def test_writes_the_three_directories_and_logs(run_dir: Path) -> None:
    dirs = model_dirs(run_dir)
    assert dirs["target"].name.startswith("kvserve-code-")
    assert dirs["draft"].name.startswith("kvserve-code-draft-")
    assert dirs["lora"].name == "kvserve-code-lora-tests"
    for key in ("target", "draft"):
        for name in (
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "README.md",
        ):
            assert (dirs[key] / name).is_file(), f"{key}: {name} missing"
    for name in ("corpus.json", "metrics.json", "train_log.json"):
        assert (run_dir / name).is_file()
    corpus = json.loads((run_dir / "corpus.json").read_text())
    assert corpus["python_version"]
    for split in ("train", "val", "heldout", "lora_train", "lora_heldout"):
        assert corpus["splits"][split]["num_files"] > 0
        assert corpus["splits"][split]["num_tokens"] > 0
    train = set(corpus["splits"]["train"]["files"])
    assert not train & set(corpus["splits"]["heldout"]["files"])
    assert not any("test" in f.split("/")[0] for f in train)
    docstrings = corpus["docstrings"]  # the default, --docstrings summary
    assert docstrings["mode"] == "summary"
    assert docstrings["rewritten_splits"] == ["train", "lora_train"]
    stats = docstrings["stats"]
    assert set(stats) == {"train", "lora_train", "heldout_diagnostic"}
    train_stats = stats["train"]
    assert train_stats["files"] == corpus["splits"]["train"]["num_files"]
    assert 0 < train_stats["shortened"] <= train_stats["docstrings"]
    assert train_stats["bytes_after"] == corpus["splits"]["train"]["num_bytes"]
    assert train_stats["bytes_before"] > train_stats["bytes_after"]
    assert train_stats["tokens_after"] == corpus["splits"]["train"]["num_tokens"]
    assert train_stats["tokens_before"] > train_stats["tokens_after"]
    # held-out files are measured as written: the rewrite only feeds a diagnostic stream
    heldout = stats["heldout_diagnostic"]
    assert heldout["files"] == corpus["splits"]["heldout"]["num_files"]
    assert heldout["tokens_before"] == corpus["splits"]["heldout"]["num_tokens"]


@pytest.mark.slow
def test_models_load_in_transformers_and_generate(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    dirs = model_dirs(run_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(dirs["target"]))
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.eos_token == "<|eos|>"
    assert tokenizer.pad_token == "<|pad|>"
    ids = tokenizer("def f(x):\n    return x\n").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat == "<|bos|><|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n"
    for key in ("target", "draft"):
        config = json.loads((dirs[key] / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
        with safe_open(str(dirs[key] / "model.safetensors"), "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())  # noqa: SIM118
        model = AutoModelForCausalLM.from_pretrained(str(dirs[key]), dtype=torch.float32)
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, len(ids) + 4)
        assert (dirs[key] / "tokenizer.json").read_text() == (
            dirs["target"] / "tokenizer.json"
        ).read_text()


@pytest.mark.slow
def test_lora_adapter_is_in_peft_layout(run_dir: Path) -> None:
    dirs = model_dirs(run_dir)
    config = json.loads((dirs["lora"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert config["bias"] == "none" and config["fan_in_fan_out"] is False
    assert config["base_model_name_or_path"] == dirs["target"].name
    base = json.loads((dirs["target"] / "config.json").read_text())
    hidden, head_dim = base["hidden_size"], base["head_dim"]
    out_features = {
        "q_proj": base["num_attention_heads"] * head_dim,
        "k_proj": base["num_key_value_heads"] * head_dim,
        "v_proj": base["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    with safe_open(str(dirs["lora"] / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        expected = {
            f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
            for i in range(base["num_hidden_layers"])
            for m in config["target_modules"]
            for ab in "AB"
        }
        assert keys == expected
        prefix = "base_model.model.model.layers.0.self_attn"
        for m, out_dim in out_features.items():
            assert tuple(f.get_tensor(f"{prefix}.{m}.lora_A.weight").shape) == (8, hidden)
            assert tuple(f.get_tensor(f"{prefix}.{m}.lora_B.weight").shape) == (out_dim, 8)
    assert (dirs["lora"] / "tokenizer.json").is_file()


@pytest.mark.slow
def test_metrics_and_model_card(run_dir: Path) -> None:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["errors"] == {}
    assert metrics["docstrings"] == "summary"
    for key in ("target", "draft"):
        assert metrics[key]["heldout_loss"] > 0 and metrics[key]["num_params"] > 0
        assert metrics[key]["steps"] > 0
        assert metrics[key]["heldout_bits_per_byte"] > 0
        assert metrics[key]["heldout_summary_loss"] > 0
        assert metrics[key]["heldout_summary_bits_per_byte"] > 0
        sft = metrics[key]["sft"]
        assert sft["val_loss_before"] > 0 and sft["val_loss_after"] > 0
    assert metrics["lora"]["heldout_loss_base"] > 0 and metrics["lora"]["heldout_loss_lora"] > 0
    assert 0.0 <= metrics["signature_validity"]["valid_share"] <= 1.0
    assert metrics["signature_validity"]["num_prompts"] > 0
    assert 0.0 <= metrics["acceptance"]["alpha"] <= 1.0
    assert len(metrics["samples"]) == 3
    card = (model_dirs(run_dir)["target"] / "README.md").read_text()
    for needle in (
        "## Corpus",
        "perplexity",
        "bits per byte",
        "acceptance",
        "`--docstrings summary`",
        "def fibonacci(n):",
        "class Stack:",
    ):
        assert needle in card


# --------------------------------------------------------------------------- docstring rewrite

DOCSTRING_SOURCE = '''#!/usr/bin/env python
"""Module summary.

More about the module, with "quotes" and a \\d.
"""

import os

SEPARATE = """not a docstring:
an assignment"""


class Stack:
    \'\'\'Class summary in single quotes.

    Details.
    \'\'\'

    size = 0

    def push(self, item):
        "A single-quoted one-liner stays as it is."
        return item

    def pop(self):
        \'A single-quoted docstring continued \\
across a line: its first line alone is not the value, so it is kept.\'
        return None

    async def drain(self):
        """
        Async summary after a blank first line.

        Args:
            none
        """

        def inner():
            r"""Nested raw \\d summary
            continues here."""
            return "inner"  # a "comment" """

        class Inner:
            u"""Nested class.

            Body."""

        return inner, Inner


def ends_with_quote():
    """Returns "x"
    so the one-line form would need a fourth quote: kept."""
    text = """a string in the body
    that is not a docstring"""
    return text


def code_on_the_same_line():
    """Summary.

    Details."""; value = 1  # noqa: E702
    return value


def empty():
    """
    """
'''


def docstring_literal(node: ast.AST) -> ast.Constant | None:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = node.body[0] if node.body else None
        if (
            isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            return doc.value
    return None


def docstring_spans(source: str) -> list[tuple[int, int]]:
    """Character spans of every docstring literal, found independently of the script."""
    lines = source.split("\n")
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)

    def offset(lineno: int, col: int) -> int:
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    spans = []
    for node in ast.walk(ast.parse(source)):
        doc = docstring_literal(node)
        if doc is not None:
            assert doc.end_lineno is not None and doc.end_col_offset is not None
            start = offset(doc.lineno, doc.col_offset)
            spans.append((start, offset(doc.end_lineno, doc.end_col_offset)))
    return sorted(spans)


def outside_docstrings(source: str) -> list[str]:
    pieces, pos = [], 0
    for start, end in docstring_spans(source):
        pieces.append(source[pos:start])
        pos = end
    return [*pieces, source[pos:]]


def docstrings_by_owner(source: str) -> dict[str, str | None]:
    tree = ast.parse(source)
    owners = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    return {getattr(n, "name", "<module>"): ast.get_docstring(n, clean=False) for n in owners}


def test_summarize_docstrings_shortens_each_kind_in_place(tdm: ModuleType) -> None:
    new, stats = tdm.summarize_docstrings(DOCSTRING_SOURCE)
    assert docstrings_by_owner(new) == {
        "<module>": "Module summary.",
        "Stack": "Class summary in single quotes.",
        "push": "A single-quoted one-liner stays as it is.",
        "pop": "A single-quoted docstring continued across a line: its first line alone is "
        "not the value, so it is kept.",
        "drain": "Async summary after a blank first line.",
        "inner": "Nested raw \\d summary",
        "Inner": "Nested class.",
        "ends_with_quote": 'Returns "x"\n    so the one-line form would need a fourth quote: kept.',
        "code_on_the_same_line": "Summary.",
        "empty": "",
    }
    # prefixes and quotes as written, each rewritten docstring on one line
    for literal in (
        '"""Module summary."""',
        "'''Class summary in single quotes.'''",
        '"""Async summary after a blank first line."""',
        'r"""Nested raw \\d summary"""',
        'u"""Nested class."""',
        '"""Summary."""; value = 1  # noqa: E702',
        '""""""',
    ):
        assert literal in new
    # every byte outside the docstrings is unchanged, string literals in the code included
    assert outside_docstrings(new) == outside_docstrings(DOCSTRING_SOURCE)
    assert 'SEPARATE = """not a docstring:\nan assignment"""' in new
    assert 'return "inner"  # a "comment" """' in new
    assert stats.docstrings == 10
    assert stats.shortened == 7 and stats.one_line == 1 and stats.kept_inexact == 2
    assert stats.files_changed == 1 and stats.files_unparsed == stats.files_reverted == 0
    assert stats.bytes_before == len(DOCSTRING_SOURCE.encode()) > stats.bytes_after
    assert stats.bytes_after == len(new.encode())
    again, _ = tdm.summarize_docstrings(new)
    assert again == new  # idempotent


def test_summarize_docstrings_keeps_unparsable_and_docstringless_files(tdm: ModuleType) -> None:
    broken = 'def f(:\n    """Summary.\n\n    Details.\n    """\n'
    assert tdm.summarize_docstrings(broken)[0] == broken
    assert tdm.summarize_docstrings(broken)[1].files_unparsed == 1
    python2 = 'def f():\n    """Summary.\n\n    More."""\n    print "x"\n'
    assert tdm.summarize_docstrings(python2)[0] == python2
    lone_cr = 'def f():\r    """Summary.\r\r    More."""\r    return 1\r'
    assert tdm.summarize_docstrings(lone_cr)[0] == lone_cr
    plain = "x = 1\n\n\ndef f():\n    return x\n"
    new, stats = tdm.summarize_docstrings(plain)
    assert new == plain and stats.docstrings == 0 and stats.files_changed == 0


def test_summarize_docstrings_non_ascii_columns(tdm: ModuleType) -> None:
    # ast columns count UTF-8 bytes; the rewrite must land on the same characters
    head, tail = 'π = "ünïcode"; α = 1\n\n\ndef f():\n    ', '\n    return "é"\n'
    new, stats = tdm.summarize_docstrings(head + '"""Ünïcode summary é.\n\n    Détails."""' + tail)
    assert stats.shortened == 1
    assert new == head + '"""Ünïcode summary é."""' + tail


@pytest.mark.parametrize("name", ["argparse.py", "dataclasses.py", "inspect.py", "json/decoder.py"])
def test_summarize_docstrings_on_stdlib_files(tdm: ModuleType, name: str) -> None:
    source = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
    new, stats = tdm.summarize_docstrings(source)
    assert stats.files_changed == 1 and stats.shortened > 0
    assert outside_docstrings(new) == outside_docstrings(source)
    before, after = docstrings_by_owner(source), docstrings_by_owner(new)
    assert before.keys() == after.keys()
    for owner, doc in after.items():
        if doc is not None:
            assert "\n" not in doc or doc == before[owner]  # one line, or kept as written
    # the code is the same program: equal ASTs once the docstrings are blanked
    assert blank_docstrings(new) == blank_docstrings(source)


def blank_docstrings(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        doc = docstring_literal(node)
        if doc is not None:
            doc.value = ""
    return ast.dump(tree)


def test_summarize_split_with_workers_matches_one_process(tdm: ModuleType) -> None:
    files = [(f"f{i}.py", DOCSTRING_SOURCE.replace("Stack", f"Stack{i}")) for i in range(6)]
    files.append(("broken.py", "def f(:\n"))
    one, one_stats = tdm.summarize_split(files, workers=1)
    two, two_stats = tdm.summarize_split(files, workers=2)
    assert one == two and one_stats == two_stats
    assert [rel for rel, _ in one] == [rel for rel, _ in files]
    assert one_stats.files == 7 and one_stats.files_unparsed == 1
    assert one_stats.shortened == 6 * 7


def test_token_byte_lengths_spell_the_text(tdm: ModuleType) -> None:
    texts = ["def f(x):\n    return x  # é, 漢字\n"] * 20
    tok = tdm.train_tokenizer(texts, 300)
    lens = tdm.token_byte_lengths(tok)
    ids = tok.encode(texts[0]).ids  # <|bos|> first
    assert ids[0] == tok.token_to_id(tdm.BOS) and lens[ids[0]] == 0
    assert int(lens[ids].sum()) == len(texts[0].encode())


@pytest.mark.slow
def test_stop_and_chat_stages_and_kvserve_loads_the_target(run_dir: Path) -> None:
    """Issue 28: stop examples and chat pairs were built, both stages ran for target and
    draft, the penalty was chosen by the evaluation, <|end|> stops, and kvserve serves it."""
    from kvserve import LLM, SamplingParams

    corpus = json.loads((run_dir / "corpus.json").read_text())
    assert corpus["tasks"]["stop_examples"] > 0 and corpus["tasks"]["chat_train_pairs"] > 0
    assert corpus["tasks"]["chat_second_turn_examples"] > 0  # --tiny: half the pairs
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in ("target", "draft"):
        chat = metrics[key]["sft"]
        assert chat["steps"] > 0 and chat["best_chat_val_loss"] <= chat["chat_val_loss_before"]
    runs = metrics["stop_and_chat"]
    assert [r["repetition_penalty"] for r in runs] == [1.0, 1.1, 1.3]
    assert all(0 <= r["stop_share"] <= 1 and r["chat_prompts"] > 0 for r in runs)
    assert all(0 <= r["second_turn_answer_share"] <= 1 for r in runs)
    chosen = metrics["generation_defaults"]["chosen"]
    dirs = model_dirs(run_dir)
    gen = json.loads((dirs["target"] / "generation_config.json").read_text())
    assert gen.get("repetition_penalty", 1.0) == chosen
    assert (gen["dry_multiplier"], gen["dry_allowed_length"], gen["dry_sequence_breakers"],
            gen["temperature"]) == (0.8, 8, [], 0.0)
    config = json.loads((dirs["target"] / "config.json").read_text())
    assert config["eos_token_id"] == [1, 6]  # <|eos|>, and <|end|> closes a chat turn
    llm = LLM(model=str(dirs["target"]), device="cpu", seed=0)
    out = llm.generate(["def f(x):\n"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert 1 <= len(out.outputs[0].token_ids) <= 4
    reply = llm.chat([{"role": "user", "content": "Return x."}], SamplingParams(max_tokens=4))
    assert reply[0].outputs[0].finish_reason in ("stop", "length")


def test_family_table_reads_a_run_and_flags_a_failed_one(run_dir: Path, tmp_path: Path) -> None:
    """benchmarks/family_table.py: one row of the run's own figures, and exit 1 naming a
    directory without metrics.json (a variant that failed)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "family_table.py"),
                            str(run_dir), str(tmp_path), "--baseline-bpb", "2.0"],
                           capture_output=True, text=True, check=False)
    assert table.returncode == 1
    rows = table.stdout.splitlines()
    bpb = metrics["target"]["heldout_bits_per_byte"]
    assert rows[2].startswith(f"| {run_dir.name} | {bpb:.3f} ({bpb / 2 - 1:+.1%}) | ")
    assert f"| {metrics['acceptance']['alpha']:.3f} | — |" in rows[2]
    shares = next(r for r in metrics["stop_and_chat"]
                  if r["repetition_penalty"] == metrics["generation_defaults"]["chosen"])
    assert (f"| {shares['second_turn_answer_share']:.0%} / "
            f"{shares['second_turn_stop_share']:.0%} |") in rows[2]
    assert rows[3] == f"| {tmp_path.name} | no metrics.json: the run failed (see its log) |"


# --------------------------------------------------------------------------- warm start


@pytest.fixture(scope="module")
def warm_dir(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--init-from the tiny run above: its tokenizer, target, draft and adapter continued."""
    out = tmp_path_factory.mktemp("default_model_warm")
    run_tiny(out, "--init-from", str(run_dir))
    return out


def test_released_model_loads_exactly_with_chat_eos(tdm: ModuleType, run_dir: Path) -> None:
    dirs = tdm.released_dirs(run_dir)
    cold = model_dirs(run_dir)
    assert dirs == {"target": cold["target"], "draft": cold["draft"]}
    tok = tdm.load_released_tokenizer(dirs["target"])
    model, size = tdm.load_released_model(dirs["draft"], tok)
    assert model.config.eos_token_id == [1, 6]
    assert size.hidden_size == model.config.hidden_size
    with safe_open(str(dirs["draft"] / "model.safetensors"), "pt") as f:
        state = model.state_dict()
        for key in f.keys():  # noqa: SIM118
            assert torch.equal(state[key], f.get_tensor(key).float()), key
    with pytest.raises(SystemExit, match="expected one kvserve-code-"):
        tdm.released_dirs(run_dir / "kvserve-code-lora-tests")


@pytest.mark.slow
def test_warm_start_continues_the_released_family(
    tdm: ModuleType, run_dir: Path, warm_dir: Path
) -> None:
    cold, warm = model_dirs(run_dir), model_dirs(warm_dir)
    assert {k: d.name for k, d in warm.items()} == {k: d.name for k, d in cold.items()}
    for key in ("target", "draft", "lora"):  # the tokenizer is reused byte for byte
        assert (warm[key] / "tokenizer.json").read_bytes() == (
            cold["target"] / "tokenizer.json"
        ).read_bytes()
    metrics = json.loads((warm_dir / "metrics.json").read_text())
    assert metrics["errors"] == {}
    init = metrics["init_from"]
    assert init["path"] == str(run_dir) and init["target"] == cold["target"].name
    import hashlib

    for key in ("target", "draft"):
        digest = hashlib.sha256((cold[key] / "model.safetensors").read_bytes()).hexdigest()
        assert init[f"{key}_sha256"] == digest
        assert metrics[key]["sft"]["steps"] > 0
        # started from the released weights: at the same step a warm model's validation
        # loss is below the cold run's, which began from random weights
        cold_log = json.loads((run_dir / "train_log.json").read_text())["phases"][key]
        warm_log = json.loads((warm_dir / "train_log.json").read_text())["phases"][key]
        first = lambda log: next(h for h in log["history"] if "val_loss" in h)  # noqa: E731
        assert first(warm_log)["step"] == first(cold_log)["step"]
        assert first(warm_log)["val_loss"] < first(cold_log)["val_loss"]
    assert metrics["lora"]["init_from"] == str(run_dir / "kvserve-code-lora-tests")
    args = json.loads((warm_dir / "train_log.json").read_text())["args"]
    assert args["init_from"] == str(run_dir)
    # the split rule is the released one: nothing held out by it is trained on
    corpus = json.loads((warm_dir / "corpus.json").read_text())
    train = corpus["splits"]["train"]["files"]
    assert train and all(tdm.classify(rel) == "train" for rel in train)
    assert not set(train) & set(corpus["splits"]["heldout"]["files"])
    card = (warm["target"] / "README.md").read_text()
    for needle in ("from a warm start", "Warm start (`--init-from`)", metrics["device_name"],
                   "the starting checkpoint's, unchanged",
                   "## Starting checkpoint (pre-training, from its card)", "### Corpus"):
        assert needle in card, needle
    config = json.loads((warm["target"] / "config.json").read_text())
    assert config["eos_token_id"] == [1, 6]


def test_model_size_flags_set_the_shapes_and_refuse_bad_ones(
        tdm: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """--target-size / --draft-size: five integers, over the preset (also under --tiny);
    a malformed or inconsistent shape exits naming the flag and what is allowed."""
    args = tdm.parse_args(["--out", "x", "--tiny", "--target-size", "96,3,4,2,160"])
    assert args.target == tdm.ModelSize(96, 3, 4, 2, 160)
    assert args.draft == tdm.TINY_PRESET["draft"]
    assert tdm.parse_args(["--out", "x"]).target == tdm.FULL_PRESET["target"]
    for bad, why in [("96,3,4,3,160", "kv_heads must divide heads"),
                     ("96,3,4", "five integers"), ("0,1,1,1,1", ">= 1")]:
        with pytest.raises(SystemExit):
            tdm.parse_args(["--out", "x", "--draft-size", bad])
        err = capsys.readouterr().err
        assert "--draft-size" in err and why in err
