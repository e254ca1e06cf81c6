"""Structured output in the engine: the params' own validation, the
sampler's bitmask (exact), and generations that match their regex, choice,
grammar or JSON schema on a tiny model, equal with async scheduling on and
off, under preemption, and with n > 1; compiled grammars are cached."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.structured_output import StructuredOutputParams
from kvserve.sampling.sampler import apply_token_bitmask

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                           "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"), ({"json": "[1]"}, "must be an object"),
    ({"choice": []}, "non-empty list"), ({"choice": ["a", ""]}, "non-empty strings"),
])
def test_params_validation(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        StructuredOutputParams(**kwargs)  # type: ignore[arg-type]


def test_keys_identify_the_grammar() -> None:
    one = StructuredOutputParams(json={"b": 1, "a": 2})
    assert one.key == StructuredOutputParams(json='{"a": 2, "b": 1}').key
    assert one.key != StructuredOutputParams(regex="a").key


def test_bitmask_masks_exactly_the_cleared_bits() -> None:
    vocab = 40
    logits = torch.zeros(2, vocab)
    words = torch.zeros(2, 2, dtype=torch.int32)
    words[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (the sign bit)
    words[1, 1] = 1 << 2  # token 34
    masked = apply_token_bitmask(logits, words)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [3, 31]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [34]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", with_tokenizer=True)


def _texts(llm: LLM, params: SamplingParams, prompts: list[str]) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_outputs_match_their_constraint(checkpoint: Path) -> None:
    llm = LLM(model=str(checkpoint), block_size=4)
    prompts = ["the quick", "hello world", "a paged kv cache"]
    cases = [
        (StructuredOutputParams(regex=r"[a-c]{2}[0-9]"), lambda t: re.fullmatch(r"[a-c]{2}\d", t)),
        (StructuredOutputParams(choice=["fox", "dog"]), lambda t: t in ("fox", "dog")),
        (StructuredOutputParams(grammar='root ::= "(" [0-9]+ ")"'),
         lambda t: re.fullmatch(r"\(\d+\)", t)),
        (StructuredOutputParams(json=SCHEMA),
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ]
    for spec, check in cases:
        params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=40,
                                structured_output=spec)
        for texts in _texts(llm, params, prompts):
            assert all(check(t) for t in texts), (spec.kind, texts)
    compiler = llm.engine.processor.grammar_compiler
    compiled = compiler.num_compiled
    _texts(llm, SamplingParams(max_tokens=40, structured_output=StructuredOutputParams(
        json=dict(reversed(list(SCHEMA.items()))))), prompts)
    assert compiler.num_compiled == compiled  # the same schema: cached


def test_async_scheduling_and_preemption_keep_the_grammar(checkpoint: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=False,
                            structured_output=StructuredOutputParams(json=SCHEMA))
    prompts = ["the quick", "hello world", "a paged kv cache", "brown fox"] * 3
    sync = _texts(LLM(model=str(checkpoint), block_size=4, async_scheduling=False), params,
                  prompts)
    both = LLM(model=str(checkpoint), block_size=4, async_scheduling=True)
    assert _texts(both, params, prompts) == sync
    tight = LLM(model=str(checkpoint), block_size=4, num_kv_blocks=24)
    assert _texts(tight, params, prompts) == sync
    assert tight.stats()["num_preemptions"] > 0
    for texts in sync:
        jsonschema.validate(json.loads(texts[0]), SCHEMA)


def test_uncompilable_grammar_is_a_value_error(checkpoint: Path) -> None:
    llm = LLM(model=str(checkpoint))
    for spec in (StructuredOutputParams(regex="(unclosed"),
                 StructuredOutputParams(grammar="root ::= missing"),
                 StructuredOutputParams(json={"type": "nonsense"})):
        with pytest.raises(ValueError, match=spec.kind):
            llm.generate(["x"], SamplingParams(structured_output=spec), use_tqdm=False)


def test_every_schema_gives_valid_json_on_a_random_model(checkpoint: Path) -> None:
    """A random tiny model samples freely within the grammar: with xgrammar
    0.2.8 a ``maxLength`` string let raw control characters through
    (invalid JSON); every output must now parse and validate."""
    from tests.e2e.structured_schemas import SCHEMAS

    llm = LLM(model=str(checkpoint), block_size=4, num_kv_blocks=256)
    params = [SamplingParams(temperature=1.0, seed=index, max_tokens=100, n=2,
                             structured_output=StructuredOutputParams(json=schema))
              for index, schema in enumerate(SCHEMAS)]
    outputs = llm.generate(["Reply with JSON."] * len(SCHEMAS), params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        for sample in output.outputs:
            if sample.finish_reason == "length":
                continue  # cut short: not a whole document
            jsonschema.validate(json.loads(sample.text), schema)
    finished = sum(s.finish_reason == "stop" for o in outputs for s in o.outputs)
    assert finished >= len(SCHEMAS)  # most samples end within max_tokens


def test_a_length_bounded_string_admits_json_characters_only(checkpoint: Path) -> None:
    """The grammar itself: a ``maxLength`` string refuses raw control
    characters (xgrammar 0.2.8 admits them) and takes escapes, each one
    character of the bound."""
    import xgrammar

    llm = LLM(model=str(checkpoint), block_size=4, num_kv_blocks=32)
    compiler = llm.engine.processor.grammar_compiler
    grammar = compiler.compile(StructuredOutputParams(json={
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 2}},
        "required": ["s"], "additionalProperties": False}))

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(grammar)
        return bool(matcher.accept_string(text)) and matcher.is_completed()

    assert accepts('{"s": "ab"}') and accepts('{"s": ""}')
    assert accepts('{"s": "a\\t"}') and accepts('{"s": "\\u0041\\""}')
    for control in ("\t", "\x00", "\x1f", "\n"):
        assert not accepts('{"s": "a' + control + '"}'), repr(control)
    assert not accepts('{"s": "abc"}') and not accepts('{"s": "\\t\\t\\t"}')
