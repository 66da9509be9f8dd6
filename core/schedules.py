"""How many candidates each request drafts per step: the num_assistant_tokens schedules.

Every schedule answers the same question with `plan(candidates, ...)` -> {req_id: k} (0: no
candidates this step) and learns from `observe_verification`. A request's `SamplingParams`
names its schedule; its cap is num_assistant_tokens within the draft's block.

- constant: always the cap.
- heuristic: transformers' assisted-generation rule: start at the cap, +2 after a step that accepted
  every candidate, -1 (not below 1) otherwise, within the draft's block.
- adaptive (the default): the candidates that pay for the whole cost of drafting, per request, zero
  included (core/adaptive.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from .adaptive import AdaptiveSchedule, Candidate


class ConstantSchedule:
    def plan(self, candidates: Sequence[Candidate], **_) -> dict[str, int]:
        return {c.req_id: c.cap for c in candidates}

    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


class HeuristicSchedule:
    def __init__(self, max_candidates: int):
        self.max_candidates = max_candidates
        self._current: dict[str, int] = {}

    def plan(self, candidates: Sequence[Candidate], **_) -> dict[str, int]:
        # num_assistant_tokens is where it starts; it then moves within the draft's block.
        return {c.req_id: self._current.setdefault(c.req_id, c.cap) for c in candidates}

    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        current = self._current.get(req_id, num_drafted)
        grown = current + 2 if num_accepted >= num_drafted else current - 1
        self._current[req_id] = max(1, min(grown, self.max_candidates))

    def forget(self, req_id: str) -> None:
        self._current.pop(req_id, None)


def make_schedules(max_candidates: int) -> dict[str, ConstantSchedule | HeuristicSchedule | AdaptiveSchedule]:
    """One instance of each schedule, by the name SamplingParams uses."""
    return {
        "constant": ConstantSchedule(),
        "heuristic": HeuristicSchedule(max_candidates),
        "adaptive": AdaptiveSchedule(),
    }
