"""The "adaptive" schedule: draft, per request, the candidates that pay for the whole cost of drafting.

Throughput of the next step, with n requests generating, k_r candidates for request r and q_r(i) the
estimated probability that request r's candidate at block position i is accepted (every earlier
one too):

    tokens  = n + sum_r sum_{i < k_r} q_r(i)
    seconds = T(n + sum_r k_r) + [any k_r > 0] * D(draft rows)

T and D are fitted on this engine's own measured steps (host work included): T = fixed + per row +
per reshape (a step whose rows differ from the previous step's: OpenVINO prepares the graph for the
new shape, ~5 ms of a 20 ms step at c=1 on an AVX2 CPU, so a block that changes size every step costs
more than a steady one; a change of size is charged the reshape spread over the steps a shape has
lasted lately, `shape_lifetime`), over generation steps of the target that verified candidates; a row
count already measured (steps that kept their shape) is priced at the median of its latest steps instead, and not
drafting at the mean of the steps that verified none; D = fixed + per context row + per block row + per candidate
row, over the draft's steps (a context row only writes the draft's keys and values, a block row
runs every layer, and a candidate row also runs the vocabulary-wide lm_head, most of a small
draft's cost). The draft's fixed cost (one more inference per step) is paid once, by the whole step,
as soon as one request drafts, so the choice is made jointly: every (request, position) slot is
sorted by q, and the prefix of slots with the highest tokens / seconds is drafted if it beats not
drafting by `min_gain` (5%: the fits and estimates are noisy), which may be none (zero candidates:
the draft does not run this step at all; committed rows wait in the request's ledger and are caught
up in one packed pass when it drafts again, a cost charged to its first candidate and spread over
the steps the request can still draft: the catch-up serves them all).

That step-by-step rate is what counts while requests wait for a place in the batch: one that ends early
hands its place on. In a closed batch (nothing waits) the batch lasts as long as its slowest request:
the requests that plan drafts for all draft the same number of candidates, the number that finishes
every running request soonest, if that is `closed_min_gain` (5%) sooner than drafting nothing
(`_closed_plan`): each request ends after its remaining tokens over its expected tokens a step (a
drafting one later by the spread of its accepted lengths, as the latest of the batch would), and each
stretch between two ends costs a step of the requests still running. A request alone is its own
batch: the fastest step is the soonest end, and the step's rate decides.

q_r(i) is per request, so one request whose draft fails does not stop the others: decayed counts of
its own verifications (recent steps weigh more: acceptance changes along a response), shrunk towards
the engine-wide figure by a number of pseudo-steps that follows how much the running requests differ
(`prior_strength`: strong when they all accept alike, weak when they differ). While a request drafts
nothing its own evidence fades (`pause_decay` per step), so a request that stopped on a bad streak
comes back when the engine-wide figure says drafting pays, and one whose draft really fails stays
near its probes. A position the request never drafted continues from its last estimate with the
engine-wide ratio q(i) / q(i - 1).

A request that stopped drafting is probed again: after `probe_after` steps without candidates it
drafts `probe_candidates` candidates once, and each probe that does not bring drafting back doubles
the wait (up to `max_probe_after`); a probe whose expected loss (its rows and draft step, less the
tokens it is expected to find) exceeds `probe_budget` of the request's time waits longer, and one whose
request would not draft even if its draft accepted everything (rows as dear as tokens) is skipped. Waits are
powers of two counted in engine steps, so the probes of several requests fall on the same steps and
share one draft inference. A batch of two or more that has not chosen to draft for a while drafts its
whole plan for two steps (`_retest`), priced at the top of what the engine-wide acceptance allows: where
one request's candidates move the whole batch onto a dearer kernel, a probe is priced out, and the batch's
estimates and prices would otherwise stay where they stopped.

Until both lines are fitted (`min_steps` varied steps each) the schedule explores: the whole block,
half of it, one candidate and none twice, step by step (a step without candidates right after one with
is a reshape, and only the second prices not drafting: with only the first, a batch size never measured
its plain step while exploring, priced it on the line, about a fifth too high at c=8 on an AVX2 CPU,
and drafted at 187 tokens/s where not drafting ran 214); once that plain step is measured, the blocks
alone (`_explore`). Once the draft's line and the acceptance are known, a batch size whose class has no
line yet is priced on the nearest larger class's line (`pricing_line`: rows cost less there, so it errs
toward drafting, whose steps then fit the class's own line); where only a smaller class has one (a c=8
batch after a c=1 warm-up, as in `dflash bench`), that line's "draft" is taken (it prices rows high) and
its "do not draft" is not: the batch is explored by one request alone (its block moves the rows all the
same). Whole blocks for every request of a class never priced cost 60-100 ms steps at c=8 where a plain
one took 25-35, in every round of a benchmark (the class gathered varied steps slowly).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np


class LinearCost:
    """seconds = fixed + sum_j per_unit[j] * counts[j], least squares over the latest `window`
    observations, coefficients kept non-negative.

    The target's step has two: its rows (seeds and candidates all need logits, so they cost alike) and
    whether its rows differ from the step before (1) or not (0): OpenVINO's CPU plugin prepares every
    node again when an input's shape changes, which costs about a fifth of a SmolLM2-135M step.
    The draft's has three: context rows (committed tokens: keys and values only), block rows (every
    layer) and candidate rows (the vocabulary-wide lm_head too: on a small draft, most of a candidate
    row's cost). Counted as one, a catch-up step's many cheap context rows pulled the per-row slope
    below zero and the fit blamed the whole draft step on its fixed cost. An earlier fit is kept while
    new observations cannot be fitted (counts that barely vary); an `optional` count that does not vary
    (a flag that is always 0 or always 1 in the window) keeps its earlier coefficient (0 before any fit)
    and the rest is fitted around it: a schedule that learned what a reshape costs and then stopped
    reshaping must not forget the price (it would start reshaping again)."""

    def __init__(self, num_counts: int = 1, window: int = 128, min_samples: int = 8,
                 min_spread: float | Sequence[float] = 0.5, refit_every: int = 8, optional: Sequence[int] = ()):  # fmt: skip
        self.num_counts = num_counts
        self._samples: deque[tuple[tuple[int, ...], float]] = deque(maxlen=window)
        self.min_samples = min_samples
        # standard deviation each count needs across the window (one figure for all, or one per count)
        self.min_spread = np.broadcast_to(np.asarray(min_spread, dtype=np.float64), (num_counts,))
        self.optional = frozenset(optional)  # counts fitted only while they vary (their coefficient held meanwhile)
        # New observations before a refit: `refit_every`, or a quarter of the window once it holds more. In
        # the engine a fit took 0.7 ms (cold, between two inferences) against 0.15 ms for a plan without one,
        # and the draft's line and the batch's both refitting every 8 steps were 44% of the plan's time at c=1.
        self.refit_every = refit_every
        self._must_refit = False  # `know` changed a held coefficient
        self._fit: np.ndarray | None = None  # [fixed, per_unit...]
        # an optional count's coefficient measured elsewhere, used while the window cannot fit it (`know`)
        self._known: dict[int, float] = {}
        self._fit_tuple: tuple[float, ...] | None = None
        self._num_new = 0

    @property
    def observations(self) -> list[tuple[tuple[int, ...], float]]:
        """The window: (counts, seconds) of the latest observations, oldest first."""
        return list(self._samples)

    def observe(self, counts: int | tuple[int, ...], seconds: float) -> None:
        self._samples.append((counts if isinstance(counts, tuple) else (counts,), seconds))
        self._num_new += 1

    def know(self, j: int, value: float) -> None:
        """Optional count j costs `value` a unit, as measured elsewhere: used wherever the window cannot
        fit it (the count does not vary there); the next fit() refits the rest around it."""
        if self._known.get(j) != value:
            self._known[j] = value
            self._must_refit = True

    def state(self) -> dict:
        """The window and the latest fit, JSON-ready (`restore`)."""
        return {"observations": self.observations, "fit": None if self._fit is None else self._fit.tolist()}

    def restore(self, state: dict) -> None:
        """Take up an earlier line's window and fit: its fit holds until new observations refit it (an
        earlier fit is what a window of counts that no longer vary keeps). Raises ValueError on data
        that cannot be such a line's."""
        observations = [(tuple(int(c) for c in counts), float(seconds)) for counts, seconds in state["observations"]]
        fit = state["fit"]
        if any(len(counts) != self.num_counts or min(counts) < 0 or not 0 <= seconds < 60 for counts, seconds in observations):
            raise ValueError("malformed step costs")
        if fit is not None:
            fit = np.asarray(fit, dtype=np.float64)
            if fit.shape != (self.num_counts + 1,) or not ((fit >= 0) & (fit < 60)).all():
                raise ValueError("malformed step cost fit")
        self._samples.extend(observations)
        self._fit, self._fit_tuple = fit, None if fit is None else tuple(float(c) for c in fit)
        self._num_new = 0 if fit is not None else len(observations)

    def fit(self) -> tuple[float, ...] | None:
        """(fixed seconds, seconds per unit of each count), or None until it can be fitted."""
        if self._fit is None:
            due = self._num_new > 0
        else:
            due = self._must_refit or self._num_new >= max(self.refit_every, len(self._samples) // 4)
        if due and len(self._samples) >= self.min_samples:
            self._num_new, self._must_refit = 0, False
            counts = np.array([c for c, _ in self._samples], dtype=np.float64)  # [n, num_counts]
            seconds = np.array([s for _, s in self._samples], dtype=np.float64)
            varies = counts.std(axis=0) >= self.min_spread
            used = [j for j in range(self.num_counts) if varies[j] or j not in self.optional]
            if all(varies[used]):
                # an optional count that does not vary keeps its coefficient (0 before any fit), or takes
                # the one measured elsewhere
                fit = np.zeros(self.num_counts + 1) if self._fit is None else self._fit.copy()
                held = [j for j in range(self.num_counts) if j not in used]
                for j in held:
                    fit[1 + j] = self._known.get(j, fit[1 + j])
                seconds = seconds - counts[:, held] @ fit[[1 + j for j in held]]
                fit[[0] + [1 + j for j in used]] = _robust_fit(counts[:, used], seconds)
                self._fit = fit
                self._fit_tuple = tuple(float(c) for c in self._fit)
        return self._fit_tuple

    def seconds(self, *counts: int) -> float:
        """Predicted seconds (as of the latest fit())."""
        fit = self._fit_tuple  # plain floats: a plan prices a few dozen steps, where numpy's overhead is most of it
        if fit is None:
            return 0.0
        return fit[0] + sum(c * x for c, x in zip(fit[1:], counts))


def _robust_fit(counts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares, then again without the steps that took far longer than it predicts.

    OpenVINO's first inference of a new input shape is slow (its shape-specific preparation), and a
    rare kind of step (a draft that runs only for probes and catch-ups of many different lengths)
    is mostly first-of-its-shape: fitted as they come, those steps turned the draft's cost into a
    fixed cost several times the target's step. Slower than the fit by more than 3 robust standard
    deviations (and 10%) counts as such a step."""
    fit = _non_negative_least_squares(counts, seconds)
    predicted = fit[0] + counts @ fit[1:]
    excess = seconds - predicted
    spread = 1.4826 * _median(np.abs(excess - _median(excess)))
    typical = (excess <= 3 * spread) | (excess <= 0.1 * predicted)
    if typical.all() or typical.sum() < max(len(seconds) // 2, 2):
        return fit
    return _non_negative_least_squares(counts[typical], seconds[typical])


def _median(values: np.ndarray) -> float:
    """np.median without its generality (a tenth of its time on a window of steps)."""
    ordered = np.sort(values)
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else float(ordered[middle - 1] + ordered[middle]) / 2


def _non_negative_least_squares(counts: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with an intercept; a coefficient that comes out negative (noise) is dropped and
    the rest refitted."""
    active = list(range(counts.shape[1]))
    while True:
        design = np.column_stack([np.ones(len(seconds)), counts[:, active]])
        solution, *_ = np.linalg.lstsq(design, seconds, rcond=None)
        coefficients = np.zeros(counts.shape[1] + 1)
        coefficients[0] = max(0.0, solution[0])
        coefficients[[1 + j for j in active]] = solution[1:]
        negative = [j for j, c in zip(active, solution[1:]) if c < 0]
        if not negative:
            return coefficients
        active = [j for j in active if j not in negative]


class AcceptanceCounts:
    """Decayed counts of verifications by block position, and the acceptance they estimate.

    Per position i: `drafted` (verifications that drafted it), `reached` (of those, the ones whose
    earlier candidates were all accepted: the trials of position i itself) and `accepted` (the ones
    that accepted it, and so every earlier one). q(i), the chance that the first i + 1 candidates are
    all accepted, is the product of the conditional rates accepted / reached of positions 0..i, each
    shrunk towards the rate of the position before it by `smoothing` pseudo-trials (or, given a prior,
    towards the prior's rate).

    Estimated as accepted / drafted instead, a deep position drafted a few times while exploring, and
    failed each time (likely where q is 0.1), read 0 and was never drafted again: chat prompts at c=1
    drafted 2 candidates where 7 ran 1.19x the target alone, and the schedule reached 0.93x. As
    conditional rates, the few trials of a deep position weigh against the rates of the positions
    before it (measured: 0.48-0.54 at positions 0-3 on chat, 0.66-0.77 on HumanEval), and a position
    without trials continues at the rate before it."""

    def __init__(self, decay: float, smoothing: float = 2.0):
        self.decay = decay
        self.smoothing = smoothing
        self.drafted = np.zeros(0)  # [positions] decayed counts
        self.reached = np.zeros(0)
        self.accepted = np.zeros(0)
        self.version = 0  # counts observations: estimates computed from the same version are the same

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.version += 1
        if len(self.drafted) < num_drafted:
            grow = (0, num_drafted - len(self.drafted))
            self.drafted, self.reached, self.accepted = (np.pad(a, grow) for a in (self.drafted, self.reached, self.accepted))
        for counts in (self.drafted, self.reached, self.accepted):
            counts *= self.decay
        self.drafted[:num_drafted] += 1.0
        self.reached[: min(num_drafted, num_accepted + 1)] += 1.0
        self.accepted[:num_accepted] += 1.0

    def fade(self, factor: float) -> None:
        """Weigh the evidence so far by `factor` (a paused request's estimate drifts to the prior)."""
        if len(self.drafted):
            for counts in (self.drafted, self.reached, self.accepted):
                counts *= factor
            self.version += 1

    def estimate(self, length: int, prior: Sequence[float] | None = None, prior_weight: float = 0.0) -> list[float]:
        """q(0..length-1), non-increasing (accepting position i needs every earlier one accepted).

        Without a prior, each position's conditional rate is shrunk towards the rate before it (0.5
        before any trial). With `prior` (the engine-wide q) worth `prior_weight` verifications, towards
        the prior's rate at that position, q_prior(i) / q_prior(i - 1), with the prior_weight x
        q_prior(i - 1) of its pseudo-verifications that reach position i: a position this request never
        drafted continues from its last estimate at the prior's ratio."""
        q: list[float] = []
        rate, reach = 0.5, 1.0  # the rate before position 0 (nothing known: a coin flip); q(-1) = 1
        for i in range(length):
            trials = float(self.reached[i]) if i < len(self.reached) else 0.0
            accepted = float(self.accepted[i]) if i < len(self.accepted) else 0.0
            if prior is not None:
                prior_rate = prior[0] if i == 0 else _ratio(prior, i)
                weight = prior_weight * (1.0 if i == 0 else prior[i - 1])
            else:
                prior_rate, weight = rate, (self.smoothing if i else 0.0)
            if trials + weight > 1e-9:
                rate = min(1.0, (accepted + weight * prior_rate) / (trials + weight))
            else:
                rate = prior_rate
            reach *= rate
            q.append(reach)
        return q

    def upper(self, length: int, z: float = 2.0) -> list[float]:
        """q(0..length-1) at the upper end of what the counts allow: each position's conditional rate
        (one pseudo-trial each way) plus `z` standard errors, a position without trials at 1."""
        q, reach = [], 1.0
        for i in range(length):
            trials = float(self.reached[i]) if i < len(self.reached) else 0.0
            rate = (float(self.accepted[i]) + 1.0) / (trials + 2.0) if i < len(self.accepted) else 0.5
            reach *= min(1.0, rate + z * math.sqrt(rate * (1.0 - rate) / (trials + 2.0)))
            q.append(reach)
        return q

    @property
    def is_empty(self) -> bool:
        return len(self.drafted) == 0

    @property
    def first_position(self) -> tuple[float, float]:
        """(accepted, drafted) at the first block position, decayed; (0, 0) before any verification."""
        return (float(self.accepted[0]), float(self.drafted[0])) if len(self.drafted) else (0.0, 0.0)


def _ratio(prior: Sequence[float], i: int) -> float:
    return min(1.0, prior[i] / prior[i - 1]) if prior[i - 1] > 0 else 0.0


def _seconds_to_finish(requests: list[tuple[float, int, float]], target_seconds: Callable[[int, int], float], d_fixed: float) -> float:
    """Seconds until every request ends, each given as (steps to finish, candidates a step, its draft
    seconds a step): a stretch between two ends costs a target step of the requests still running and
    their candidates (`target_seconds(requests, candidates)`), and the draft's step (its fixed cost and
    the drafting requests' rows) while one of them drafts."""
    seconds, done, live = 0.0, 0.0, len(requests)
    candidates = sum(k for _, k, _ in requests)
    draft = sum(d for _, _, d in requests)
    drafters = sum(1 for _, k, _ in requests if k)
    for steps, k, d in sorted(requests):
        if steps > done:
            seconds += (steps - done) * (target_seconds(live, candidates) + (d_fixed + draft if drafters else 0.0))
            done = steps
        live, candidates, draft, drafters = live - 1, candidates - k, draft - d, drafters - (1 if k else 0)
    return seconds


def _steps_spread(q: Sequence[float], remaining: float) -> float:
    """The standard deviation of the number of steps a request drafting a block with acceptance `q`
    (q[j]: its first j + 1 candidates all accepted) takes for `remaining` tokens. A step commits
    1 + A tokens, P(A > j) = q[j]; over many steps the count of steps is about normal with variance
    remaining * Var(A) / E[1 + A]^3 (renewal theory)."""
    mean = sum(q)
    variance = sum((2 * j + 1) * p for j, p in enumerate(q)) - mean * mean  # E[A^2] - E[A]^2
    return math.sqrt(max(variance, 0.0) * remaining / (1.0 + mean) ** 3)


@functools.cache
def _latest_of(n: int) -> float:
    """About how many standard deviations above the mean the latest of n like requests ends: the
    expected maximum of n standard normals (Blom's approximation; 0 for one request)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


_STATE_VERSION = 1  # of `AdaptiveSchedule.state()`: a state of another version is not restored
_FADE_EVERY = 8  # steps between two fades of a paused request's evidence
_MIN_MEASURED = 3  # steps of a row count before their median replaces the line's price
_ROW_COUNT_STEPS = 9  # the latest steps of a row count whose median prices it (`_measured_verify_seconds`)


def _running_mean(mean: float, steps: int, seconds: float) -> tuple[float, int]:
    """A mean of a kind of step with one more step, recent steps weighing more once there are ten."""
    return mean + (seconds - mean) / min(steps + 1, 10), steps + 1


def _mean(item) -> tuple[float, int]:
    """A (running mean seconds, steps) pair read back from JSON, checked."""
    mean, steps = float(item[0]), int(item[1])
    if not 0 <= mean < 60 or steps < 1:
        raise ValueError("malformed schedule state: a mean step")
    return mean, steps


def batch_class(num_requests: int) -> int:
    """Batch sizes whose target steps are priced apart: 1, 2-3, 4-7, 8-15, ... (a power-of-two class,
    as other engines profile their step costs per batch size)."""
    return max(num_requests, 1).bit_length()


@dataclass
class _RequestState:
    counts: AcceptanceCounts
    steps_without: int = 0  # engine steps since this request last drafted
    probe_after: int = 0  # 0: not paused
    probing: bool = False
    estimate: list[float] = field(default_factory=list)  # cached, for estimate_key
    estimate_key: tuple = ()


@dataclass(slots=True)  # not frozen: one is built per request and step, and a frozen one costs 4x as much to build
class Candidate:
    """A request the schedule may draft for this step."""

    req_id: str
    cap: int  # at most this many candidates (num_assistant_tokens, the draft's block)
    num_pending_rows: int = 0  # committed rows the draft has not read yet (paid when it runs)
    num_remaining_tokens: int = 0  # tokens the request may still generate (0: unknown, the catch-up is paid whole)

    def catch_up_rows(self, q: Sequence[float]) -> float:
        """The pending context rows one step is charged for: a catch-up is paid once and then serves
        every later step of the request (its prompt, for a request that has not drafted yet), so it is
        spread over the steps the request can still draft, each expected to bring 1 + sum(q) tokens.
        Charged whole in one step, a new request's prompt (100+ context rows) outweighed any one step's
        gain, so it never drafted and its pending rows only grew (HumanEval at c=1 drafted in 37% of
        request steps and reached 1.12x where 3 candidates every step gave 1.44x)."""
        steps = self.num_remaining_tokens / (1.0 + sum(q))
        return self.num_pending_rows / max(steps, 1.0)


@dataclass
class AdaptiveSchedule:
    """Per-request candidate counts that maximize the expected tokens per second of the next step."""

    min_steps: int = 8
    prior_weight: float = 12.0  # until prior_strength() has enough requests to measure it
    min_requests: int = 4
    min_evidence: float = 3.0
    request_decay: float = 0.9
    engine_decay: float = 0.98
    pause_decay: float = 0.95  # per step without candidates, a request's own evidence fades toward the prior
    probe_after: int = 8
    max_probe_after: int = 128
    # A probe verifies few rows: at concurrency 8 the probes of all paused requests fall on one step,
    # and 4 candidates each made that step cost two (measured: chat prompts, c=8, 0.87x with 4).
    probe_candidates: int = 2
    probe_budget: float = 0.02  # the share of a paused request's time its probes may lose, on expectation
    min_gain: float = 0.05
    # how much sooner a drafting plan must finish a closed batch (`_closed_plan`); -1: no such rule
    closed_min_gain: float = 0.05
    # At most this prior strength, requests differ so much (a draft that suits some prompts and fails on
    # others) that a new request's first probe is worth more than its expected loss: it tells a request
    # the engine-wide figure would keep paused that it should draft (`_probe`).
    differ_strength: float = 2.0
    recent_requests: int = 32  # finished requests whose acceptance still counts in prior_strength
    # Where requests split into some that accept all and some that accept nothing, the moments give a
    # strength near 0: a request's own first verifications then decide (at 1, one probe that accepted
    # everything left the estimate halfway to an engine-wide 0.03, and the request stayed paused).
    min_prior_strength: float = 0.25
    # over (context rows, block rows, candidate rows); context rows optional: a draft that accepts
    # nothing at c=1 reads 1 or 2 of them a step, which never varied enough for a fit, and the schedule
    # explored (drafting 3 steps in 4) for over a thousand steps
    draft_cost: LinearCost = field(default_factory=lambda: LinearCost(num_counts=3, optional=(0,)))
    shape_window: int = 32  # the latest drafting steps (per batch-size class) that tell how long a shape lasts
    # A row count's price (`verify_step_seconds`) not measured again within this many generation steps of
    # the same number of requests, verifying or not, keeps only `_MIN_MEASURED` - 1 of its steps: its next
    # steps soon outweigh them.
    mean_lifetime: int = 128
    # A batch (two requests or more) that has not chosen to draft for `retest_after` steps drafts its best
    # plan anyway for `retest_steps` steps, if that plan's expected rate is within `retest_margin` of not
    # drafting (`_retest`); each re-test that does not bring drafting back doubles the wait, up to
    # `max_retest_after`.
    retest_after: int = 32
    max_retest_after: int = 512
    retest_steps: int = 2
    retest_margin: float = 0.15

    def __post_init__(self) -> None:
        for name in ("probe_after", "max_probe_after"):  # probes of several requests share steps (`_probe`)
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        self.draft_cost.min_samples = self.min_steps
        # per batch-size class (`batch_class`): seconds over (rows, reshaped) of steps that verified candidates
        self.target_costs: dict[int, LinearCost] = {}
        self.engine_wide = AcceptanceCounts(self.engine_decay)
        self._requests: dict[str, _RequestState] = {}
        self._prior_key: tuple = ()
        self._prior: list[float] = []
        self._weight = self.prior_weight
        self._num_steps = 0
        # rows -> (running mean seconds, steps) of steps that kept the previous step's shape and verified
        # no candidate (plain) or some (verify)
        self._plain_seconds: dict[int, tuple[float, int]] = {}
        self._plain_reshaped_seconds: dict[int, tuple[float, int]] = {}  # the same, of steps that changed shape
        # whether each of the two latest plans drafted by choice (not only probes or exploration): the
        # target step observed after a plan was planned by the one before it
        self._chosen: deque[bool] = deque([False, False], maxlen=2)
        # requests -> rows -> (its latest steps as (seconds, the plain step's mean then), when last measured:
        # `_verify_clock`): `_measured_verify_seconds`
        self._verify_seconds: dict[int, dict[int, tuple[deque[tuple[float, float]], int]]] = {}
        self._verify_clock: dict[int, int] = {}  # requests -> generation steps observed for them
        self._unchosen = 0  # plans in a row that did not choose to draft (`_retest`)
        self._retest_wait = self.retest_after
        self._retest_left = 0  # steps of a re-test still to run
        self._seen_shapes: set[tuple[str, int]] = set()  # ("target" | "draft", rows) observed at least once
        # per batch-size class: whether each of the latest steps that verified candidates changed shape
        self._shape_changes: dict[int, deque[bool]] = {}
        # (accepted, drafted) at the first position of recent finished requests (prior_strength)
        self._finished: deque[tuple[float, float]] = deque(maxlen=self.recent_requests)
        self.num_decisions = 0  # (request, step) decisions made
        self.num_drafting = 0  # of them, with at least one candidate
        self.num_observed_steps = 0  # target generation steps observed

    # ---- what happened ----------------------------------------------------------------------------

    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        self.engine_wide.observe(num_drafted, num_accepted)
        self._state(req_id).counts.observe(num_drafted, num_accepted)

    def observe_target(self, rows: int, seconds: float, verified_candidates: bool = True, reshaped: bool = False,
                       num_requests: int = 1) -> None:  # fmt: skip
        """A generation step of the target (no prompt chunk in it): its rows and seconds, whether its rows
        differ from the previous step's (`reshaped`), and how many requests it served.

        Steps that verified candidates fit the line the drafting options are priced on, one line per
        batch-size class (`batch_class`): a row costs more where few requests share a step (at c=1 on an
        AVX2 CPU in f32, 2.5-5 ms a row from 1 to 8 rows; at c=8, about 2 ms a row from 8 to 24), and a
        line fitted during a c=1 warm-up then priced c=8's candidates so high that nothing drafted. Steps
        that verified none are kept apart, per row count (a running mean), and price not drafting: one
        line through both misjudged both on a CPU where a step of one row per request runs another,
        cheaper kernel than a step of two or more (12 ms for one row, 17 for two, then 2-3 ms a row).
        Steps that verified candidates are also kept per (requests, rows): the line is the price of a row
        count not measured yet, the median of its latest steps the price of one measured (at c=1 on that CPU, 4 rows
        19-23 ms and 5 rows 26-31: a line through 2 to 8 rows priced the fifth row as cheap as the third,
        and the schedule drafted 3.3 candidates a step where the constant 3 was faster).

        The first step of each row count is not used (`_first_of_shape`)."""
        self.num_observed_steps += 1
        if verified_candidates and self._chosen[0]:
            changes = self._shape_changes.setdefault(batch_class(num_requests), deque(maxlen=self.shape_window))
            changes.append(reshaped)
        # every step of this batch size, verifying or not, ages the row-count prices (`_measured_verify_seconds`)
        clock = self._verify_clock[num_requests] = self._verify_clock.get(num_requests, 0) + 1
        if self._first_of_shape("target", rows):
            return
        if verified_candidates:
            self.target_cost(num_requests).observe((rows, int(reshaped)), seconds)
            if not reshaped:
                by_rows = self._verify_seconds.setdefault(num_requests, {})
                steps, seen = by_rows.get(rows, (deque(maxlen=_ROW_COUNT_STEPS), clock))
                if clock - seen > self.mean_lifetime:  # stale (`_measured_verify_seconds`)
                    steps = deque(list(steps)[-(_MIN_MEASURED - 1):], maxlen=_ROW_COUNT_STEPS)
                steps.append((seconds, self._plain_seconds.get(num_requests, (0.0, 0))[0]))
                by_rows[rows] = (steps, clock)
            return
        means = self._plain_reshaped_seconds if reshaped else self._plain_seconds
        means[rows] = _running_mean(*means.get(rows, (0.0, 0)), seconds)
        if reshaped and rows in self._plain_seconds:
            # What a change of shape costs, measured where it is measured cleanly: a plain step that
            # changed shape against one that did not, of the same rows. The line of steps that verified
            # candidates takes it while its own steps all changed shape (a paused batch verifies only
            # probes, each a new shape), which would otherwise fold it into the fixed cost and price
            # every drafting step as a reshape: chat prompts at c=1 stayed paused at 0.96x the target
            # alone where drafting 7 candidates every step ran 1.16x.
            reshape = self._plain_reshaped_seconds[rows][0] - self._plain_seconds[rows][0]
            self.target_cost(num_requests).know(1, max(reshape, 0.0))

    def target_cost(self, num_requests: int) -> LinearCost:
        """The line of the target's steps serving `num_requests` requests (their batch-size class)."""
        cost = self.target_costs.get(batch_class(num_requests))
        if cost is None:
            cost = self.target_costs[batch_class(num_requests)] = self._new_target_line()
        return cost

    def pricing_line(self, num_requests: int) -> LinearCost | None:
        """The line that prices target steps of `num_requests` requests: their class's own once it is
        fitted; until then the nearest larger class's, else the nearest smaller class's; None while no
        class is fitted.

        A class's line needs steps of that batch size with varied rows. Explored by one request at a time
        (the others drafting nothing) while it had none, a c=8 wave lost its tail to it: as a wave's
        requests end, its batch passes through the classes 4-7, 2-3 and 1, each explored in turn (39
        plans at 5-7 requests in the first wave of HumanEval in which one request drafted and the rest
        nothing; that wave took 5.3 s where later ones took 3.2, and 4.8 s priced by the larger class).
        A larger batch prices a row lower (on a 4th-generation Xeon 0.31-0.33 ms a row for 2-15
        requests, 1 ms for one), so its line errs toward drafting, and the steps it lets draft are the
        varied steps the class's own line is then fitted on. A smaller batch's line errs the other way,
        so `plan` takes only its "draft": fitted on a c=1 warm-up, it priced c=8's candidates so high
        that nothing drafted, and a class that does not draft gathers no steps to correct it."""
        priced_by = self._pricing_class(num_requests)
        return None if priced_by is None else self.target_costs[priced_by]

    def _pricing_class(self, num_requests: int) -> int | None:
        """The batch-size class whose line `pricing_line` takes for `num_requests` requests."""
        wanted = batch_class(num_requests)
        if self.target_cost(num_requests).fit() is not None:
            return wanted
        fitted = [k for k, line in self.target_costs.items() if k != wanted and line.fit() is not None]
        return min(fitted, key=lambda k: (k < wanted, abs(k - wanted))) if fitted else None

    def _new_target_line(self) -> LinearCost:
        """A batch-size class's line of target steps, before any step: seconds over (rows, reshaped)."""
        return LinearCost(num_counts=2, min_samples=self.min_steps, min_spread=(0.5, 0.2), optional=(1,))

    def plain_step_seconds(self, rows: int, line: LinearCost | None = None) -> float:
        """Seconds of a target step of `rows` rows, one per request, that keeps the previous step's
        shape: measured, or from `line` (default: the line of that batch size's class)."""
        measured = self._plain_seconds.get(rows)
        if measured is not None:
            return measured[0]
        return (line or self.pricing_line(rows) or self.target_cost(rows)).seconds(rows, 0)

    def verify_step_seconds(self, rows: int, num_requests: int = 1) -> float:
        """Seconds of a target step of `rows` rows for `num_requests` requests that verifies candidates
        and keeps the previous step's shape: measured (`_MIN_MEASURED` steps), or from the line."""
        measured = self._measured_verify_seconds(num_requests).get(rows)
        if measured is not None:
            return measured
        return (self.pricing_line(num_requests) or self.target_cost(num_requests)).seconds(rows, 0)

    def _measured_verify_seconds(self, num_requests: int) -> dict[int, float]:
        """rows -> seconds, of the row counts measured `_MIN_MEASURED` times for `num_requests` requests:
        the median of their latest `_ROW_COUNT_STEPS` steps, each priced relative to the plain step.

        A median, not a mean: one step in ten of a row count runs 1.5-2x its median on a 2-core VM (24 rows
        at c=8 on a Zen 4 EPYC: median 26 ms, mean 30, slowest 50), and a running mean of the few steps of
        a row count drafted now and then kept such a step for a long time (24 rows priced at 42 ms).

        Relative to the plain step: each step is priced times the plain step's mean now over its mean when
        the step ran (within half to twice). The machine's speed moves all steps alike, and a batch that
        stopped drafting measures only plain steps: on that EPYC at c=8 the plain step read 15.5-24 ms
        within one run, so a row count measured in a slow stretch made drafting, which paid, look a loss.

        A row count not measured again within the latest `mean_lifetime` generation steps of these requests
        (verifying candidates or not: a batch that stopped drafting ages them, so a re-test (`_retest`)
        takes them up again) keeps, at its next step, only its `_MIN_MEASURED` - 1 latest steps: its next
        steps soon outweigh them. On a 2-core VM whose speed moves up to 30% between minutes, a price kept
        from a fast minute (or a schedule memory) priced 57-row steps at c=8 cheap, which then took 63-76
        ms where the constant 3's 32 rows took 33. A stale price still prices its row count until measured
        again (it is not dropped for the line: on an AVX2 CPU at c=1, where a step of 1-4 rows costs 23-29
        ms and 5-8 rows 38-72, the line through them read 0 ms + 9.5 ms a row and priced 4 rows at 38 ms,
        which then were never chosen again)."""
        by_rows = self._verify_seconds.get(num_requests, {})
        plain_now = self._plain_seconds.get(num_requests, (0.0, 0))[0]

        def now(seconds: float, plain_then: float) -> float:
            return seconds * min(max(plain_now / plain_then, 0.5), 2.0) if plain_now > 0 and plain_then > 0 else seconds

        return {rows: statistics.median([now(*step) for step in steps])
                for rows, (steps, _) in by_rows.items() if len(steps) >= _MIN_MEASURED}  # fmt: skip

    def reshape_seconds(self, num_requests: int = 1) -> float:
        """What a target step pays for rows that differ from the previous step's (as of the latest fit)."""
        line = self.pricing_line(num_requests)
        return line.fit()[2] if line is not None else 0.0

    def shape_lifetime(self, num_requests: int = 1) -> float:
        """How many steps the shape of a step that verifies candidates has lasted lately, for
        `num_requests` requests (their batch-size class): the latest `shape_window` such steps over their
        changes of shape. A drafting option whose rows differ from the previous step's is charged the
        reshape spread over that many steps.

        A reshape is paid once and the new shape then serves the steps after it. Charged whole to the one
        step that changes shape, a schedule stayed wherever it was: at c=1 on an AVX2 CPU, drafting 5
        candidates (6 rows, 36 ms a step) where 3 (4 rows, 24 ms) brought more tokens per second, for
        150 steps in a row, and paused requests whose 3 candidates would have paid (constant 3 beat it by
        a quarter). Only drafting steps count: a drafting option's shape lasts as long as drafting shapes
        last, and at c=8, where each request's block moves the rows, they changed in 15-35% of drafting
        steps against 1% of the steps that drafted nothing. Where the shape changes every step, the
        lifetime is one step and the whole price is charged: the schedule cannot flip between sizes on
        every change of its estimates. Only steps the schedule chose to draft count: probes and
        exploration change shape by design, and counted, a paused batch (probes only) read a lifetime of
        one step and charged starting to draft a whole reshape, so it never started."""
        changes = self._shape_changes.get(batch_class(num_requests), ())
        return max(1.0, len(changes) / max(1, sum(changes)))

    def observe_draft(self, context_rows: int, block_rows: int, candidate_rows: int, seconds: float,
                      shape_rows: int | None = None) -> None:  # fmt: skip
        """A draft step: its context rows, block rows and candidate rows (among the block rows), and seconds.
        The first step of each shape is not used (`_first_of_shape`): `shape_rows`, the rows of the call as
        OpenVINO runs it (padding rows included: `DraftRunner.padded_rows`; default context + block rows).

        Keyed by the rows alone, every catch-up (a paused request reading a few hundred committed rows at
        once, each of another length) was a first step and none was fitted: at c=8 on an AVX2 CPU the
        draft's line priced a context row at 0 where catch-ups of 226-269 rows took 30-58 ms."""
        if not self._first_of_shape("draft", context_rows + block_rows if shape_rows is None else shape_rows):
            self.draft_cost.observe((context_rows, block_rows, candidate_rows), seconds)

    def _first_of_shape(self, model: str, rows: int) -> bool:
        """OpenVINO runs the first inference of a new input shape slowly (it prepares kernels for it), often
        several times a later one: fitted, those steps of the warm-up and of exploration, each of a new
        row count, made the lines steep enough that drafting never looked worth it again in some runs
        (and nothing drafted to correct them). Seen once, a shape is measured from its second step on."""
        if (model, rows) in self._seen_shapes:
            return False
        self._seen_shapes.add((model, rows))
        return True

    def forget(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is not None and (first := state.counts.first_position)[1] >= self.min_evidence:
            self._finished.append(first)

    # ---- what carries over to the next engine --------------------------------------------------------

    def state(self) -> dict:
        """What this schedule learned that outlives its requests, as JSON-ready data: the step costs it
        measured (the draft's line, the target's lines per batch-size class, the running means of the
        row counts it measured, how long shapes lasted), the engine-wide acceptance and the first-position
        acceptance of the latest finished requests (how much requests differ: `prior_strength`).

        `restore` gives it to a new schedule, which then decides from its first step instead of
        exploring (core/schedule_memory.py keeps it between runs). Measured, one prompt of 128 tokens
        per fresh schedule at c=1 (the default pair, HumanEval): 1.35x the target alone, against 1.76x
        for a schedule that had run before; exploring the costs takes most of a short request."""
        return {
            "version": _STATE_VERSION,
            "draft_cost": self.draft_cost.state(),
            "target_costs": {str(k): cost.state() for k, cost in self.target_costs.items()},
            "plain_seconds": {str(rows): list(mean) for rows, mean in self._plain_seconds.items()},
            "verify_seconds": {str(n): {str(rows): [statistics.median([seconds for seconds, _ in steps]), len(steps)]
                                        for rows, (steps, _) in by_rows.items()}
                               for n, by_rows in self._verify_seconds.items()},  # fmt: skip
            "shape_changes": {str(k): [int(changed) for changed in v] for k, v in self._shape_changes.items()},
            "acceptance": {name: getattr(self.engine_wide, name).tolist() for name in ("drafted", "reached", "accepted")},
            "finished": [list(first) for first in self._finished],
        }

    def restore(self, state: dict) -> None:
        """Start from a `state()` of an earlier schedule (of the same pair, device and properties).

        The costs come back whole and go on being updated as steps are measured (the lines keep their
        latest `window` steps, the means weigh recent steps more), so a machine whose load changed
        corrects them within a few dozen steps; so does the acceptance, which decays with every
        verification (`engine_decay`: other prompts weigh half after about 35). The shapes OpenVINO has prepared are not
        carried over (each run prepares its own: `_first_of_shape`). Raises ValueError on data of
        another shape or version, and then leaves this schedule as it was (the caller starts from nothing)."""
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"schedule state version {state.get('version')!r}, expected {_STATE_VERSION}")
            draft, targets = state["draft_cost"], {int(k): line for k, line in state["target_costs"].items()}
            plain = {int(rows): _mean(v) for rows, v in state["plain_seconds"].items()}
            verify = {int(n): {int(rows): _mean(v) for rows, v in by_rows.items()} for n, by_rows in state["verify_seconds"].items()}
            changes = {int(k): [bool(c) for c in v] for k, v in state["shape_changes"].items()}
            drafted, reached, accepted = (np.asarray(state["acceptance"][name], dtype=np.float64)
                                          for name in ("drafted", "reached", "accepted"))  # fmt: skip
            finished = [(float(a), float(d)) for a, d in state["finished"]]
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"malformed schedule state: {error!r}") from error
        if (drafted.ndim != 1 or drafted.shape != reached.shape or drafted.shape != accepted.shape
                or not ((drafted >= reached) & (reached >= accepted) & (accepted >= 0)).all()):  # fmt: skip
            raise ValueError("malformed schedule state: acceptance counts")
        if any(not 0 <= a <= d for a, d in finished) or any(k < 1 for k in targets):
            raise ValueError("malformed schedule state: finished requests or batch-size classes")
        try:
            lines = {k: self._new_target_line() for k in targets}  # batch-size class k (`batch_class`)
            for k, line in targets.items():
                lines[k].restore(line)
            self.draft_cost.restore(draft)  # the last check: it changes nothing unless it passes
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed schedule state: {error!r}") from error
        self.target_costs.update(lines)
        self._plain_seconds.update(plain)
        for n, by_rows in verify.items():  # as if measured just now, just often enough: new steps soon outweigh them
            clock, plain_then = self._verify_clock.get(n, 0), self._plain_seconds.get(n, (0.0, 0))[0]
            self._verify_seconds.setdefault(n, {}).update(
                {rows: (deque([(mean, plain_then)] * min(steps, _MIN_MEASURED), maxlen=_ROW_COUNT_STEPS), clock)
                 for rows, (mean, steps) in by_rows.items()})  # fmt: skip
        for k, v in changes.items():
            self._shape_changes.setdefault(k, deque(maxlen=self.shape_window)).extend(v)
        self._finished.extend(finished)
        if len(drafted):
            self.engine_wide.drafted, self.engine_wide.reached, self.engine_wide.accepted = drafted, reached, accepted
            self.engine_wide.version += 1

    # ---- the decision ----------------------------------------------------------------------------

    def plan(self, candidates: Sequence[Candidate], *, num_generating: int, candidate_offset: int = 0,
             other_draft_rows: tuple[int, int, int] = (0, 0, 0), last_rows: int | None = None,
             closed: bool = False) -> dict[str, int]:  # fmt: skip
        """Candidates per request for the next step.

        num_generating: the batch the next step belongs to: requests whose seed rows the target
            verifies next step (drafting or not), and those about to join them (admitted while earlier
            prompts are read; the engine's `TargetStep.num_batch`). Priced at that size: drafting for
            the first requests of a wave to finish their prompts, as if they were the batch, caught
            up whole prompts through the draft for a few steps (the batch then filled and drafting
            stopped): HumanEval at c=8, 0.95x and 0.99x never drafting in two runs; 1.00x priced at the batch.
        candidate_offset: block rows before the first candidate row (1 for z-lab DFlash).
        other_draft_rows: (context rows, block rows, candidate rows) of the draft that run anyway
            (other schedules' windows); all 0: the draft runs only if this schedule drafts.
        last_rows: the rows of the target step that just ran: a next step of other rows pays the reshape
            (None: unknown, no option is charged for it).
        closed: no request waits for a place in the batch: the running requests are all there is to
            finish, and a drafting plan must also finish them sooner (`_closed_plan`).
        """
        self._num_steps += 1
        chosen = False  # drafting by choice (`_best`), not only probes or exploration (`shape_lifetime`)
        if not candidates:
            self._chosen.append(chosen)
            return {}
        if self.draft_cost.fit() is None or self.engine_wide.is_empty:
            ks = {c.req_id: self._explore(c.cap, num_generating) for c in candidates}
        else:
            priced_by = self._pricing_class(num_generating)
            ks = None if priced_by is None else self._best(candidates, num_generating, candidate_offset, other_draft_rows, last_rows)  # fmt: skip
            if ks is None or (priced_by < batch_class(num_generating) and not any(ks.values())):
                # a batch size not priced yet, or priced only by a smaller batch's line, whose "do not draft"
                # would never be corrected (`pricing_line`): one request explores
                ks = dict.fromkeys((c.req_id for c in candidates), 0)
                ks[candidates[0].req_id] = self._explore(candidates[0].cap, num_generating)
            else:
                if closed and num_generating > 1 and any(ks.values()) and self.closed_min_gain >= 0:
                    ks = self._closed_plan(candidates, ks, num_generating, candidate_offset)
                chosen = any(ks.values())
                if not chosen and num_generating > 1:
                    ks = self._retest(candidates, num_generating, candidate_offset, other_draft_rows, last_rows)

                def could_pay(req_id: str) -> bool:  # would it draft if its draft accepted everything?
                    best = self._best(candidates, num_generating, candidate_offset, other_draft_rows, last_rows, certain=req_id)
                    return best[req_id] > 0

                self._probe(candidates, ks, num_generating, candidate_offset, could_pay)
        self._chosen.append(chosen)
        if chosen:  # a re-test is over once the batch chooses to draft
            self._unchosen, self._retest_wait, self._retest_left = 0, self.retest_after, 0
        for c in candidates:
            state = self._state(c.req_id)
            state.steps_without = 0 if ks[c.req_id] else state.steps_without + 1
            if state.steps_without and state.steps_without % _FADE_EVERY == 0:  # batched: cheaper
                state.counts.fade(self.pause_decay**_FADE_EVERY)
        self.num_decisions += len(candidates)
        self.num_drafting += sum(1 for k in ks.values() if k)
        return ks

    def _explore(self, cap: int, num_generating: int) -> int:
        """Candidates for a step that explores: the whole block, half of it, one, and none twice (the
        first step without candidates changes shape, the second prices not drafting); once a plain step
        of this batch is measured, the blocks alone. The draft's line needs 8 steps after the first of
        each shape (7 at c=8 on HumanEval), and with none twice in every five, exploring took 26 steps
        of a 50-step first wave, 40% of them drafting nothing where drafting brought 3.5 tokens a request."""
        if num_generating in self._plain_seconds:
            return (cap, (cap + 1) // 2, 1)[self._num_steps % 3]
        return (cap, (cap + 1) // 2, 1, 0, 0)[self._num_steps % 5]

    def estimate(self, req_id: str, cap: int) -> list[float]:
        """q(0..cap-1) for one request: its own counts, the engine-wide figure as the prior."""
        state = self._state(req_id)
        key = (cap, state.counts.version, self.engine_wide.version)
        if state.estimate_key != key:  # most steps: nothing new was verified for this request
            if self._prior_key != (cap, self.engine_wide.version):
                self._prior_key, self._prior = (cap, self.engine_wide.version), self.engine_wide.estimate(cap)
                self._weight = self.prior_strength()
            state.estimate, state.estimate_key = state.counts.estimate(cap, self._prior, self._weight), key
        return state.estimate

    def prior_strength(self) -> float:
        """How many pseudo-verifications the engine-wide figure counts for in a request's estimate.

        From how much the running requests' own first-position acceptance differs (a beta prior by the
        method of moments, their binomial noise taken out): requests that all accept alike get a strong
        prior (one bad streak does not stop a request), requests that differ a lot (a draft that suits
        some prompts and not others) a weak one (each follows its own evidence). `prior_weight` until
        `min_requests` requests have `min_evidence` verifications of their own: the running requests, or
        where too few of them have, the `recent_requests` last finished ones too (in a batch where only
        some requests draft, the paused ones gather no evidence, and the schedule forgot, request after
        request, that they differ)."""
        running = [state.counts.first_position for state in self._requests.values()]
        evidence = [(a, d) for a, d in running if d >= self.min_evidence]
        if len(evidence) < self.min_requests:
            evidence += self._finished  # each with min_evidence (forget)
        rates = [a / d for a, d in evidence]
        noise = [d for _, d in evidence]
        if len(rates) < self.min_requests:
            return self.prior_weight
        mean = sum(rates) / len(rates)
        if mean * (1 - mean) < 1e-3:  # all accept nothing (or everything): alike
            return 4 * self.prior_weight
        spread = sum((r - mean) ** 2 for r in rates) / len(rates)
        spread -= sum(mean * (1 - mean) / n for n in noise) / len(noise)  # what binomial noise alone gives
        spread = max(spread, 1e-4)
        return min(max(mean * (1 - mean) / spread - 1, self.min_prior_strength), 4 * self.prior_weight)

    def _best(self, candidates: Sequence[Candidate], num_generating: int, offset: int,
              other_draft_rows: tuple[int, int, int], last_rows: int | None, certain: str | None = None,
              min_gain: float | None = None, every: Sequence[float] | None = None) -> dict[str, int]:  # fmt: skip
        """The plan of the highest expected tokens per second (see the module's docstring); `certain`: a
        request whose candidates are taken as all accepted (q = 1 at every position: `_probe` asks);
        `min_gain`: instead of `self.min_gain` (negative: a plan that may be that much slower); `every`: q
        of every request instead of its own estimate (`_retest`)."""
        ks = {c.req_id: 0 for c in candidates}
        estimates = [([1.0] * c.cap if c.req_id == certain else list(every[: c.cap]) if every is not None
                      else self.estimate(c.req_id, c.cap), c) for c in candidates]  # fmt: skip
        top = max(q[0] if q else 0.0 for q, _ in estimates)
        steady = last_rows if last_rows is not None else 0  # below this many rows, a slot may save the reshape
        if top <= 0 and num_generating >= steady:
            return ks  # nothing is expected to be accepted (a draft that accepts nothing): no costs to weigh
        t_fixed, t_row, t_reshape = self.pricing_line(num_generating).fit()
        t_reshape /= self.shape_lifetime(num_generating)  # paid once, spread over the steps the new shape lasts
        d_fixed, d_context, d_block, d_candidate = self.draft_cost.fit()
        measured = self._measured_verify_seconds(num_generating)

        def verify_seconds(rows: int) -> float:  # verify_step_seconds, with the fit and the means read once
            return measured.get(rows, t_fixed + t_row * rows)

        # A slot costs at least this much (the line's slope, or less where two measured row counts next
        # to each other differ by less); once q / cheapest falls to the best rate, no later slot (q only
        # falls) can raise the rate again, so the scan stops, unless a longer block would still reach
        # the previous step's rows (and save the reshape).
        row_steps = [measured[rows + 1] - mean for rows, mean in measured.items() if rows + 1 in measured]
        cheapest = max(0.0, min([t_row, *row_steps])) + d_block + d_candidate

        def reshape(rows: int) -> float:
            return t_reshape if last_rows is not None and rows != last_rows else 0.0

        context_rows, block_rows, draft_candidates = other_draft_rows

        def draft_seconds() -> float:
            return d_fixed + d_context * context_rows + d_block * block_rows + d_candidate * draft_candidates

        runs_anyway = draft_seconds() if context_rows or block_rows else 0.0
        # Drafting must promise `min_gain` more tokens per second than not drafting: the fits and the
        # estimates are noisy, and a wrong "draft" costs more than a wrong "wait" (probes correct that).
        # Stopping is not charged the reshape: it is paid once, and every later step without candidates
        # is cheaper (charged, a batch that drafted kept drafting where it did not pay: c=8, 0.89x).
        gain = self.min_gain if min_gain is None else min_gain
        best_rate = num_generating / (self.plain_step_seconds(num_generating) + runs_anyway) * (1 + gain)
        if cheapest > 0 and top / cheapest <= best_rate and num_generating >= steady:
            return ks  # not even the likeliest candidate pays (most steps of a paused batch): no sort
        catch_up = {c.req_id: c.catch_up_rows(q) for q, c in estimates}
        slots = sorted(((q, c) for qs, c in estimates for q in qs), key=lambda slot: -slot[0])
        # each request's q is non-increasing, so a prefix of slots is a prefix of each block
        best_len, tokens, rows, drafting = 0, float(num_generating), num_generating, set()
        for length, (q, c) in enumerate(slots, start=1):
            if (q <= 0 or (cheapest > 0 and q / cheapest <= best_rate)) and rows >= steady:
                break
            tokens += q
            rows += 1
            block_rows += 1
            draft_candidates += 1
            if c.req_id not in drafting:  # its first candidate: its block's other rows, and the
                drafting.add(c.req_id)  # committed rows it has not read yet (caught up now, spread over
                block_rows += offset  # the steps the catch-up serves)
                context_rows += catch_up[c.req_id]
            seconds = verify_seconds(rows) + reshape(rows) + draft_seconds()
            if tokens / seconds > best_rate:
                best_rate, best_len = tokens / seconds, length
        for _, c in slots[:best_len]:
            ks[c.req_id] += 1
        return ks

    def _retest(self, candidates: Sequence[Candidate], num_generating: int, offset: int,
                other_draft_rows: tuple[int, int, int], last_rows: int | None) -> dict[str, int]:
        """The plan of a batch that has not chosen to draft for a while: drafting nothing, or, once a
        re-test falls due, its best drafting plan for `retest_steps` steps, if that plan is expected to run
        within `retest_margin` of not drafting.

        A batch that stops drafting measures nothing that could start it again: its acceptance estimates
        and the prices of its drafting steps stay what they were when it stopped, and a probe (one request's
        candidates) is priced out where a request's first candidate moves the whole batch off the one-row
        kernel (at c=8 on a Zen 4 EPYC: 8 rows 15-17 ms a step, 24-32 rows 33-35 ms). Measured there: a
        batch of HumanEval prompts kept estimates of 0.74 0.44 0.29 and 39.5 ms for 24 rows, taken in a slow
        stretch, while drafting accepted 0.81 0.63 0.50 and 24 rows took 35 ms; it drafted nothing for whole
        waves (0.93-0.97x the target alone) where 3 candidates a request ran 1.08-1.17x. A re-test drafts the
        batch's whole plan, so every request's candidates and the step's rows are measured together; the
        row-count prices it measures again have aged meanwhile (`mean_lifetime`) and follow it quickly.

        The plan is made with every request at the upper end of what the engine-wide counts allow
        (`AcceptanceCounts.upper`): the estimate that stopped the batch is the one in doubt (a c=2 warm-up
        of two prompts left 0.51 0.31 0.19, and the c=8 waves after it never drafted again). A plan expected
        to lose more than the margin even so is not re-tested (a draft known to accept nothing, a batch
        whose rows cost as much as its tokens), and each re-test that does not bring drafting back doubles
        the wait."""
        no = dict.fromkeys((c.req_id for c in candidates), 0)
        if self._retest_left == 0:
            self._unchosen += 1
            if self._unchosen < self._retest_wait:
                return no
            self._unchosen, self._retest_left = 0, self.retest_steps
            self._retest_wait = min(2 * self._retest_wait, self.max_retest_after)  # reset once drafting is chosen
        self._retest_left -= 1
        upper = self.engine_wide.upper(max(c.cap for c in candidates))
        return self._best(candidates, num_generating, offset, other_draft_rows, last_rows, min_gain=-self.retest_margin, every=upper)

    def _closed_plan(self, candidates: Sequence[Candidate], ks: dict[str, int], num_generating: int, offset: int) -> dict[str, int]:
        """The plan of a closed batch: the requests `_best` drafts for all draft the same number of
        candidates (their caps allowing), the number that finishes every running request soonest
        (`_closed_finish`), if that is `closed_min_gain` sooner than drafting nothing; else none draft.

        `_best` gives the candidates to the requests that accept most, which end first anyway; in a closed
        batch the slowest request sets the end. Measured at c=8 on HumanEval (Zen 4 EPYC, 2 cores): with
        `_best`'s own plans (18-56 candidates a step, drafting in 93% of request steps) a wave took 502 steps
        of 8 waves where 3 candidates for every request took 438, and ran 1.02-1.04x the target alone
        against 1.14-1.17x."""
        finish = self._closed_finish(candidates, num_generating, offset)
        if finish is None:
            return ks  # nothing tells how long the batch lasts: the step's gain decides alone
        drafting = [c for c in candidates if ks[c.req_id]]
        best = dict.fromkeys(ks, 0)
        best_seconds = finish(best) / (1 + self.closed_min_gain)
        for k in range(1, max(c.cap for c in drafting) + 1):
            plan = dict.fromkeys(ks, 0)
            plan.update((c.req_id, min(k, c.cap)) for c in drafting)
            seconds = finish(plan)
            if seconds < best_seconds:
                best, best_seconds = plan, seconds
        return best

    def _closed_finish(self, candidates: Sequence[Candidate], num_generating: int,
                       offset: int) -> Callable[[dict[str, int]], float] | None:  # fmt: skip
        """How long the running requests take to finish, all of them, drafting a plan from now on: a
        function of the plan (candidates per request); None where no request's length is known.

        `_best` maximizes the tokens per second of one step, which is what counts while requests wait
        for a place: one that ends early hands its place to the next. In a closed batch nobody takes
        the place, and the batch lasts as long as its slowest request: a request that drafts well ends
        early and its tokens save the later steps one row each, not a share of the step. At c=8 on a
        2-core CPU, where drafting barely beats the target alone step for step, HumanEval waves of 8
        ran 0.93x the target alone: the requests that drafted ended early, and the rest ran on in
        steps of fewer requests (2.5-4 s of a 25 s round).

        Requests end after remaining / tokens-per-step steps (requests not among `candidates`, and
        candidates of unknown length, after the longest known), and each stretch between two ends costs a
        step of the requests still running (the whole batch's rows at their measured price, as `_best`
        prices them; fewer requests at the plain step's price and the line's slope per candidate row; the
        draft's step while one of them drafts). With the line's slope for the whole batch too, a line of
        fixed 0 and 1.28 ms a row (its steps mostly of a few candidates, each paying the jump off the
        one-row kernel) priced 8 requests and 16 candidates at 38.5 ms where they measured 30.5, and
        blocked drafting that paid.

        A drafting request's tokens a step vary (its accepted length is random), so some of the batch end
        later than their mean: each is charged the spread of its steps to finish times what the latest of
        the batch's requests expects (`_latest_of`). On chat prompts at c=8 on a 4th-generation Xeon,
        where a full drafting step brought 6% more tokens a second than the target alone, the means alone
        promised a sooner end; the tail of requests that drew short blocks took 16% of every wave
        (0.94x the target alone in that run)."""
        known = [c.num_remaining_tokens for c in candidates if c.num_remaining_tokens > 0]
        if not known:
            return None
        longest = max(known)
        line = self.pricing_line(num_generating)  # a smaller batch's class may have no line yet: this one prices it
        _, t_row, _ = line.fit()
        d_fixed, d_context, d_block, d_candidate = self.draft_cost.fit()
        latest = _latest_of(num_generating)
        others = [(longest, 0, 0.0)] * max(num_generating - len(candidates), 0)
        measured = self._measured_verify_seconds(num_generating)
        plain_seconds = {n: self.plain_step_seconds(n, line) for n in range(1, num_generating + 1)}

        def target_seconds(num_requests: int, num_candidates: int) -> float:
            rows = num_requests + num_candidates
            if num_candidates and num_requests == num_generating and rows in measured:
                return measured[rows]
            return plain_seconds[num_requests] + t_row * num_candidates

        def finish(ks: dict[str, int]) -> float:
            # per request: (steps to finish, candidates a step, its draft seconds a step)
            requests, catch_up = [], 0.0
            for c in candidates:
                remaining, k = c.num_remaining_tokens or longest, ks[c.req_id]
                if k:
                    q = self.estimate(c.req_id, c.cap)[:k]
                    tokens = 1.0 + sum(q)  # also the committed rows it reads next
                    steps = remaining / tokens + latest * _steps_spread(q, remaining)
                    requests.append((steps, k, d_context * tokens + d_block * (k + offset) + d_candidate * k))
                    catch_up += d_context * c.num_pending_rows
                else:
                    requests.append((remaining, 0, 0.0))
            return catch_up + _seconds_to_finish(requests + others, target_seconds, d_fixed)

        return finish

    def _probe(self, candidates: Sequence[Candidate], ks: dict[str, int], num_generating: int, offset: int,
               could_pay: Callable[[str], bool]) -> None:  # fmt: skip
        """Paused requests try again now and then; a probe that did not bring drafting back waits
        twice as long for the next one, and never less than its expected loss allows (`_probe_wait`).

        A probe is worth its cost only if what it may find could start the request drafting: where even
        a draft that accepted every candidate would not pay for its rows (`could_pay`: the plan with the
        request's estimate at 1 everywhere drafts nothing for it), the probe is skipped, and its wait
        kept, to be asked again at the next one (costs change with the batch's size). On a 2-core AVX2
        CPU at c=8 a plain step of 8 rows took 29.5 ms (3.7 ms a token) and one of 32 rows 132 ms (4.1 ms
        more a row): no acceptance pays for a candidate there, and each probe (its rows, and a draft step
        that catches up the request's whole context) was pure loss.

        A request with no verification of its own is probed after `probe_after` steps whatever the loss
        when requests differ (`differ_strength`), with its whole block: its estimate is then the
        engine-wide figure, which says little about it, and a block pays only where most of its
        positions are accepted, which only a whole block shows. Measured on a constructed batch where
        half the requests accept every candidate and half none: without it the engine-wide 0.12 kept
        every new request paused, and the good half never drafted (0% of request steps); with first
        probes of 2 candidates, the positions after them kept the engine-wide ratio and the block did
        not pay."""
        differ = None  # computed once, if a request without evidence needs it
        for c in candidates:
            state = self._state(c.req_id)
            if ks[c.req_id]:
                state.probe_after, state.probing = 0, False
                continue
            if state.probing:  # the last probe did not pay
                state.probing = False
                state.probe_after = min(2 * state.probe_after, self.max_probe_after)
            state.probe_after = state.probe_after or self.probe_after
            # Every wait is a power of two of at least probe_after (a power of two too): no probe can fall
            # on this step, so the wait is not worked out (most steps of a paused request).
            if state.steps_without + 1 < state.probe_after or self._num_steps % state.probe_after:
                continue
            if state.counts.is_empty and differ is None:
                differ = self.prior_strength() <= self.differ_strength
            first = state.counts.is_empty and differ
            wait = state.probe_after if first else max(state.probe_after, self._probe_wait(c, num_generating, offset))
            if state.steps_without + 1 >= wait and self._num_steps % wait == 0 and could_pay(c.req_id):
                ks[c.req_id] = c.cap if first else min(c.cap, self.probe_candidates)
                state.probing = True

    def _probe_wait(self, c: Candidate, num_generating: int, offset: int) -> int:
        """The fewest steps between two probes of a paused request that keep their expected loss within
        `probe_budget` of its share of the time, a power of two (so probes of several requests share
        steps), at most `4 * max_probe_after`.

        A probe costs its verified rows, and the draft step it may run alone (fixed cost, the paused
        rows it catches up, its block); it brings the tokens the request's estimate expects. Where
        rows are cheap against a step (a small batch) that loss is small or negative and the wait
        stays `probe_after`; where the target is compute-bound (a large batch on few cores, each row
        costing a share of the step), probes that accept little cost more than they find and wait
        longer (measured: chat prompts at c=16 lost 15% while drafting 4% of request steps, mostly
        probes of two candidates)."""
        _, t_row, t_reshape = self.pricing_line(num_generating).fit()
        d_fixed, d_context, d_block, d_candidate = self.draft_cost.fit()
        k = min(c.cap, self.probe_candidates)
        per_request = self.plain_step_seconds(num_generating) / max(num_generating, 1)  # seconds a request-step
        q = self.estimate(c.req_id, c.cap)
        cost = t_row * k + t_reshape + d_fixed + d_context * c.catch_up_rows(q) + d_block * (k + offset) + d_candidate * k
        loss = cost - sum(q[:k]) * per_request
        steps = loss / (self.probe_budget * per_request) if per_request > 0 else 0.0
        return 1 << min(max(int(np.ceil(np.log2(steps))), 0), int(np.log2(4 * self.max_probe_after))) if steps > 1 else 1

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestState(AcceptanceCounts(self.request_decay))
        return state

    @property
    def drafting_share(self) -> float | None:
        """Of the (request, step) decisions made, the share that drafted."""
        return self.num_drafting / self.num_decisions if self.num_decisions else None
