"""Speculative-decoding counters: drafts, drafted and accepted tokens, acceptance by position.

Glossary (per verification step of one request):
  drafted   candidates the target verified this step (k)
  accepted  leading candidates equal to the target's own greedy tokens (0..k) that were committed
  bonus     the target's token after the accepted ones: every verification step commits accepted + 1.
            A stop token among the accepted candidates ends the step there and takes the bonus's
            place (what follows it is neither committed nor counted), so the counters always add
            up to the committed tokens.

Mean accepted length = (accepted + drafts) / drafts: tokens per verification step, bonus included.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verification steps that had at least one candidate
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        _grow(self.drafted_per_position, num_drafted)
        _grow(self.accepted_per_position, num_accepted)

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):  # fmt: skip
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count

    @property
    def mean_accepted_length(self) -> float | None:
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the steps that drafted position i, the share that accepted it."""
        accepted = self.accepted_per_position + [0] * (len(self.drafted_per_position) - len(self.accepted_per_position))
        return [a / d for a, d in zip(accepted, self.drafted_per_position)]

    def to_json(self) -> dict:
        return json_of(self, "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_accepted_length",
                        "acceptance_rate", "acceptance_by_position")  # fmt: skip


def _grow(counts: list[int], upto: int) -> None:
    """Count one more step at positions 0..upto-1."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


@dataclass
class StepTimes:
    """Where the engine's time goes, in seconds since it started.

    target_s / draft_s: the target's run (packing, inference, outputs) and the whole draft step;
    target_infer_s / draft_infer_s: inside the two models' infer() calls alone. host_s, the step time
    outside both infer() calls (scheduling, packing, verification, bookkeeping, text), is what the
    engine adds to the models' own time.
    """

    target_s: float = 0.0
    draft_s: float = 0.0
    step_s: float = 0.0
    num_steps: int = 0
    target_infer_s: float = 0.0
    draft_infer_s: float = 0.0

    @property
    def host_s(self) -> float:
        return self.step_s - self.target_infer_s - self.draft_infer_s

    @property
    def host_share(self) -> float | None:
        """Of the step time, the share outside the infer() calls."""
        return self.host_s / self.step_s if self.step_s > 0 else None

    def end_step(self, step_s: float, target_infer_s: float, draft_infer_s: float) -> None:
        """Book one engine step of `step_s` seconds; the infer() totals are the runners' own, since they started."""
        self.step_s += step_s
        self.num_steps += 1
        self.target_infer_s, self.draft_infer_s = target_infer_s, draft_infer_s

    def __sub__(self, before: StepTimes) -> StepTimes:
        """The times between two readings (`engine.times` copied before, and read after)."""
        return StepTimes(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    def __add__(self, other: StepTimes) -> StepTimes:
        return StepTimes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_json(self) -> dict:
        return {
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "host_s": self.host_s,
            "host_share": self.host_share,
            "host_ms_per_step": 1e3 * self.host_s / self.num_steps if self.num_steps else None,
        }


@dataclass
class DraftingStats:
    """How often the draft drafted: per (request, step) decision, and per engine step."""

    num_decisions: int = 0  # (request, step) pairs in which the request could have drafted
    num_drafting: int = 0  # of them, with at least one candidate
    num_draft_steps: int = 0  # steps that ran a draft inference
    num_idle_steps: int = 0  # steps with requests to draft for but no draft inference (none paid)
    num_kv_waits: int = 0  # (request, step) drafts put off because the draft's KV cache was full

    @property
    def drafting_share(self) -> float | None:
        return self.num_drafting / self.num_decisions if self.num_decisions else None

    def to_json(self) -> dict:
        return json_of(self, "num_decisions", "num_drafting", "drafting_share", "num_draft_steps", "num_idle_steps",
                        "num_kv_waits")  # fmt: skip


def json_of(obj: object, *names: str) -> dict:
    """The named attributes (fields or properties) of `obj`, in that order: a to_json of plain values."""
    return {name: getattr(obj, name) for name in names}
