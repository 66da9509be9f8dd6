"""Incremental detokenization: the text each new token adds, for streaming.

Decoding token by token breaks multi-byte characters and merges that depend on the token before, so
each step decodes the tokens since the previous read point together with the ones before it, and
emits only the text the new tokens added. A window that ends inside a multi-byte character (it decodes to U+FFFD)
waits for the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

_WINDOW = 6  # tokens of left context re-decoded with the new ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self._token_ids.extend(int(t) for t in token_ids)
        decode = self._tokenizer.decode
        prefix = decode(self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        # Forget tokens left of the window so a step costs the same at token 10 and at token 10,000.
        if self._prefix_offset > 4 * _WINDOW:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever `add` held back (a trailing incomplete character, as U+FFFD): call it once,
        when the request ends, so the text equals decoding all the output tokens."""
        decode = self._tokenizer.decode
        prefix = decode(self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self.text += delta
        return delta
