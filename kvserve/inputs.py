"""The prompt forms ``LLM.generate`` takes besides text and token ids, as vLLM
spells them (``vllm.inputs``): ``{"prompt": text}`` and
``{"prompt_token_ids": ids}``. Plain dicts work the same; any other key is
refused with a ``ValueError`` naming it."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids, used as is."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt
