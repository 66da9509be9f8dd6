"""The state of one generation request as the scheduler and the engine see it.

Token accounting, not phases: `all_token_ids` are the committed tokens (prompt, then accepted output),
`spec_token_ids` the draft's candidates waiting for verification, and `num_computed_tokens` how many
leading tokens have their KV in the target cache. Each step the scheduler gives a request rows from
`num_computed_tokens` towards `num_tokens_with_spec`: a prompt chunk, a whole prompt, or
[seed; candidates] (the seed is the last committed token, whose KV is not yet computed).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from dflash.core.block_pool import BlockHash
from dflash.core.config import SamplingParams


class RequestStatus(IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # its KV was freed; it waits at the front of the queue to be recomputed
    FINISHED_STOPPED = 3  # a stop token or stop string
    FINISHED_LENGTH = 4  # max_new_tokens reached
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # could not run (too long for the cache, ...): see Request.error

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_DEFAULT_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def default_finish_reason(status: RequestStatus) -> str:
    """The short reason recorded when a request finishes with `status` and no reason is given."""
    return _DEFAULT_FINISH_REASONS[status]


@dataclass(slots=True, eq=False)
class Request:
    """One request. Compared by identity: two requests with equal tokens are still two requests.

    block_hashes caches the prefix-cache hashes of the full committed blocks, keyed by block size,
    because the target and the draft cache may use different block sizes; the KV manager extends
    the list as tokens are committed, so tokens are hashed once.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: Sequence[int] = ()  # set by the engine each step, read by the scheduler
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    num_prefix_cached_tokens: int = 0  # prefix-cache hit at the latest admission
    block_hashes: dict[int, list[BlockHash]] = field(default_factory=dict, repr=False)
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.output_token_ids = [int(t) for t in self.output_token_ids]
        # Kept alongside the two parts so the runner can slice rows without concatenating each step.
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then committed output tokens (no candidates). Read-only by convention."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The longest this request can grow: prompt plus max_new_tokens."""
        return self.num_prompt_tokens + self.sampling_params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """Commit accepted tokens (the caller has verified them)."""
        token_ids = [int(t) for t in token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def token_ids_with_spec(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) of committed tokens followed by the candidates."""
        num_tokens = len(self._all_token_ids)
        if stop <= num_tokens:
            return self._all_token_ids[start:stop]
        spec = self.spec_token_ids[max(0, start - num_tokens) : stop - num_tokens]
        return self._all_token_ids[start:] + list(spec)
