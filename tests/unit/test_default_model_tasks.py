"""The bundled model's task data and chat-stage helpers (scripts/default_model_*.py, issue 28).

Stop examples must end exactly where `ast` says a top-level unit ends, followed by <|eos|>;
instruction pairs must be rendered with the tokenizer's chat template with the loss on the
assistant's tokens only; the greedy loop of the evaluation must equal unbatched greedy and
stop on a stop id; the scores must tell a parsable function from a fragment.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from tests.conftest import load_file_module

REPO = Path(__file__).resolve().parents[2]

SOURCE = '''"""Module."""
import os


@decorator
def first(a, b):
    """Add two numbers together.

    More prose.
    """
    return a + b


class Box:
    """A box of things to hold."""

    def method(self):
        """Not a top-level function: no pair of its own."""
        return 1


async def fetch(url):
    """Fetch a url from the network."""
    return await get(url)


def short():
    """Two words."""
    return 0

x = 1
'''


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "scripts"))
    return load_file_module(REPO / "scripts" / f"{name}.py", name)


@pytest.fixture(scope="module")
def tasks() -> ModuleType:
    return load("default_model_tasks")


@pytest.fixture(scope="module")
def sft() -> ModuleType:
    return load("default_model_sft")


@pytest.fixture(scope="module")
def tdm() -> ModuleType:
    return load("train_default_model")


def test_units_end_where_ast_says(tasks: ModuleType) -> None:
    units = tasks.top_level_units("m.py", SOURCE)
    assert [(u.kind, u.name) for u in units] == [
        ("def", "first"), ("class", "Box"), ("def", "fetch"), ("def", "short")
    ]
    first = units[0]
    assert first.source.startswith("@decorator\ndef first(a, b):\n")
    assert first.source.endswith("    return a + b\n")
    assert units[1].source.endswith("        return 1\n")  # the class ends after its method
    for u in units:
        tree = ast.parse(u.source)
        assert len(tree.body) == 1 and tree.body[0].name == u.name  # type: ignore[attr-defined]
    assert tasks.top_level_units("bad.py", "def f(:\n") == []
    assert tasks.stop_examples([("m.py", SOURCE)], max_chars=60) == [units[3].source]


def test_stop_stream_puts_eos_after_each_unit(tasks: ModuleType) -> None:
    bos, eos = 0, 1

    def encode(texts: list[str]) -> list[list[int]]:
        return [[bos, *(ord(c) + 2 for c in t)] for t in texts]

    units = tasks.stop_examples([("m.py", SOURCE)], max_chars=10_000)
    stream, starts = tasks.encode_examples(encode, units, eos, max_len=400)
    kept = [u for u in units if len(u) + 2 <= 400]
    assert len(kept) == starts.size >= 2
    for i, unit in enumerate(kept):
        end = starts[i + 1] if i + 1 < starts.size else stream.size
        example = stream[starts[i] : end].tolist()
        assert example[0] == bos and example[-1] == eos and eos not in example[:-1]
        assert "".join(chr(t - 2) for t in example[1:-1]) == unit
        assert unit.endswith("\n")


def test_instruction_pairs(tasks: ModuleType) -> None:
    pairs = tasks.instruction_pairs([("m.py", SOURCE)], max_chars=10_000)
    assert [p.name for p in pairs] == ["first", "fetch"]  # no class, no method, no 2-word one
    first = pairs[0]
    assert "Add two numbers together." in first.user and "More prose" not in first.user
    assert first.with_signature == first.user.endswith("\n\ndef first(a, b):")
    assert first.assistant.startswith("@decorator\ndef first")
    assert all(isinstance(ast.parse(p.assistant).body[0], ast.FunctionDef | ast.AsyncFunctionDef)
               for p in pairs)
    many = [(f"f{i}.py", f'def g{i}(x):\n    """Return x plus one more."""\n    return x + 1\n')
            for i in range(40)]
    flags = [p.with_signature for p in tasks.instruction_pairs(many, 10_000)]
    assert 0 < sum(flags) < len(flags)  # both forms occur


@pytest.mark.slow  # imports the training script (transformers): ~10 s, more on a busy CPU
def test_chat_examples_mask_all_but_the_assistant(tasks: ModuleType, tdm: ModuleType) -> None:
    tok = tdm.train_tokenizer([SOURCE] * 5, 300)
    render = tdm.chat_renderer(tok)
    pair = tasks.instruction_pairs([("m.py", SOURCE)], 10_000)[0]
    full, labels = tasks.chat_example(render, pair)
    text = tok.decode(full, skip_special_tokens=False)
    assert text.startswith("<|bos|><|user|>\n" + pair.user + "<|end|>\n<|assistant|>\n")
    assert len(full) == len(labels)
    first = next(i for i, t in enumerate(labels) if t != tasks.IGNORE_INDEX)
    assert all(t != tasks.IGNORE_INDEX for t in labels[first:])
    assert tok.decode(labels[first:], skip_special_tokens=False) == pair.assistant + "<|end|>\n"
    assert labels[first:] == full[first:]
    draw = tasks.sft_batches([(full, labels)], 2, 2, seed=0)
    ids, shifted = draw()
    assert ids.shape == shifted.shape == (2, len(full) - 1)
    assert ids[0].tolist() == full[:-1] and shifted[0].tolist() == labels[1:]
    # a second turn: the earlier request and answer are context, only the last answer a label
    earlier = tasks.instruction_pairs([("m.py", SOURCE)], 10_000)[1]
    full, labels = tasks.chat_example(render, pair, earlier)
    text = tok.decode(full, skip_special_tokens=False)
    assert text.startswith(f"<|bos|><|user|>\n{earlier.user}<|end|>\n<|assistant|>\n"
                           f"{earlier.assistant}<|end|>\n<|user|>\n{pair.user}<|end|>\n")
    first = next(i for i, t in enumerate(labels) if t != tasks.IGNORE_INDEX)
    assert tok.decode(labels[first:], skip_special_tokens=False) == pair.assistant + "<|end|>\n"
    assert all(t != tasks.IGNORE_INDEX for t in labels[first:])


def test_second_turns_pair_each_request_with_a_short_other_one(tasks: ModuleType) -> None:
    """Each pair after the next one (cyclically) whose function fits max_chars; never itself."""
    def pair(name: str, size: int) -> object:
        return tasks.Instruction("m.py", name, f"do {name}", "x" * size, False)

    pairs = [pair("a", 10), pair("b", 5000), pair("c", 10), pair("d", 10)]
    turns = [(p.name, e.name) for p, e in tasks.second_turns(pairs, max_chars=100)]
    assert turns == [("a", "c"), ("b", "c"), ("c", "d"), ("d", "a")]
    assert tasks.second_turns(pairs[:1]) == [] and tasks.second_turns(pairs[1:3], 100) == [
        (pairs[1], pairs[2])]
    messages = tasks.conversation(pairs[0], pairs[2])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == pairs[2].assistant and messages[2]["content"] == "do a"


def test_scores(sft: ModuleType) -> None:
    assert sft.completion_stops_and_parses("def f(x):", "    return x\n", True)
    assert not sft.completion_stops_and_parses("def f(x):", "    return x\n", False)
    assert not sft.completion_stops_and_parses("def f(x):", "    return (x\n", True)
    assert not sft.completion_stops_and_parses("def f(x):", "  \n", True)
    assert sft.reply_has_function("def f(x):\n    return x\n")
    assert sft.reply_has_function("Here:\n```python\ndef f(x):\n    return x\n```\nDone.")
    assert sft.reply_has_function('"""\n\ndef f(x):\n    return x\n')  # from the first def on
    assert not sft.reply_has_function('"""\n\nclass A:\n    pass\n')
    assert not sft.reply_has_function("def f(x):\n    return (x\n")
    assert sft.reply_functions("x = 1\n\ndef f(x):\n    pass\n\nasync def g():\n    pass\n") \
        == ["f", "g"]
    assert sft.answers_second_turn("def g(x):\n    return x\n", "f")
    assert not sft.answers_second_turn("def f(x):\n    return x\n", "f")  # the earlier one
    assert not sft.answers_second_turn("    pass\n", "f")


def test_repetition_penalty_rule(sft: ModuleType) -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = sft.apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    assert sft.apply_repetition_penalty(logits, seen, 1.0) is logits


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_generate_until_equals_unbatched_greedy(sft: ModuleType) -> None:
    model = tiny_llama()
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]
    got = sft.generate_until(model, prompts, 6, stop_ids={39}, pad_id=0, batch_size=2)
    for prompt, (ids, stopped) in zip(prompts, got, strict=True):
        seq, ref = torch.tensor([prompt]), []
        for _ in range(6):
            nxt = int(model(input_ids=seq).logits[0, -1].argmax())
            ref.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        cut = ref.index(39) if 39 in ref else len(ref)
        assert (ids, stopped) == (ref[:cut], 39 in ref)
    # Whatever comes first becomes a stop id: every prompt then stops at once.
    firsts = {ids[0] for ids, _ in sft.generate_until(model, prompts, 1, stop_ids={39})}
    stopped = sft.generate_until(model, prompts, 6, stop_ids=firsts)
    assert all(ids == [] and st for ids, st in stopped)


def test_choose_penalty_prefers_the_score_then_the_smaller(sft: ModuleType) -> None:
    def run(p: float, a: float) -> dict[str, float]:
        return {"repetition_penalty": p, "stop_and_parse_share": a, "chat_function_share": a,
                "chat_stop_share": a}

    assert sft.choose_penalty([run(1.0, 0.2), run(1.1, 0.5), run(1.3, 0.4)])["chosen"] == 1.1
    assert sft.choose_penalty([run(1.3, 0.5), run(1.0, 0.5)])["chosen"] == 1.0
    assert np.isclose(sft.choose_penalty([run(1.0, 0.3)])["scores"]["1.0"], 0.3)


def test_sft_stage_keeps_the_lowest_loss_checkpoint(sft: ModuleType, tasks: ModuleType) -> None:
    """The stage returns the weights of the evaluation with the lowest chat loss,
    not the last ones (a learning rate this high makes the loss rise)."""
    model = tiny_llama().train()
    rng = np.random.default_rng(0)
    examples = [(list(map(int, rng.integers(1, 40, 12))), [-100] * 4 + list(range(1, 9)))
                for _ in range(4)]
    settings = {"lr": 1.0, "max_steps": 3, "budget_s": 60.0, "warmup_steps": 1,
                "lm_weight": 0.0, "eval_every": 1, "pad_id": 0, "batch_size": 2}
    result = sft.sft_stage(model, tasks.sft_batches(examples, 2, 0, 0), None,
                           lambda *_: torch.zeros(()), examples, settings, lambda _: None,
                           contextlib.nullcontext)
    losses = [h["chat_val_loss"] for h in result["history"]]
    assert len(losses) == 4 and losses[-1] > min(losses)  # the last weights are not the best
    assert result["best_chat_val_loss"] == min(losses)
    assert result["best_step"] == result["history"][losses.index(min(losses))]["step"]
    with torch.no_grad():
        kept = sft.sft_val_loss(model, examples, 0, 2)
    assert np.isclose(kept, min(losses), rtol=1e-5)
