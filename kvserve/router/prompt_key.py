"""The prompt of an OpenAI request body as the ``PrefixKey`` routing uses.

With a tokenizer (``--tokenizer``, the backends' own) a completion prompt is
encoded as the engine encodes it and a chat is rendered through the chat
template first, so block boundaries match the engine's prefix cache. Without
one, the prompt's UTF-8 bytes stand in for token ids (a chat as its
messages, role and text, in order): a shared text prefix is still a shared
key prefix, only the block boundaries differ from the engine's. Token-id
prompts are used as they are. Only the first prompt of a batch is keyed.
This module reads request bodies; it never validates them (the backend does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvserve.engine.tokenizer import Tokenizer
from kvserve.router.policy import DEFAULT_MAX_PREFIX_BLOCKS, PrefixKey, prefix_key

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


def _first_prompt(prompt: Any) -> str | list[int] | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return _first_prompt(prompt[0])
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, Mapping) else str(part)
                       for part in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _plain_chat_text(messages: Sequence[Any]) -> str:
    return "".join(f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e"
                   for m in messages if isinstance(m, Mapping))


class PromptKeyer:
    """Turns request bodies into ``PrefixKey`` values."""

    def __init__(self, tokenizer: Tokenizer | None, block_size: int,
                 max_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS) -> None:
        if block_size < 1:
            raise ValueError(f"--block-size={block_size} is invalid: must be >= 1")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    def key(self, path: str, body: Mapping[str, Any]) -> PrefixKey:
        """The key of a request to ``path``; an empty key when the body has no
        prompt this can read."""
        try:
            token_ids = self._token_ids(path, body)
        except Exception as exc:  # a body the backend will reject, or a template error
            logger.debug("no routing key for this request: %s", exc)
            return PrefixKey()
        if token_ids is None:
            return PrefixKey()
        return prefix_key(token_ids, self.block_size, self.max_blocks)

    def _token_ids(self, path: str, body: Mapping[str, Any]) -> Sequence[int] | None:
        max_chars = self.block_size * self.max_blocks * 8  # never tokenize more than is hashed
        if path == CHAT_PATH:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            if self.tokenizer is not None and self.tokenizer.has_chat_template:
                text = self.tokenizer.render_chat_template(messages)
                return self.tokenizer.encode(text[:max_chars], add_special_tokens=False)
            return _plain_chat_text(messages)[:max_chars].encode()
        prompt = _first_prompt(body.get("prompt"))
        if prompt is None or isinstance(prompt, list):
            return prompt
        if self.tokenizer is not None:
            return self.tokenizer.encode(prompt[:max_chars])
        return prompt[:max_chars].encode()
