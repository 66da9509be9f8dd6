"""Stop rules of one request: EOS and stop token ids, stop strings, max_new_tokens.

Stop tokens stay in the token ids (as transformers' `generate` keeps EOS); stop strings end the
request once the text contains them, and the returned text is cut before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import SamplingParams
from .request import RequestStatus


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int]):
        self._params = params
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= set(eos_token_ids)
        self._stop_strings = tuple(s for s in params.stop_strings if s)

    @property
    def needs_text(self) -> bool:
        """Whether `check` reads the text (stop strings); without them the token ids decide."""
        return bool(self._stop_strings)

    @property
    def num_held_back_chars(self) -> int:
        """Trailing characters of the text not yet safe to stream: they could be the start of a stop
        string that the next tokens complete (and that the final text will cut)."""
        return max((len(s) for s in self._stop_strings), default=1) - 1

    def check(self, output_token_ids: Sequence[int], text: str) -> tuple[RequestStatus, str] | None:
        """Whether the request is done after its newest tokens, and why."""
        if output_token_ids and output_token_ids[-1] in self._stop_ids:
            return RequestStatus.FINISHED_STOPPED, f"stop token {output_token_ids[-1]}"
        for stop in self._stop_strings:
            if stop in text:
                return RequestStatus.FINISHED_STOPPED, f"stop string {stop!r}"
        if len(output_token_ids) >= self._params.max_new_tokens:
            return RequestStatus.FINISHED_LENGTH, "length"
        return None

    def first_stop(self, token_ids: Sequence[int]) -> int | None:
        """Index of the first stop token in `token_ids` (for a block of accepted tokens), or None."""
        for index, token in enumerate(token_ids):
            if token in self._stop_ids:
                return index
        return None

    def trim_text(self, text: str) -> str:
        """The text up to (not including) the earliest stop string."""
        cut = min((text.find(s) for s in self._stop_strings if s in text), default=-1)
        return text if cut < 0 else text[:cut]
