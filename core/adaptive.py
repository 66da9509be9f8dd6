"""The "adaptive" num_assistant_tokens schedule: verify a candidate only where it pays for itself.

A candidate at block position i is accepted with probability q_i (the engine's measured acceptance by
position; accepting position i means every earlier one was accepted too), so it adds q_i expected
tokens to a step. It costs one more row in the target's verification and one more in the draft's
block: b seconds, the slope of inference time over rows, fitted on the recent steps of each model.
With R the recent committed tokens per second, adding the candidate raises R exactly when q_i > b * R.
So the block ends before the first position whose acceptance is at or below b * R: at least one
candidate (so acceptance keeps being measured), at most the request's num_assistant_tokens. Only
generation steps are fitted: rows of a prompt chunk cost less each than a few verification rows.

What a row costs depends on the machine and on how full the steps already are, so it is measured,
not assumed: on two CPU cores the default pair ends up with a few candidates for one request and fewer
with eight (docs/benchmarks.md). Until `min_steps` generation steps with different row counts have
been fitted, the schedule explores: the request's whole block, half of it and one candidate in turn.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .metrics import SpecDecodingStats


class AdaptiveBlockSize:
    """Fits the cost of a row and measures acceptance; answers how many candidates to draft."""

    def __init__(self, window: int = 128, min_steps: int = 16):
        self.acceptance = SpecDecodingStats()  # every verification of every request
        self.min_steps = min_steps
        # Per generation step (no prompt chunk in it: prefill rows are cheaper per row than a few
        # verification rows, and the choice here is about the latter).
        self._target: deque[tuple[int, float]] = deque(maxlen=window)  # (rows, seconds)
        self._draft: deque[tuple[int, float]] = deque(maxlen=window)
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)  # (committed tokens, seconds)
        self._row_seconds: float | None = None  # the last fit, kept while the rows stop varying
        self._threshold: float | None = None
        self._stale = True
        self._num_steps = 0  # generation steps observed, for the exploration's turns

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(num_drafted, num_accepted)
        self._stale = True

    def observe_step(self, target: tuple[int, float], draft: tuple[int, float], num_committed: int, seconds: float) -> None:
        """One generation step: (rows, seconds) of each model's inference, tokens committed, step time."""
        self._target.append(target)
        self._draft.append(draft)
        self._steps.append((num_committed, seconds))
        self._num_steps += 1
        self._stale = True

    def row_seconds(self) -> float | None:
        """Seconds one more row adds to a step (target plus draft); None until it can be fitted."""
        target = _slope(self._target, self.min_steps)
        if target is not None:
            self._row_seconds = target + (_slope(self._draft, self.min_steps) or 0.0)
        return self._row_seconds

    def threshold(self) -> float | None:
        """The acceptance a candidate position needs to pay for its rows: b * R."""
        if self._stale:
            self._stale = False
            row_seconds = self.row_seconds()
            seconds = sum(s for _, s in self._steps)
            if row_seconds is None or seconds <= 0:
                self._threshold = None
            else:
                self._threshold = max(row_seconds, 0.0) * sum(t for t, _ in self._steps) / seconds
        return self._threshold

    def block_size(self, cap: int) -> int:
        """Candidates to draft, between 1 and `cap` (the request's num_assistant_tokens)."""
        threshold = self.threshold()
        acceptance = self.acceptance.acceptance_by_position
        if threshold is None or not acceptance:
            # Exploring: the whole block, half of it and one candidate in turn, step by step, so
            # that acceptance is measured at every position and steps come with different rows.
            return (cap, (cap + 1) // 2, 1)[self._num_steps % 3]
        size = 0
        for q in acceptance[:cap]:
            if q <= threshold:
                break
            size += 1
        # Positions never drafted yet (the cap grew) are tried once the measured ones all pay.
        if size == len(acceptance) < cap:
            size += 1
        return max(1, min(size, cap))


def _slope(samples: deque[tuple[int, float]], min_samples: int) -> float | None:
    """Least-squares slope of seconds over rows; None with too few samples or rows that never vary."""
    if len(samples) < min_samples:
        return None
    rows = np.fromiter((r for r, _ in samples), dtype=np.float64, count=len(samples))
    seconds = np.fromiter((s for _, s in samples), dtype=np.float64, count=len(samples))
    spread = rows - rows.mean()
    variance = float(spread @ spread)
    if variance == 0.0:
        return None
    return float(spread @ (seconds - seconds.mean())) / variance
