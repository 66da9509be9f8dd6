"""What a benchmark sweep reports: per-setting figures, agreement with the baseline, the JSON schema.

docs/bench-json.md documents every field of `BenchReport.to_json()`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 1


@dataclass
class Mismatch:
    """A speculative output that differs from the baseline's for the same prompt."""

    prompt_index: int
    prompt: str | None
    first_divergence: int  # index of the first differing generated token
    baseline_tokens: list[int]
    speculative_tokens: list[int]


@dataclass
class Agreement:
    compared: int = 0
    identical: int = 0
    median_first_divergence: float | None = None  # over the outputs that differ
    mismatches: list[Mismatch] = field(default_factory=list)


@dataclass
class SettingResult:
    """The figures of one run of every prompt at one setting."""

    name: str
    kind: str  # "baseline" or "speculative"
    concurrency: int
    num_assistant_tokens: int | None
    num_assistant_tokens_schedule: str | None  # speculative only
    markov_top_k: int | None
    num_requests: int
    num_generated_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None  # over the baseline at the same concurrency
    ttft_s: dict[str, float | None]  # p50, p90
    tpot_s: dict[str, float | None]
    spec: dict | None  # SpecDecodingStats.to_json() summed over the requests (speculative only)
    times: dict  # StepTimes deltas over the run
    target_share: float | None  # of the step time
    draft_share: float | None
    host_share: float | None  # of the step time, outside the target's and the draft's infer() calls
    drafting_share: float | None  # speculative only: of the (request, step) decisions, the share that drafted
    agreement: Agreement | None  # against the baseline (speculative only, with a baseline)
    rounds: int = 1  # runs of every prompt; figures are over all of them
    speedup_range: list[float] | None = None  # [min, max] of the per-round speedups
    errors: list[str] = field(default_factory=list)  # requests that finished with an error
    sampled: bool = False  # with the sweep's sampling params (temperature > 0); else greedy
    draft_proposals: str | None = None  # sampled speculative settings: "argmax" or "sampled"
    token_ids: list[list[int]] = field(default_factory=list, repr=False)  # per prompt (not in the JSON)

    def to_json(self) -> dict:
        data = asdict(self)
        del data["token_ids"]
        return data


@dataclass
class BenchReport:
    schema_version: int
    status: str  # "complete", "interrupted"
    exact: bool  # f32 inference: a mismatch is a bug
    environment: dict
    options: dict
    prompts: list[str | None]
    settings: list[SettingResult] = field(default_factory=list)

    @property
    def baselines(self) -> list[SettingResult]:
        return [s for s in self.settings if s.kind == "baseline"]

    @property
    def speculative(self) -> list[SettingResult]:
        return [s for s in self.settings if s.kind == "speculative"]

    @property
    def mismatches(self) -> list[tuple[SettingResult, Mismatch]]:
        return [(s, m) for s in self.speculative if s.agreement for m in s.agreement.mismatches]

    @property
    def errors(self) -> list[str]:
        return [f"{s.name}: {e}" for s in self.settings for e in s.errors]

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "status": self.status,
            "exact": self.exact,
            "environment": self.environment,
            "options": self.options,
            "prompts": self.prompts,
            "settings": [s.to_json() for s in self.settings],
        }



# ---- losslessness ----------------------------------------------------------------------------------------


def compare_outputs(baseline: list[list[int]], speculative: list[list[int]], prompts: Sequence[str | None]) -> Agreement:
    """Token-for-token agreement of each speculative output with the baseline's for the same prompt."""
    agreement = Agreement()
    divergences = []
    for index, (expected, got) in enumerate(zip(baseline, speculative, strict=True)):
        agreement.compared += 1
        if expected == got:
            agreement.identical += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        divergences.append(first)
        agreement.mismatches.append(Mismatch(index, prompts[index] if index < len(prompts) else None, first, expected, got))
    agreement.median_first_divergence = float(statistics.median(divergences)) if divergences else None
    return agreement


