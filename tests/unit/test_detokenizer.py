"""Incremental detokenizer, stop strings, and the tokenizers behind them.

A small byte-level BPE tokenizer is trained at test time with ``tokenizers``
so multi-byte characters get split across tokens, as in real models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    partial_stop_length,
)
from kvserve.engine.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer, load_tokenizer

CORPUS = [
    "héllo wörld 日本語 😀",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! how are you today?",
    "日本語のテキスト 😀😀 emoji and ünïcödé",
]
TEXTS = [
    "héllo wörld 日本語 😀",
    "hello there, the lazy fox 😀 jumps 日本語のテキスト",
    "ünïcödé wörds and the brown dog",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REPLACEMENT = "\ufffd"


def _train_hf_tokenizer() -> PreTrainedTokenizerFast:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    return _train_hf_tokenizer()


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer: PreTrainedTokenizerFast) -> HfTokenizer:
    return HfTokenizer(hf_tokenizer)


def _stream(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    params: SamplingParams,
    prompt: Sequence[int] = (),
    chunk: int = 1,
) -> tuple[IncrementalDetokenizer, list[str], str | None, int]:
    """Feed ``token_ids`` ``chunk`` at a time, streaming as an engine would.

    Returns the detokenizer, the deltas, the stop string found (if any) and
    how many tokens had been fed when it was found.
    """
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas: list[str] = []
    for start in range(0, len(token_ids), chunk):
        stop = detok.update(token_ids[start : start + chunk])
        if stop is not None:
            deltas.append(detok.flush())
            return detok, deltas, stop, start + chunk
        deltas.append(detok.get_delta())
    deltas.append(detok.flush())
    return detok, deltas, None, len(token_ids)


def test_tokenizer_splits_characters(tokenizer: HfTokenizer) -> None:
    """The test tokenizer must split some character, or the tests below prove little."""
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids), text


@pytest.mark.parametrize("chunk", [1, 2, 3, 1000])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer: HfTokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("the prompt: 日本", add_special_tokens=True)
    detok, deltas, stop, _ = _stream(tokenizer, ids, SamplingParams(), prompt, chunk)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in delta for delta in deltas)


def test_skip_special_tokens(tokenizer: HfTokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None and eos in tokenizer.all_special_ids
    ids = [*tokenizer.encode("hello", add_special_tokens=False), eos]
    ids += tokenizer.encode(" world", add_special_tokens=False)
    skipped, _, _, _ = _stream(tokenizer, ids, SamplingParams())
    assert skipped.output_text == "hello world"
    shown, _, _, _ = _stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert shown.output_text == "hello</s> world"


def _straddling_stop(tokenizer: Tokenizer, ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character substring of ``text`` that spans a token boundary."""
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    for boundary in ends[2:-2]:
        candidate = text[boundary - 2 : boundary + 2]
        if REPLACEMENT not in candidate and text.find(candidate) == boundary - 2:
            return candidate, boundary - 2
    raise AssertionError("no straddling substring found")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_stop_string_across_tokens(tokenizer: HfTokenizer, text: str, include: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop, idx = _straddling_stop(tokenizer, ids, text)
    params = SamplingParams(stop=["never", stop], include_stop_str_in_output=include)
    detok, deltas, found, num_fed = _stream(tokenizer, ids, params)
    assert found == stop and detok.stop_string == stop
    expected = text[: idx + len(stop)] if include else text[:idx]
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # found at the first token whose text completes the stop string
    assert len(tokenizer.decode(ids[:num_fed])) >= idx + len(stop)
    assert len(tokenizer.decode(ids[: num_fed - 1])) < idx + len(stop)
    assert detok.update(ids[num_fed:]) is None and detok.output_text == expected


def test_multibyte_stop_string(tokenizer: HfTokenizer) -> None:
    text = TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, found, _ = _stream(tokenizer, ids, SamplingParams(stop="本語"))
    assert found == "本語"
    assert detok.output_text == "".join(deltas) == text[: text.index("本語")]


@pytest.mark.parametrize("text", TEXTS)
def test_delta_never_shows_a_partial_stop(tokenizer: HfTokenizer, text: str) -> None:
    """Streamed text is always a prefix of the final text, and the held-back
    tail is released when it turns out not to be a stop string."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop, idx = _straddling_stop(tokenizer, ids, text)
    # a stop that starts like the real one but never matches (held, then released)
    decoy = stop[:-1] + "\x00"
    for stops, expected in (([stop], text[:idx]), ([decoy], text)):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
        streamed = ""
        for token_id in ids:
            if detok.update([token_id]) is not None:
                break
            streamed += detok.get_delta()
            # nothing streamed is ever taken back by a later stop match
            assert expected.startswith(streamed)
        streamed += detok.flush()
        assert streamed == expected


def test_stop_terminated_token_text_left_out(tokenizer: HfTokenizer) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    stop_token = ids[-1]
    for include in (False, True):
        params = SamplingParams(stop_token_ids=[stop_token], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        detok.update(ids[:-1])
        detok.update(ids[-1:], stop_terminated=True)
        detok.flush()
        expected = tokenizer.decode(ids if include else ids[:-1])
        assert detok.output_text == expected
        assert detok.output_token_ids == ids


def test_stop_strings_wait_for_min_tokens(tokenizer: HfTokenizer) -> None:
    ids = tokenizer.encode("hello world, hello there", add_special_tokens=False)
    first_hello_tokens = len(tokenizer.encode("hello", add_special_tokens=False))
    params = SamplingParams(stop="hello", min_tokens=first_hello_tokens)
    detok, _, found, _ = _stream(tokenizer, ids, params)
    assert found == "hello" and detok.output_text == "hello world, "


def test_flush_keeps_an_incomplete_character(tokenizer: HfTokenizer) -> None:
    byte_tokenizer = ByteTokenizer()
    ids = byte_tokenizer.encode("ab日", add_special_tokens=False)[:-1]
    detok, deltas, _, _ = _stream(byte_tokenizer, ids, SamplingParams())
    assert detok.output_text == byte_tokenizer.decode(ids) == "ab" + REPLACEMENT
    assert deltas[-1] == REPLACEMENT


def test_find_stop_string() -> None:
    assert find_stop_string("abcdef", ["cd", "bc"], 0) == (1, "bc")
    assert find_stop_string("abcdef", ["cd", "xy"], 3) == (2, "cd")  # ends after 3
    assert find_stop_string("abcdef", ["cd"], 4) is None  # ends before 4
    assert find_stop_string("abab", ["ab", "b"], 0) == (0, "ab")
    assert find_stop_string("xab", ["ab", "a"], 0) == (1, "ab")  # first listed wins a tie
    assert find_stop_string("", ["a"], 0) is None


def test_partial_stop_length() -> None:
    assert partial_stop_length("hello wo", ["world"]) == 2
    assert partial_stop_length("hello w", ["world", "xyz"]) == 1
    assert partial_stop_length("hello", ["world"]) == 0
    assert partial_stop_length("hello world", ["world"]) == 0  # a full match is not partial
    assert partial_stop_length("abc", []) == 0


@pytest.mark.parametrize("text", [*TEXTS, "", "a\nb\tc", "\U0001f600\U0001f4a9"])
def test_byte_tokenizer_round_trips(text: str) -> None:
    tok = ByteTokenizer(vocab_size=32000)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
    assert tok.vocab_size == 32000
    detok, deltas, _, _ = _stream(tok, ids[1:], SamplingParams())
    assert "".join(deltas) == detok.output_text == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_byte_tokenizer_extras() -> None:
    tok = ByteTokenizer()
    assert tok.decode([3 + ord("a"), 300, tok.EOS_ID, 3 + ord("b")]) == "a<|300|>b"
    assert tok.convert_ids_to_tokens([0, 3 + ord("a"), 3 + 0xC3, 500]) == [
        "<|pad|>",
        "a",
        "<0xC3>",
        "<|500|>",
    ]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages)
    assert ids[0] == tok.BOS_ID
    assert tok.decode(ids) == "system: be brief\nuser: hi\nassistant: "
    assert tok.render_chat_template(messages, add_generation_prompt=False).endswith("hi\n")


def test_load_tokenizer_and_chat_template(
    hf_tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    plain_dir = tmp_path / "plain"
    hf_tokenizer.save_pretrained(str(plain_dir))
    plain = load_tokenizer(plain_dir)
    assert plain.encode("héllo", add_special_tokens=False) == hf_tokenizer.encode(
        "héllo", add_special_tokens=False
    )
    assert plain.eos_token_id == hf_tokenizer.eos_token_id and plain.vocab_size == 280
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])

    chat_dir = tmp_path / "chat"
    templated = _train_hf_tokenizer()
    templated.chat_template = CHAT_TEMPLATE
    templated.save_pretrained(str(chat_dir))
    chat = load_tokenizer(chat_dir)
    ids = chat.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids[0] == chat.bos_token_id
    assert chat.decode(ids, skip_special_tokens=False) == "<s><|user|>hello\n<|assistant|>"
    assert chat.convert_ids_to_tokens(ids[:1]) == ["<s>"]


def test_load_tokenizer_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing-dir"):
        load_tokenizer(tmp_path / "missing-dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no tokenizer in .*empty"):
        load_tokenizer(empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken"):
        load_tokenizer(broken)
