"""The seam between the engine and a draft: what a drafter gets from a target step, what it returns.

The engine calls a drafter at three points and nothing else:

    limit = drafter.prefix_hit_limit(request)   admission: how much of a cached prompt prefix is usable
    candidates = drafter.step(target_step)      after verification: read the committed rows, draft
    drafter.forget(request)                     a request finished or was preempted

`NoDrafter` is the target alone: no candidates, no cap, nothing to forget. `DFlashDrafter`
(core/speculative.py) is the DFlash/DSpark draft on PagedAttention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .metrics import DraftingStats
from .request import Request
from .scheduler import ScheduledRequest
from .verification import Verdict


@dataclass(frozen=True)
class TargetStep:
    """One target step as the draft sees it.

    scheduled: what ran, in row order, each with its request (None if it ended meanwhile: aborted).
    hidden_states: the target's hidden rows of every scheduled row, in the same order (None without a draft).
    verdicts: per request that reached the end of its tokens, what was committed and accepted.
    num_rows, seconds: the target's rows and the wall time of the step so far (host work included).
    num_waiting: requests the scheduler holds back for a place in the batch (0: the batch is closed,
        its running requests are all there is to finish).
    num_batch: requests that share the batch's steps now or within a few steps: the running ones and
        the waiting ones there is room for (held back only by the step's token budget while earlier
        prompts are read).
    """

    scheduled: Sequence[tuple[ScheduledRequest, Request | None]]
    hidden_states: np.ndarray | None
    verdicts: Mapping[str, Verdict]
    num_rows: int
    seconds: float
    num_waiting: int = 0
    num_batch: int = 0

    @property
    def is_generation(self) -> bool:
        """No prompt chunk in the step: its rows are seeds and candidates only."""
        return not any(s.is_prefill_chunk for s, _ in self.scheduled)


class Proposal(tuple):
    """A request's candidates (a tuple of token ids) drawn from the draft's distributions under
    sampling: `probs` [len, V] holds, per candidate, the distribution it was drawn from (after the
    request's temperature, top-k and top-p), which speculative sampling needs. Plain tuples are the
    draft's deterministic proposals (its argmax or Markov walk), verified greedily or, under sampling,
    as point masses. A slice is a plain tuple of tokens."""

    probs: np.ndarray

    def __new__(cls, tokens, probs: np.ndarray) -> Proposal:
        proposal = super().__new__(cls, (int(t) for t in tokens))
        if probs.shape[0] != len(proposal):
            raise ValueError(f"{len(proposal)} candidates but {probs.shape[0]} draft distributions")
        proposal.probs = probs
        return proposal


def draft_probs(candidates: Sequence[int], num: int) -> np.ndarray | None:
    """The distributions the first `num` sampled candidates were drawn from; None for deterministic ones."""
    return candidates.probs[:num] if isinstance(candidates, Proposal) else None


Candidates = dict[str, tuple[int, ...]]  # per request, the tokens the target verifies next step (or a Proposal)


class NoDrafter:
    """The target alone."""

    warnings: list[str] = []
    stats = DraftingStats()  # stays empty
    seconds = 0.0
    infer_seconds = 0.0

    def prefix_hit_limit(self, request: Request) -> int | None:
        return None

    def step(self, target_step: TargetStep) -> Candidates:
        return {}

    def forget(self, request: Request) -> None:
        pass

    def reset_prefix_cache(self) -> bool:
        return True
