r"""Compiles ``StructuredOutputParams`` into xgrammar grammars, cached.

One ``GrammarCompiler`` per engine, built on first use from the engine's
tokenizer and the model's vocabulary size (the logits' width, which may be
larger than the tokenizer's). Compiling a JSON schema takes milliseconds to
a second, so it happens in the front end's ``InputProcessor`` (the server
runs it in a worker thread; a bad or unsatisfiable schema is then a 400
naming it), never in the core's step loop: a core in its own process gets
the compiled grammar as xgrammar's JSON (``serialize``) and rebuilds it in
well under a millisecond (``deserialize``). JSON is generated compact (no
free whitespace: a model cannot spend its tokens on spaces). xgrammar is imported only here and in
``worker/structured_output.py``.

xgrammar 0.2.8 turns a string with ``minLength`` / ``maxLength`` into
``"\"" chars{m, n} "\""`` with ``chars ::= [^\"\\\r\n]``: raw control
characters (tab, NUL, ...) pass, which JSON forbids, and escapes do not.
``_json_schema_grammar`` rewrites that class in the EBNF xgrammar made into
one JSON character (anything but a control character, ``"`` or ``\``, or
an escape), then compiles the EBNF (decision 0036).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from kvserve.core.structured_output import StructuredOutputParams
from kvserve.engine.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

# compiled grammars kept (least recently used dropped first)
MAX_CACHED_GRAMMARS = 256

# xgrammar's character rule of a length-bounded string, as it prints it, and
# the JSON string character it must be (xgrammar's own escape rule included)
_BOUNDED_STRING_CHAR = re.compile(r'^(\w+_characters ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$',
                                  re.MULTILINE)
_JSON_STRING_CHAR = r'\1(([^\\0-\\x1f\\"\\\\]) | ("\\\\" basic_escape))'


class GrammarError(ValueError):
    """A structured output xgrammar cannot compile (the server names the
    field that asked for it)."""


class StructuredOutputCompiler:
    """Compile and cache grammars for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar

        if isinstance(tokenizer, HfTokenizer):
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer.hf_tokenizer, vocab_size=vocab_size,
                stop_token_ids=list(stop_token_ids) or None)
        elif isinstance(tokenizer, ByteTokenizer):
            vocab = [b""] * vocab_size
            for byte in range(256):
                vocab[ByteTokenizer.BYTE_OFFSET + byte] = bytes([byte])
            info = xgrammar.TokenizerInfo(vocab, vocab_size=vocab_size,
                                          stop_token_ids=list(stop_token_ids))
        else:
            raise ValueError(f"structured output needs a Hugging Face or byte tokenizer, "
                             f"not {type(tokenizer).__name__}")
        self._info = info
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and stats

    def compile(self, params: StructuredOutputParams) -> Any:
        """The compiled grammar (cached); ValueError naming the field when
        xgrammar refuses it (malformed or unsupported schema, bad regex or EBNF)."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = self._compile(params)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"{params.kind}: could not compile it: {str(exc)[:300]}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    @staticmethod
    def serialize(grammar: Any) -> str:
        """A compiled grammar as text, to send to a core process (it does not pickle)."""
        return str(grammar.serialize_json())

    def deserialize(self, text: str) -> Any:
        """The compiled grammar ``serialize`` wrote (for this tokenizer and vocabulary)."""
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(text, self._info)

    def _json_schema_grammar(self, schema: str) -> Any:
        """The compiled grammar of a JSON schema, its length-bounded strings'
        characters restricted to what JSON allows (see the module docstring)."""
        import xgrammar

        ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
        fixed, count = _BOUNDED_STRING_CHAR.subn(_JSON_STRING_CHAR, ebnf)
        if not count:
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        return self._compiler.compile_grammar(fixed)

    def _compile(self, params: StructuredOutputParams) -> Any:
        compiler = self._compiler
        if params.json is not None:
            return self._json_schema_grammar(json.dumps(params.json))
        if params.json_object:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(choice) for choice in params.choice))
        assert params.grammar is not None
        return compiler.compile_grammar(params.grammar)
