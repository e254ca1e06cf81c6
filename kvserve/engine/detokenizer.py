"""Token ids -> text, one token at a time, and stop-string detection.

One ``IncrementalDetokenizer`` per request (per completion when n > 1). Each
step the engine hands it the new token ids; it grows ``output_text`` and says
when a stop string appeared. Text is found by decoding a short window of
earlier tokens with and without the new ones and keeping the difference
(the prefix/read-offset technique of vLLM and TGI), so byte-level merges and
leading-space rules come out as in a full decode; a tail that decodes to
U+FFFD (a UTF-8 character split over tokens) is held back until the tokens
that complete it arrive. Streaming (``get_delta``) also holds back any tail
that could be the start of a stop string, so a stop string is never shown
partially. This module owns no model and no scheduler state.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.tokenizer import Tokenizer

# prompt tokens decoded along with the first outputs, so the tokenizer sees
# the context a leading space or a merged byte depends on
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after index ``start``.

    ``start`` is the first character not searched before: a match must
    contain at least one character from ``start`` on, so each stop is
    searched from ``start - len(stop) + 1``. Returns ``(index, stop)``, the
    first listed stop winning a tie, or None.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop."""
    longest = max((len(stop) for stop in stops), default=0)
    for length in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-length:]
        if any(len(stop) > length and stop.startswith(tail) for stop in stops):
            return length
    return 0


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens as they arrive.

    ``output_text`` is the text so far (cut at a stop string once one is
    found); ``stop_string`` is the stop string that ended it, if any.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stops = list(params.stop_strings)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_string: str | None = None
        self.finished = False
        # the decode window's source: the prompt's tail, then every output token
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # tokens [prefix_offset, read_offset) are already text; they are
        # decoded again only as context for the tokens after them
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._num_sent_chars = 0

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append this step's tokens; return the stop string if one now occurs.

        ``stop_terminated``: the last token is the EOS or a stop token that
        ends the request; its text is left out unless
        ``include_stop_str_in_output``. Stop strings are looked for only once
        the request has more than ``min_tokens`` output tokens. After a stop
        string is found, ``output_text`` ends right before it (or right after
        it with ``include_stop_str_in_output``), ``output_token_ids`` end with
        the token that completed it (a step of several tokens, speculative
        decoding's, may run past it) and later calls do nothing.
        """
        if self.finished:
            return None
        num_before = len(self.output_token_ids)
        self.output_token_ids.extend(new_token_ids)
        token_ids = list(new_token_ids)
        if stop_terminated and token_ids and not self.params.include_stop_str_in_output:
            token_ids.pop()
        if not self.stops:
            # nothing to look for between tokens: decode them in one pass
            self._token_ids.extend(token_ids)
            self.output_text += self._decode_new_text(force=False)
            return None
        for i, token_id in enumerate(token_ids):
            self._token_ids.append(token_id)
            num_old_chars = len(self.output_text)
            self.output_text += self._decode_new_text(force=False)
            num_outputs = num_before + i + 1
            if (
                self.stops
                and num_outputs > self.params.min_tokens
                and len(self.output_text) > num_old_chars
                and self._check_stop(num_old_chars)
            ):
                del self.output_token_ids[num_outputs:]
                return self.stop_string
        return None

    def get_delta(self) -> str:
        """The text not returned before, for streaming.

        Until the request finishes, a tail that could be the start of a stop
        string is held back.
        """
        end = len(self.output_text)
        if self.stops and not self.finished:
            end -= partial_stop_length(self.output_text, self.stops)
        if end <= self._num_sent_chars:
            return ""
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    def flush(self) -> str:
        """Finish: decode any held-back tail (an incomplete UTF-8 character
        shows as U+FFFD, as in a full decode) and return all unsent text."""
        if not self.finished:
            if self.stop_string is None:
                self.output_text += self._decode_new_text(force=True)
            self.finished = True
        return self.get_delta()

    def _decode_new_text(self, force: bool) -> str:
        """Text of the tokens from read_offset on; "" while it is incomplete."""
        if self._read_offset == len(self._token_ids):
            return ""  # no new tokens (flush after the last one was decoded)
        skip = self.params.skip_special_tokens
        window = self._token_ids[self._prefix_offset :]
        num_prefix = self._read_offset - self._prefix_offset
        prefix_text = self.tokenizer.decode(window[:num_prefix], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(window, skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not force:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _check_stop(self, num_old_chars: int) -> bool:
        """Look for a stop string ending in the new text; cut the text at it."""
        found = find_stop_string(self.output_text, self.stops, num_old_chars)
        if found is None:
            return False
        idx, stop = found
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.output_text = self.output_text[:end]
        self.stop_string = stop
        self.finished = True
        return True
