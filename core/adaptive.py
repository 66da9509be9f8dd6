"""The "adaptive" num_assistant_tokens schedule: verify a candidate only where it pays for itself.

A candidate at block position i is accepted with probability q_i (the engine's measured acceptance by
position; accepting position i means every earlier one was accepted too), so it adds q_i expected
tokens to a step. It costs one more row in the target's verification and one more in the draft's
block: b seconds, the slope of inference time over rows, fitted on the recent steps of each model.
With R the recent committed tokens per second, adding the candidate raises R exactly when q_i > b * R.
So the block ends before the first position whose acceptance is at or below b * R: at least one
candidate (so acceptance keeps being measured), at most the request's num_assistant_tokens.

On two CPU cores a verified row costs little while one request runs (the step reads the weights
either way) and about as much as a token once eight share a step: the same draft then drafts ~5
candidates alone and 1 under load. Until `min_steps` steps with different row counts are seen, and
while nothing has been verified yet, the request's own num_assistant_tokens is used.
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
        self._target: deque[tuple[int, float]] = deque(maxlen=window)  # (rows, seconds) per inference
        self._draft: deque[tuple[int, float]] = deque(maxlen=window)
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)  # (committed tokens, seconds) per step
        self._threshold: float | None = None
        self._stale = True

    def observe_verification(self, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(num_drafted, num_accepted)
        self._stale = True

    def observe_target(self, num_rows: int, seconds: float) -> None:
        self._target.append((num_rows, seconds))
        self._stale = True

    def observe_draft(self, num_rows: int, seconds: float) -> None:
        self._draft.append((num_rows, seconds))
        self._stale = True

    def observe_step(self, num_committed: int, seconds: float) -> None:
        self._steps.append((num_committed, seconds))
        self._stale = True

    def row_seconds(self) -> float | None:
        """Seconds one more row adds to a step (target plus draft); None until it can be fitted."""
        target = _slope(self._target, self.min_steps)
        if target is None:
            return None
        return target + (_slope(self._draft, self.min_steps) or 0.0)

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
            return cap
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
