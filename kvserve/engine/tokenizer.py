"""Text <-> token ids for the engine: one interface, two implementations.

``HfTokenizer`` wraps a Hugging Face fast tokenizer read from a local
directory (``tokenizer.json`` / ``tokenizer_config.json``, chat template
included); ``load_tokenizer`` builds it. Only the tokenizer is loaded, never
model code, and nothing is fetched from the hub. ``ByteTokenizer`` is the
fallback for built-in presets run with random weights: UTF-8 bytes as ids.
Everything else in kvserve types against ``Tokenizer``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

# files any one of which makes a directory a tokenizer directory
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

Message = Mapping[str, Any]


class Tokenizer(ABC):
    """What the engine needs from a tokenizer."""

    eos_token_id: int | None
    bos_token_id: int | None
    # number of ids the tokenizer can produce (added tokens included)
    vocab_size: int
    all_special_ids: list[int]

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer's
        own prefix (usually BOS) is added."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; incomplete UTF-8 shows as U+FFFD."""

    @abstractmethod
    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary entries (token strings) of ``token_ids``."""

    @property
    @abstractmethod
    def has_chat_template(self) -> bool:
        """True when ``apply_chat_template`` can be used."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """The tokenizer's configuration as JSON values (``/tokenizer_info``,
        vLLM's shape: ``tokenizer_class``, the special tokens, the chat
        template, ...), enough for a client to tokenize the same way."""

    @abstractmethod
    def render_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat; ValueError when there is no template."""

    def set_chat_template(self, template: str) -> None:
        """Use the Jinja ``template`` instead of the tokenizer's own (``--chat-template``)."""
        raise ValueError(
            "chat_template: this model has no tokenizer files, so its chat format is fixed; "
            "pass a model (or --tokenizer) with a Hugging Face tokenizer"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids of a chat (``[{"role": ..., "content": ...}]``).

        The rendered text is encoded without adding special tokens: the
        template writes BOS itself where the model wants one.
        """
        text = self.render_chat_template(messages, add_generation_prompt, chat_template_kwargs)
        return self.encode(text, add_special_tokens=False)



class HfTokenizer(Tokenizer):
    """A Hugging Face tokenizer behind the ``Tokenizer`` interface."""

    def __init__(self, hf_tokenizer: Any, name: str = "tokenizer") -> None:
        self.hf_tokenizer = hf_tokenizer
        self.name = name
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)
        self.all_special_ids = list(hf_tokenizer.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # verbose=False: no warning about the tokenizer's model_max_length; the
        # engine checks lengths against max_model_len itself, naming the field
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                             verbose=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # no clean-up of spaces: it rewrites earlier text (" ." -> "."), which
        # would break incremental detokenization
        text = self.hf_tokenizer.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)
        return text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(token_ids)))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    def set_chat_template(self, template: str) -> None:
        self.hf_tokenizer.chat_template = template

    def info(self) -> dict[str, Any]:
        tok = self.hf_tokenizer
        config = {key: _json_value(value) for key, value in tok.init_kwargs.items()
                  if key not in ("name_or_path", "tokenizer_file", "vocab_file", "merges_file")}
        return {**config, "tokenizer_class": type(tok).__name__,
                "chat_template": getattr(tok, "chat_template", None),
                "vocab_size": self.vocab_size, "eos_token": tok.eos_token,
                "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "unk_token": tok.unk_token}

    def render_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if not self.has_chat_template:
            raise ValueError(
                f"{self.name} has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja); use a plain "
                "completion prompt or a model with a chat template"
            )
        text = self.hf_tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(chat_template_kwargs or {}),
        )
        assert isinstance(text, str)
        return text


def _json_value(value: Any) -> Any:
    """A tokenizer config value as JSON (an ``AddedToken`` as its text)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(getattr(value, "content", value))


def has_tokenizer(path: Path) -> bool:
    """Whether a model directory carries its own tokenizer files."""
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: Path | str) -> HfTokenizer:
    """Load the tokenizer of a local Hugging Face model directory.

    Raises ValueError naming the directory when it holds no tokenizer or the
    tokenizer cannot be read.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {path} does not exist or is not a directory")
    if not has_tokenizer(path):
        raise ValueError(f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)}")
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise ValueError(f"could not load the tokenizer in {path}: {exc}") from exc
    return HfTokenizer(hf_tokenizer, name=f"the tokenizer in {path}")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids, for presets run without tokenizer files.

    Ids: 0 pad, 1 bos, 2 eos, 3..258 the bytes 0..255. Ids from 259 up (a
    random model samples them) decode to ``"<|id|>"`` so they stay visible.
    The chat template is ``"role: content\\n"`` per message, then
    ``"assistant: "``.
    """

    PAD_ID = 0
    BOS_ID = 1
    EOS_ID = 2
    BYTE_OFFSET = 3
    NUM_IDS = 259
    _SPECIAL_NAMES: ClassVar[dict[int, str]] = {
        PAD_ID: "<|pad|>",
        BOS_ID: "<|bos|>",
        EOS_ID: "<|eos|>",
    }

    def __init__(self, vocab_size: int | None = None) -> None:
        """``vocab_size``: the model's, when larger than the 259 ids used here."""
        self.eos_token_id = self.EOS_ID
        self.bos_token_id = self.BOS_ID
        self.vocab_size = max(self.NUM_IDS, vocab_size or 0)
        self.all_special_ids = [self.PAD_ID, self.BOS_ID, self.EOS_ID]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.BYTE_OFFSET for b in text.encode("utf-8")]
        return [self.BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token_id in token_ids:
            if self.BYTE_OFFSET <= token_id < self.NUM_IDS:
                pending.append(token_id - self.BYTE_OFFSET)
                continue
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if token_id in self._SPECIAL_NAMES:
                if not skip_special_tokens:
                    parts.append(self._SPECIAL_NAMES[token_id])
            else:
                parts.append(f"<|{token_id}|>")
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        tokens = []
        for token_id in token_ids:
            if token_id in self._SPECIAL_NAMES:
                tokens.append(self._SPECIAL_NAMES[token_id])
            elif self.BYTE_OFFSET <= token_id < self.NUM_IDS:
                byte = token_id - self.BYTE_OFFSET
                tokens.append(chr(byte) if 0x20 <= byte < 0x7F else f"<0x{byte:02X}>")
            else:
                tokens.append(f"<|{token_id}|>")
        return tokens

    @property
    def has_chat_template(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        names = self._SPECIAL_NAMES
        return {"tokenizer_class": type(self).__name__, "vocab_size": self.vocab_size,
                "bos_token": names[self.BOS_ID], "eos_token": names[self.EOS_ID],
                "pad_token": names[self.PAD_ID], "unk_token": None, "chat_template": None}

    def render_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant: " if add_generation_prompt else text

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """BOS, then the bytes of the rendered chat."""
        text = self.render_chat_template(messages, add_generation_prompt, chat_template_kwargs)
        return self.encode(text, add_special_tokens=True)
