"""The "adaptive" schedule's arithmetic (core/adaptive.py) on synthetic costs and acceptance with known answers."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from dflash.core.adaptive import AcceptanceCounts, AdaptiveSchedule, Candidate, LinearCost


def fitted(target: tuple[float, float], draft: tuple[float, float], *, per_candidate: float = 0.0,
           per_context: float | None = None, min_steps: int = 4, **kwargs) -> AdaptiveSchedule:  # fmt: skip
    """A schedule whose costs are fitted on exact observations: target seconds = fixed + per_row * rows,
    draft seconds = fixed + per_context * context rows + per_row * block rows + per_candidate * candidate
    rows (per_context defaults to per_row)."""
    schedule = AdaptiveSchedule(min_steps=min_steps, **kwargs)
    per_context = draft[1] if per_context is None else per_context
    for rows, candidates, context in ((1, 0, 1), (4, 3, 2), (9, 2, 9), (16, 8, 4), (25, 4, 25), (36, 15, 6)) * 2:
        for num_requests in (1, 2, 4, 8, 16):  # every batch-size class the tests plan for, the same line
            schedule.observe_target(rows, target[0] + target[1] * rows, num_requests=num_requests)
        seconds = draft[0] + per_context * context + draft[1] * rows + per_candidate * candidates
        schedule.observe_draft(context, rows, candidates, seconds)  # (the first of each shape is not used)
    return schedule


def accept(schedule: AdaptiveSchedule, req_id: str, acceptance: list[float], steps: int = 200) -> None:
    """Verifications of `req_id` whose position i is accepted in the share acceptance[i] of them, spread
    evenly over the steps (one equidistributed u per step: positions with u < q are accepted)."""
    for step in range(steps):
        u = (step * 0.6180339887) % 1.0
        schedule.observe_verification(req_id, len(acceptance), sum(1 for q in acceptance if u < q))


def rate(ks: dict[str, int], q: dict[str, list[float]], target, draft, per_candidate: float = 0.0, offset: int = 0) -> float:
    """Expected tokens per second of a step drafting ks (the model the schedule optimizes)."""
    n = len(ks)
    tokens = n + sum(sum(q[r][:k]) for r, k in ks.items())
    seconds = target[0] + target[1] * (n + sum(ks.values()))
    draft_rows = sum(k + offset for k in ks.values() if k)
    if draft_rows:
        seconds += draft[0] + draft[1] * draft_rows + per_candidate * sum(ks.values())
    return tokens / seconds


def test_linear_cost_recovers_fixed_and_per_row_and_keeps_a_fit_when_rows_stop_varying():
    cost = LinearCost(window=8, min_samples=4)
    for rows in (2, 4, 8, 16):
        cost.observe(rows, 0.003 + 0.0005 * rows)
    assert cost.fit() == pytest.approx((0.003, 0.0005))
    for _ in range(8):
        cost.observe(5, 1.0)  # the window now holds rows that never vary: no new fit
    assert cost.fit() == pytest.approx((0.003, 0.0005))
    assert LinearCost(min_samples=4).fit() is None


def test_a_full_window_refits_after_a_quarter_of_it_is_new_and_at_once_when_a_held_price_changes():
    """A refit costs several plans' time in the engine: a window of 128 refits after 32 new steps (a
    smaller one after `refit_every`, 8), and at once when `know` changes a held coefficient."""
    cost = LinearCost(num_counts=2, min_samples=4, optional=(1,))
    for i in range(128):
        rows = 2 + i % 16
        cost.observe((rows, 0), 0.010 + 0.001 * rows)
    assert cost.fit() == pytest.approx((0.010, 0.001, 0.0))
    for i in range(31):  # faster steps: not yet a quarter of the window
        cost.observe((2 + i % 16, 0), 0.005 + 0.001 * (2 + i % 16))
    assert cost.fit() == pytest.approx((0.010, 0.001, 0.0))
    cost.observe((2, 0), 0.007)
    assert cost.fit()[0] < 0.0095  # the 32nd: refitted
    cost.know(1, 0.005)  # the flag never varied: the reshape price measured elsewhere, at once
    assert cost.fit()[2] == pytest.approx(0.005)


def test_linear_cost_with_two_counts_and_no_negative_coefficient():
    cost = LinearCost(num_counts=2, min_samples=4)
    for rows, candidates in ((2, 1), (8, 1), (8, 7), (20, 3), (30, 15)):
        cost.observe((rows, candidates), 0.002 + 0.0001 * rows + 0.0004 * candidates)
    assert cost.fit() == pytest.approx((0.002, 0.0001, 0.0004))
    assert cost.seconds(10, 5) == pytest.approx(0.002 + 0.001 + 0.002)
    noisy = LinearCost(num_counts=2, min_samples=4)
    for rows, candidates in ((2, 1), (8, 1), (8, 7), (20, 3), (30, 15)):
        noisy.observe((rows, candidates), 0.002 + 0.0004 * candidates - 0.00001 * rows)  # rows "save" time
    fixed, per_row, per_candidate = noisy.fit()
    assert per_row == 0.0 and per_candidate > 0 and fixed > 0


def test_an_optional_flag_is_fitted_while_it_varies_and_left_out_while_it_does_not():
    """The target's cost over (rows, reshaped): the reshape's price is recovered when the window holds
    both kinds of step and kept when it then holds only steps that kept their shape; a window of steps
    that all reshaped (exploration, before any fit) still fits, the flag at 0."""
    cost = LinearCost(num_counts=2, window=8, min_samples=4, min_spread=(0.5, 0.2), optional=(1,))
    for rows, reshaped in ((1, 0), (4, 1), (9, 0), (16, 1), (25, 0), (36, 1)):
        cost.observe((rows, reshaped), 0.010 + 0.002 * rows + 0.005 * reshaped)
    assert cost.fit() == pytest.approx((0.010, 0.002, 0.005))
    for rows in (2, 4, 9, 16, 25, 36, 2, 4):  # the window now holds steps that kept their shape only
        cost.observe((rows, 0), 0.011 + 0.002 * rows)
    assert cost.fit() == pytest.approx((0.011, 0.002, 0.005), abs=2e-4)  # the reshape's price is kept
    always = LinearCost(num_counts=2, min_samples=4, min_spread=(0.5, 0.2), optional=(1,))
    for rows in (1, 4, 9, 16):
        always.observe((rows, 1), 0.015 + 0.002 * rows)
    assert always.fit() == pytest.approx((0.015, 0.002, 0.0))
    required = LinearCost(num_counts=2, min_samples=4)  # a count that must vary: no fit without it
    for rows in (1, 4, 9, 16):
        required.observe((rows, 1), 0.015 + 0.002 * rows)
    assert required.fit() is None


def shapes_last(schedule: AdaptiveSchedule, steps: int, reshape: float, rows: int = 12, num_requests: int = 1) -> None:
    """The latest `shape_window` target steps that verified candidates change shape every `steps` steps
    (steps of `rows` rows on the line 10 ms + 2 ms a row, plus `reshape` where they change shape: the
    fits stay as they are)."""
    # steps the schedule chose to draft (probes and exploration do not count); a step is observed after the
    # next step's plan, so the two latest plans are the schedule's choices
    schedule._chosen.extend([True, True])
    for i in range(schedule.shape_window):
        changed = i % steps == 0
        schedule.observe_target(rows, 0.010 + 0.002 * rows + reshape * changed, reshaped=changed, num_requests=num_requests)


def test_a_step_keeps_the_previous_steps_shape_unless_another_pays_for_the_reshape():
    """OpenVINO prepares the target's graph again when its rows change (~5 ms of a ~20 ms step at c=1
    on an AVX2 CPU). Here 3 candidates (145 tokens/s) barely beat 4 (144.5) and 2 (138): a schedule
    that ignores the reshape flips between them with every change in its estimates and pays it most
    steps. Where shapes change every step, the reshape is charged whole and the schedule keeps the
    previous step's 2 or 4 candidates, and still starts drafting after a step without candidates (4
    candidates with the reshape: 117.5 tokens/s against 87.5 without drafting, its 5% margin included)."""
    schedule = fitted((0.010, 0.002), (0.001, 0.0002), prior_weight=0.0)  # steps that kept their shape
    for rows in (2, 4, 9, 16):
        schedule.observe_target(rows, 0.010 + 0.002 * rows + 0.005, reshaped=True)
    assert schedule.reshape_seconds() == pytest.approx(0.005)
    shapes_last(schedule, 1, 0.005)
    assert schedule.shape_lifetime() == 1.0
    accept(schedule, "a", [0.8, 0.6, 0.45, 0.3])
    for last_rows, expected in ((None, 3), (5, 4), (3, 2), (1, 4)):
        ks = schedule.plan([Candidate("a", 4)], num_generating=1, last_rows=last_rows)
        assert ks["a"] == expected, last_rows
    # Stopping is not charged the reshape (paid once, and every later step without candidates is cheaper):
    # a request whose 4 candidates bring 0.65 tokens stops after a step of 5 rows (1.65 tokens in 21.8 ms,
    # 76 tokens/s, against 87.5 without drafting; charged the reshape, not drafting read 62 and it drafted on).
    accept(schedule, "b", [0.3, 0.2, 0.1, 0.05])
    assert schedule.plan([Candidate("b", 4)], num_generating=1, last_rows=5)["b"] == 0


def test_a_reshape_is_spread_over_the_steps_a_shape_lasts():
    """A CPU whose kernels step up past 3 rows: the line says 10 ms + 2 ms a row, but 4 to 6 rows are
    measured at 28-32 ms; a reshape costs 10 ms. Sitting at 6 rows (5 candidates, 3.2 tokens in 35 ms
    with the draft: 92 tokens/s), 2 candidates (3 rows, 2.3 tokens in 18 ms: 130 tokens/s) pay most,
    but charged the whole reshape in the one step that changes shape they read 83 tokens/s: a schedule
    charged so stayed at its shape for good (measured at c=1 on an AVX2 CPU: 5 candidates at 36 ms a
    step, 150 steps in a row, where 3 took 24 ms). Spread over the 32 steps shapes have lately lasted,
    the change pays; where shapes change every step, the whole price stands and the schedule stays."""
    schedule = fitted((0.010, 0.002), (0.001, 0.0002), prior_weight=0.0)
    for rows in (1, 2, 3, 7, 8, 9, 10, 12) * 4:  # the line, over enough steps that the step-up is an outlier
        schedule.observe_target(rows, 0.010 + 0.002 * rows)
    for rows in (2, 4, 9, 16) * 2:
        schedule.observe_target(rows, 0.010 + 0.002 * rows + 0.010, reshaped=True)
    for rows, seconds in ((4, 0.030), (5, 0.031), (6, 0.032)):
        for _ in range(4):  # the first step of a shape is not measured
            schedule.observe_target(rows, seconds)
    assert schedule.reshape_seconds() == pytest.approx(0.010)
    accept(schedule, "a", [0.8, 0.6, 0.45, 0.3, 0.2])
    shapes_last(schedule, 1, 0.010)
    assert schedule.plan([Candidate("a", 5)], num_generating=1, last_rows=6)["a"] == 5
    shapes_last(schedule, schedule.shape_window, 0.010)
    assert schedule.shape_lifetime() == schedule.shape_window
    for _ in range(schedule.shape_window):  # steps that drafted nothing do not count, even changing shape
        schedule.observe_target(1, 0.022, verified_candidates=False, reshaped=True)
    shapes_last(schedule, 1, 0.010, rows=8 + 12, num_requests=8)  # nor do the drafting steps of another batch-size class
    assert schedule.shape_lifetime() == schedule.shape_window and schedule.shape_lifetime(8) == 1.0
    assert schedule.plan([Candidate("a", 5)], num_generating=1, last_rows=6)["a"] == 2


def test_a_measured_row_count_is_priced_at_its_own_mean_not_the_line():
    """The line (10 ms + 2 ms a row) prices 4 candidates (5 rows) at 20 ms, and they pay more than 3;
    where steps of 5 rows are measured at 24 ms (a CPU whose kernels step up there), 3 candidates win.
    Until 3 such steps are measured, the line stands."""
    schedule = fitted((0.010, 0.002), (0.001, 0.0002), prior_weight=0.0)
    accept(schedule, "a", [0.8, 0.6, 0.45, 0.4])
    assert schedule.plan([Candidate("a", 4)], num_generating=1)["a"] == 4
    for _ in range(3):  # the first step of a shape is not measured: two steps, the line still
        schedule.observe_target(5, 0.024)
    assert schedule.verify_step_seconds(5) == pytest.approx(0.020)
    assert schedule.plan([Candidate("a", 4)], num_generating=1)["a"] == 4
    schedule.observe_target(5, 0.024)
    assert schedule.verify_step_seconds(5) == pytest.approx(0.024)
    assert schedule.plan([Candidate("a", 4)], num_generating=1)["a"] == 3


def test_a_stale_row_count_price_still_prices_but_its_next_steps_soon_outweigh_it():
    """Ten steps of 5 rows at 20 ms (a fast minute), then none for `mean_lifetime` steps: the row count is
    still priced at 20 ms (the line is no better a guess: it can be far off). Within its lifetime a slow
    step barely moves the median of its latest steps; once stale, it keeps only its 2 latest steps, so a
    slower machine's next step outweighs them."""
    schedule = fitted((0.010, 0.002), (0.001, 0.0002), prior_weight=0.0)
    for _ in range(11):  # the first step of a shape is not measured
        schedule.observe_target(5, 0.020)
    for i in range(schedule.mean_lifetime - 1):  # steps on the line, of row counts measured before
        schedule.observe_target((4, 9, 16)[i % 3], 0.010 + 0.002 * (4, 9, 16)[i % 3])
    assert schedule.verify_step_seconds(5) == pytest.approx(0.020)
    schedule.observe_target(5, 0.040)
    assert schedule.verify_step_seconds(5) == pytest.approx(0.020)  # one slow step among nine: the median holds
    for i in range(schedule.mean_lifetime + 1):
        schedule.observe_target((4, 9, 16)[i % 3], 0.010 + 0.002 * (4, 9, 16)[i % 3])
    assert schedule.verify_step_seconds(5) == pytest.approx(0.020)  # stale, and still its own price
    schedule.observe_target(5, 0.040)
    assert schedule.verify_step_seconds(5) == pytest.approx(0.040)  # stale: 20, 40, and the new 40
    assert schedule.state()["verify_seconds"]["1"]["5"] == [pytest.approx(0.040), 3]


def test_a_row_count_is_priced_at_the_median_of_its_latest_steps():
    """One step in ten of a row count runs far slower than the rest on a busy VM: the median of the
    latest nine steps prices it, not a mean that such a step pulls up."""
    schedule = fitted((0.010, 0.002), (0.001, 0.0002), prior_weight=0.0)
    for seconds in (0.020, 0.020, 0.021, 0.050, 0.019, 0.020, 0.022, 0.020, 0.021, 0.020):  # (the first: a new shape)
        schedule.observe_target(5, seconds)
    assert schedule.verify_step_seconds(5) == pytest.approx(0.020)
    for _ in range(9):  # the machine slows for good: nine new steps replace the window
        schedule.observe_target(5, 0.030)
    assert schedule.verify_step_seconds(5) == pytest.approx(0.030)


def one_class_line(num_requests: int, target: tuple[float, float], rows: Sequence[int],
                   num_candidates: int) -> tuple[AdaptiveSchedule, list[Candidate]]:  # fmt: skip
    """A schedule with one target line, the class of `num_requests` (fixed + per row, over `rows` twice),
    a cheap draft, and `num_candidates` requests of 4 candidates that accept 0.8, 0.6, 0.45, 0.3."""
    schedule = AdaptiveSchedule(min_steps=4, prior_weight=0.0)
    for step_rows, context in zip(tuple(rows) * 2, (1, 4, 2, 9, 3) * 2):
        schedule.observe_target(step_rows, target[0] + target[1] * step_rows, num_requests=num_requests)
        schedule.observe_draft(context, step_rows, step_rows - num_requests, 0.002 + 0.0001 * step_rows)
    requests = [Candidate(f"r{i}", 4) for i in range(num_candidates)]
    for c in requests:
        accept(schedule, c.req_id, [0.8, 0.6, 0.45, 0.3])
    return schedule, requests


def test_a_larger_batch_drafts_on_a_smaller_class_line_only_where_that_line_says_drafting_pays():
    """A smaller batch's line prices rows high. Where drafting pays even at that price (steps of one
    request: 10 ms + 1 ms a row), a batch of 8 without a line of its own drafts for all its requests at
    once; where it does not (5 ms a row: `test_each_batch_size_class_is_priced_on_its_own_steps`), one
    request explores, since a line that says "do not draft" would never be corrected."""
    schedule = fitted((0.010, 0.001), (0.001, 0.0001))
    schedule.target_costs = {1: schedule.target_costs[1]}  # only the class of one request has a line
    requests = [Candidate(f"r{i}", 4) for i in range(8)]
    for c in requests:
        accept(schedule, c.req_id, [0.8, 0.6, 0.45, 0.3])
    assert schedule.target_cost(8).fit() is None
    assert schedule.pricing_line(8) is schedule.target_cost(1)
    assert all(k >= 1 for k in schedule.plan(requests, num_generating=8).values())


def test_each_batch_size_class_is_priced_on_its_own_steps():
    """A line fitted on steps of one request (5 ms a row) says no candidate pays at c=8; a step of 8
    requests is priced on its own class's steps: until it has them one request explores (whole block,
    half, one, none twice; the others draft nothing), and with them (1 ms a row) all 8 requests draft."""
    schedule, requests = one_class_line(1, (0.010, 0.005), (2, 3, 4, 5, 6), num_candidates=8)
    assert schedule.target_cost(8).fit() is None
    plans = [schedule.plan(requests, num_generating=8) for _ in range(5)]
    assert sorted(sum(ks.values()) for ks in plans) == [0, 0, 1, 2, 4]
    assert all(sum(1 for k in ks.values() if k) <= 1 for ks in plans)
    for rows in (8, 16, 24, 32, 40) * 2:
        schedule.observe_target(rows, 0.030 + 0.001 * rows, num_requests=8)
    assert schedule.target_cost(8).fit() == pytest.approx((0.030, 0.001, 0.0))
    assert all(k >= 1 for k in schedule.plan(requests, num_generating=8).values())


def test_a_smaller_batch_is_priced_on_the_nearest_larger_class_until_it_has_its_own_line():
    """As a wave of 8 ends, its batch passes through 4-7, 2-3 and 1 requests: each class without a line
    of its own is priced on the nearest larger class's (rows there cost less, so it errs toward
    drafting, whose steps then fit the class's own line), and all its requests draft at once instead of
    one request exploring while the rest draft nothing. A line of its own then takes over."""
    schedule, requests = one_class_line(8, (0.030, 0.001), (8, 16, 24, 32, 40), num_candidates=3)
    for rows in (1, 2, 3, 4, 5) * 2:  # a line of single requests too: the larger batch's still prices 3
        schedule.observe_target(rows, 0.010 + 0.005 * rows, num_requests=1)
    assert schedule.target_cost(1).fit() is not None
    assert schedule.target_cost(3).fit() is None and schedule.target_cost(16).fit() is None
    assert schedule.pricing_line(3) is schedule.target_cost(8)
    assert all(k >= 1 for k in schedule.plan(requests, num_generating=3).values())
    for rows in (3, 6, 9, 12, 15) * 2:  # this class's own steps: a row costs 20 ms here
        schedule.observe_target(rows, 0.010 + 0.020 * rows, num_requests=3)
    assert schedule.pricing_line(3) is schedule.target_cost(3)
    assert schedule.pricing_line(3).fit() == pytest.approx((0.010, 0.020, 0.0))
    assert not any(schedule.plan(requests, num_generating=3).values())


def test_the_first_step_of_each_shape_is_not_measured():
    """OpenVINO's first inference of a new input shape prepares its kernels and runs several times
    slower; fitted, the warm-up's and exploration's first steps of each row count made the target's line
    steep. From the second step of a shape on, the line is the truth."""
    schedule = AdaptiveSchedule(min_steps=4)
    for rows in (2, 4, 8, 16):
        schedule.observe_target(rows, 5 * (0.010 + 0.002 * rows))
    for rows in (2, 4, 8, 16, 2, 4, 8, 16):
        schedule.observe_target(rows, 0.010 + 0.002 * rows)
    assert schedule.target_cost(1).fit() == pytest.approx((0.010, 0.002, 0.0))


def test_a_draft_step_is_a_first_step_only_where_its_padded_shape_is_new():
    """The draft's calls are padded to steady shapes (`DraftRunner.padded_rows`): a catch-up of another
    length in a shape already run is measured. Keyed by the rows before padding, every catch-up was a
    first step, none was fitted, and the line priced context rows at nothing."""
    schedule = AdaptiveSchedule(min_steps=4)
    schedule.observe_draft(3, 7, 7, 0.010, shape_rows=16)  # the first of shape 16: not measured
    schedule.observe_draft(2, 7, 7, 0.010, shape_rows=16)
    schedule.observe_draft(229, 7, 7, 0.050, shape_rows=240)  # the first of shape 240
    schedule.observe_draft(226, 7, 7, 0.049, shape_rows=240)
    schedule.observe_draft(1, 4, 4, 0.009)  # unpadded (a runner without padding): its rows are its shape
    assert [counts for counts, _ in schedule.draft_cost.observations] == [(2, 7, 7), (226, 7, 7)]


def test_catch_up_steps_do_not_turn_the_draft_into_a_fixed_cost():
    """Context rows (a paused request's catch-up) are cheap next to block rows; counted as one kind of
    row, steps with many of them pulled the per-row slope down (below zero on the tiny pair, where the
    fit then put the whole draft step in its fixed cost). Counted apart, each price is recovered."""
    truth = (0.001, 0.00002, 0.0002, 0.0005)  # fixed, per context row, per block row, per candidate row
    steps = [(2, 8, 7), (3, 4, 3), (1, 16, 15), (64, 3, 2), (2, 9, 8), (128, 3, 2), (4, 5, 4), (40, 17, 15)]
    cost = LinearCost(num_counts=3, min_samples=4)
    for counts in steps:
        cost.observe(counts, truth[0] + sum(p * c for p, c in zip(truth[1:], counts)))
    assert cost.fit() == pytest.approx(truth)


def test_catch_up_rows_are_charged_at_the_context_row_price():
    """A paused request with 64 committed rows to catch up drafts again when context rows are cheap,
    and waits when they cost as much as block rows."""
    target, draft = (0.010, 0.0002), (0.001, 0.0003)
    for per_context, drafts in ((0.00001, True), (0.0003, False)):
        schedule = fitted(target, draft, per_context=per_context, prior_weight=0.0)
        accept(schedule, "a", [0.8, 0.6, 0.4, 0.2])
        ks = schedule.plan([Candidate("a", 4, num_pending_rows=64)], num_generating=1)
        assert (ks["a"] > 0) == drafts, per_context


def test_a_new_request_pays_for_its_prompt_catch_up_over_the_steps_it_serves():
    """A request that has not drafted yet has its whole prompt pending (120 context rows here, priced
    like block rows: 36 ms against a 10 ms target step). Charged to one step, no step's gain pays it and
    the request never drafts (its pending rows only grow); spread over the ~32 steps of 128 tokens left it
    drafts at once, while with 2 tokens left (or nothing known) it still waits."""
    target, draft = (0.010, 0.0002), (0.001, 0.0003)
    for remaining, drafts in ((128, True), (2, False), (0, False)):
        schedule = fitted(target, draft, prior_weight=0.0)
        accept(schedule, "a", [0.8, 0.6, 0.4, 0.2])
        ks = schedule.plan([Candidate("a", 4, num_pending_rows=120, num_remaining_tokens=remaining)], num_generating=1)
        assert (ks["a"] > 0) == drafts, remaining


def test_not_drafting_is_priced_on_the_steps_that_verified_no_candidate():
    """Steps with candidates fit the line (here 10 ms + 2 ms a row); a step of one row without candidates
    is measured apart. Where it runs at the line's price (12 ms) drafting pays; where it runs a cheaper
    kernel (6 ms, as one row per request does on an AVX2 CPU in f32), the same candidates do not."""
    target, draft = (0.010, 0.002), (0.001, 0.0002)
    for plain, drafts in ((0.012, True), (0.006, False)):
        schedule = fitted(target, draft, prior_weight=0.0)
        for _ in range(3):
            schedule.observe_target(1, plain, verified_candidates=False)
        assert schedule.plain_step_seconds(1) == pytest.approx(plain)
        accept(schedule, "a", [0.8, 0.6, 0.4, 0.2])
        ks = schedule.plan([Candidate("a", 4)], num_generating=1)
        assert (ks["a"] > 0) == drafts, plain


def test_acceptance_counts_decay_extrapolate_and_never_increase_with_position():
    counts = AcceptanceCounts(decay=0.5)
    counts.observe(2, 2)
    counts.observe(2, 0)  # the newest verification weighs twice the one before
    # position 0: 0.5 accepted of 1.5; position 1: 0.5 of its 0.5 trials, shrunk towards 1/3 by 2 pseudo-trials
    assert counts.estimate(2) == pytest.approx([1 / 3, 1 / 3 * (0.5 + 2 / 3) / 2.5])
    q = counts.estimate(4)
    assert q[2] <= q[1] and q[3] <= q[2] and q[3] > 0  # unmeasured positions: extrapolated, non-increasing
    counts = AcceptanceCounts(decay=1.0)
    for accepted in (0, 3, 3, 3):
        counts.observe(3, accepted)
    assert counts.estimate(3, prior=[0.0, 0.0, 0.0], prior_weight=4.0) == pytest.approx([3 / 8] * 3)


def test_without_fitted_costs_it_explores_whole_half_single_and_empty_blocks():
    """Two empty blocks in a row: the first changes shape, only the second prices not drafting."""
    schedule = AdaptiveSchedule()
    sizes = [schedule.plan([Candidate("a", 15)], num_generating=1)["a"] for _ in range(10)]
    assert sorted(sizes[:5]) == [0, 0, 1, 8, 15] and sizes[5:] == sizes[:5]
    assert any(sizes[i] == sizes[i + 1] == 0 for i in range(9))


def test_once_not_drafting_is_priced_exploration_varies_the_block_only():
    """Exploring, a step without candidates serves only to price not drafting: once a plain step of
    the batch's rows is measured (here 8 requests, after its first, unmeasured, step), every exploring
    step drafts: whole block, half, one."""
    schedule = AdaptiveSchedule()
    for _ in range(2):  # the first step of a shape is not measured
        schedule.observe_target(8, 0.030, verified_candidates=False, num_requests=8)
    requests = [Candidate(f"r{i}", 7) for i in range(8)]
    sizes = [sum(schedule.plan(requests, num_generating=8).values()) for _ in range(6)]
    assert sorted(sizes[:3]) == [8, 32, 56] and sizes[3:] == sizes[:3]
    assert sorted(sum(schedule.plan(requests[:4], num_generating=4).values()) for _ in range(5)) == [0, 0, 4, 16, 28]


def test_a_closed_batch_drafts_only_where_it_finishes_sooner():
    """Target 10 ms + 1 ms a row, a cheap draft; request "good" accepts every candidate, "bad" none.
    While requests wait for a place, drafting 3 for "good" pays (5 tokens in 16 ms against 2 in 12):
    it ends early and hands its place on. In a closed batch where both have 100 tokens to go, "bad"
    keeps the batch running 100 steps whatever "good" does: drafting would finish it in 1.23 s
    (25 steps of 16 ms, then 75 of one request) against 1.2 s without. Where "bad" has only 10 to go,
    "good" is the one the batch waits for, and drafting finishes it in 0.39 s against 1.11 s; where
    "bad" has 95 to go, drafting would finish in 1.175 s against 1.195 s, less than `min_gain` sooner."""
    schedule = fitted((0.010, 0.001), (0.0005, 0.0001), prior_weight=0.0)
    accept(schedule, "good", [1.0, 1.0, 1.0])
    accept(schedule, "bad", [0.0, 0.0, 0.0])

    def plan(remaining_bad: int, closed: bool) -> dict[str, int]:
        requests = [Candidate("good", 3, num_remaining_tokens=100), Candidate("bad", 3, num_remaining_tokens=remaining_bad)]
        return schedule.plan(requests, num_generating=2, closed=closed)

    assert plan(100, closed=False) == {"good": 3, "bad": 0}
    assert plan(100, closed=True) == {"good": 0, "bad": 0}
    assert plan(10, closed=True) == {"good": 3, "bad": 0}
    assert plan(95, closed=True) == {"good": 0, "bad": 0}


def test_a_closed_batch_charges_the_spread_of_each_request_s_end(monkeypatch):
    """Eight requests with 128 tokens to go; target 10 ms + 0.1 ms a row, a draft of 10 ms a step. A
    request that accepts all three candidates or none, half the time each (1.38 tokens a candidate
    block, as estimated), ends after a number of steps that varies a lot (sd about 4.6 of 54 steps),
    and the batch waits for the latest: drafting does not finish it `min_gain` sooner, though the mean
    says it would (and the step's rate says draft while requests wait). Requests accepting about as
    much with less spread (0.9, 0.4, 0.2: sd about 2.8) still draft."""
    import dflash.core.adaptive as adaptive

    def plan(acceptance: list[float], closed: bool) -> int:
        schedule = fitted((0.010, 0.0001), (0.010, 0.0), prior_weight=0.0)
        requests = [f"r{i}" for i in range(8)]
        for req_id in requests:
            accept(schedule, req_id, acceptance)
        ks = schedule.plan([Candidate(r, 3, num_remaining_tokens=128) for r in requests], num_generating=8, closed=closed)
        assert len(set(ks.values())) == 1  # alike requests, one choice
        return ks["r0"]

    all_or_nothing, steady = [0.5, 0.5, 0.5], [0.9, 0.4, 0.2]
    assert plan(all_or_nothing, closed=False) == 3
    assert plan(all_or_nothing, closed=True) == 0
    assert plan(steady, closed=True) == 3
    monkeypatch.setattr(adaptive, "_latest_of", lambda n: 0.0)  # the means alone
    assert plan(all_or_nothing, closed=True) == 3


def test_steps_spread_and_latest_of_known_values():
    from dflash.core.adaptive import _latest_of, _steps_spread

    # A block of 1 accepted with probability 1/2: 1.5 tokens a step, Var(A) = 1/4; 150 tokens take
    # 100 steps, variance 150 * 0.25 / 1.5^3 = 11.1.
    assert _steps_spread([0.5], 150) == pytest.approx((150 * 0.25 / 1.5**3) ** 0.5)
    # Two candidates, both or neither accepted: A is 0 or 2, Var(A) = 1; 100 tokens, 2 a step on average.
    assert _steps_spread([0.5, 0.5], 100) == pytest.approx((100 * 1.0 / 2.0**3) ** 0.5)
    assert _steps_spread([1.0, 1.0], 99) == 0.0 and _steps_spread([0.0, 0.0], 99) == 0.0
    assert _latest_of(1) == 0.0
    assert _latest_of(2) == pytest.approx(0.564, abs=0.03)  # E[max of 2 standard normals] = 1 / sqrt(pi)
    assert _latest_of(8) == pytest.approx(1.424, abs=0.03)


def test_zero_when_the_draft_fixed_cost_exceeds_any_gain():
    # Target: 10 ms + 0.1 ms a row; draft: 8 ms fixed. Acceptance 0.3 then 0.1: at best 1.4 tokens for
    # about 18 ms instead of 1 token for 10 ms.
    schedule = fitted(target=(0.010, 0.0001), draft=(0.008, 0.0001))
    accept(schedule, "a", [0.3, 0.1, 0.0])
    assert schedule.plan([Candidate("a", 3)], num_generating=1) == {"a": 0}
    # The same acceptance with a cheap draft pays for one candidate: 1.3 tokens for ~11 ms.
    cheap = fitted(target=(0.010, 0.0001), draft=(0.0005, 0.0001))
    accept(cheap, "a", [0.3, 0.1, 0.0])
    assert cheap.plan([Candidate("a", 3)], num_generating=1)["a"] >= 1


def test_the_plan_is_the_best_choice_over_every_combination():
    target, draft, per_candidate = (0.010, 0.0004), (0.003, 0.0001), 0.0002
    schedule = fitted(target, draft, per_candidate=per_candidate, prior_weight=0.0)
    acceptance = {"a": [0.9, 0.8, 0.6, 0.3, 0.1], "b": [0.5, 0.2, 0.1, 0.0, 0.0], "c": [0.05, 0.0, 0.0, 0.0, 0.0]}
    for req_id, q in acceptance.items():
        accept(schedule, req_id, q)
    q = {r: schedule.estimate(r, 5) for r in acceptance}
    ks = schedule.plan([Candidate(r, 5) for r in acceptance], num_generating=3)
    best = max(rate(dict(zip(acceptance, combo)), q, target, draft, per_candidate)
               for combo in itertools.product(range(6), repeat=3))  # fmt: skip
    assert rate(ks, q, target, draft, per_candidate) == pytest.approx(best)
    assert ks["a"] > ks["b"] >= ks["c"] == 0


def test_a_request_estimate_overrides_the_engine_wide_one():
    schedule = fitted(target=(0.010, 0.002), draft=(0.002, 0.0001))
    for step in range(200):  # interleaved: the engine-wide figure is 2/3 at every position
        for req_id, accepted in (("good1", 3), ("good2", 3), ("bad", 0)):
            schedule.observe_verification(req_id, 3, accepted)
    assert schedule.engine_wide.estimate(3) == pytest.approx([2 / 3] * 3, abs=0.03)  # (smoothing: 2 of ~50 trials)
    ks = schedule.plan([Candidate("good1", 3), Candidate("bad", 3)], num_generating=2)
    assert ks == {"good1": 3, "bad": 0}
    # A new request has only the engine-wide prior, which pays here.
    assert schedule.plan([Candidate("new", 3)], num_generating=1)["new"] >= 1


def test_a_paused_request_is_probed_with_waits_that_double():
    # A budget that any probe fits in: the doubling alone sets the waits (the budget: the next test).
    schedule = fitted(target=(0.010, 0.0001), draft=(0.008, 0.0001), probe_after=4, max_probe_after=16, probe_budget=1.0)
    accept(schedule, "a", [0.0, 0.0])
    probes = []
    for step in range(100):
        k = schedule.plan([Candidate("a", 6)], num_generating=1)["a"]
        if k:
            probes.append(step)
            assert k == schedule.probe_candidates
            schedule.observe_verification("a", k, 0)  # the probe fails
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes[0] < 4  # the first probe within probe_after steps
    assert gaps == sorted(gaps) and gaps[0] >= 8 and gaps[-3:] == [16, 16, 16]  # waits double, up to the cap


def test_no_probe_where_even_a_draft_that_accepts_everything_would_not_pay():
    """A probe only tells what the draft accepts; where a verified row costs what a plain step does, no
    acceptance would make drafting pay, so a paused request is never probed (a new one, among requests
    that differ, neither), whatever the probe budget. With the same schedule priced on cheap rows it is."""

    def probes(per_row: float, old: list[float]) -> list[int]:
        schedule = fitted(target=(0.001, per_row), draft=(0.002, 0.0001), probe_after=4, max_probe_after=16, probe_budget=1.0)
        for index, acceptance in enumerate(old):  # finished requests: alike (paused) or differing (first probe)
            accept(schedule, f"old{index}", [acceptance] * 6, steps=10)
            schedule.forget(f"old{index}")
        accept(schedule, "a", [0.0, 0.0])
        ks = [schedule.plan([Candidate("a", 6), Candidate("new", 6)], num_generating=2) for _ in range(100)]
        return [sum(k.values()) for k in ks if any(k.values())]

    for old in ([0.0] * 8, [1.0] + [0.0] * 7):
        assert probes(0.010, old) == []  # 11 ms a row against a 1 ms fixed cost: rows cost as much as tokens
        assert len(probes(0.00001, old)) >= 3  # cheap rows: probed, as in the tests above


def test_probe_waits_must_be_powers_of_two():
    # Probes of several requests share steps, and a step where none can fall skips the wait's pricing.
    for bad in (dict(probe_after=6), dict(max_probe_after=100), dict(probe_after=0)):
        with pytest.raises(ValueError, match="power of two"):
            AdaptiveSchedule(**bad)
    AdaptiveSchedule(probe_after=4, max_probe_after=16)


def test_probes_wait_as_long_as_their_expected_loss_needs():
    """A probe's loss (its rows and draft step, less the tokens it is expected to bring) stays within
    probe_budget of the request's time: cheap probes keep probe_after, costly ones wait longer."""

    def first_probe(target, draft, acceptance) -> int:
        schedule = fitted(target=target, draft=draft, probe_after=4, max_probe_after=16, prior_weight=0.0)
        accept(schedule, "a", acceptance)
        for step in range(1, 400):
            if schedule.plan([Candidate("a", 6)], num_generating=1)["a"]:
                return step
        return 400

    # Rows and the draft cost almost nothing against a 10 ms step: probe after probe_after steps.
    assert first_probe((0.010, 0.00001), (0.00002, 0.00001), [0.0, 0.0]) <= 4
    # An 8 ms draft step against a 10 ms target step, nothing accepted: 0.8 of a step lost per probe;
    # within 2% of the request's time that is one probe every 64 steps (a power of two above 40).
    assert first_probe((0.010, 0.0001), (0.008, 0.0001), [0.0, 0.0]) == 64
    # The same costs with a draft that half pays for itself: a shorter wait.
    assert 4 < first_probe((0.010, 0.0001), (0.008, 0.0001), [0.3, 0.1]) < 64


def test_positions_a_request_never_drafted_follow_the_prior_ratio():
    counts = AcceptanceCounts(decay=1.0)
    counts.observe(2, 2)
    q = counts.estimate(4, prior=[0.4, 0.2, 0.2, 0.1], prior_weight=2.0)
    # measured positions: (1 + 2 * 0.4) / 3 and (1 + 2 * 0.2) / 3; then the prior's ratios 1.0 and 0.5
    assert q == pytest.approx([0.6, 1.4 / 3, 1.4 / 3, 0.7 / 3])


def test_the_prior_is_weak_when_requests_differ_and_strong_when_they_accept_alike():
    differ, alike = AdaptiveSchedule(), AdaptiveSchedule()
    for step in range(40):
        u = (step * 0.6180339887) % 1.0
        for index in range(6):
            differ.observe_verification(f"r{index}", 1, 1 if index % 2 else 0)  # half always, half never
            alike.observe_verification(f"r{index}", 1, 1 if (u + index / 6) % 1.0 < 0.45 else 0)  # all 0.45
    assert differ.prior_strength() == differ.min_prior_strength  # each request follows its own evidence
    assert alike.prior_strength() >= 12.0
    assert AdaptiveSchedule().prior_strength() == AdaptiveSchedule().prior_weight  # too few requests to tell
    none = AdaptiveSchedule()
    for index in range(6):
        accept(none, f"r{index}", [0.0], steps=10)
    assert none.prior_strength() >= 12.0  # requests that all accept nothing are alike


def test_finished_requests_still_tell_that_requests_differ():
    """The spread of acceptance between requests counts the recent finished ones: in a batch where only
    some requests draft, the running ones alone soon hold too little evidence to tell."""
    schedule = AdaptiveSchedule()
    for index in range(6):
        accept(schedule, f"r{index}", [1.0 if index % 2 else 0.0], steps=10)
        schedule.forget(f"r{index}")
    assert schedule.prior_strength() == schedule.min_prior_strength
    schedule.observe_verification("new", 1, 1)
    assert schedule.estimate("new", 1)[0] > 0.75  # one verification of its own nearly decides


def test_a_new_request_is_probed_with_its_whole_block_when_requests_differ():
    """Where finished requests split into some that accepted everything and some nothing, the
    engine-wide figure says little about a new request: it is probed within probe_after steps with its
    whole block, whatever the probe's expected loss; among requests that accept alike it is not."""

    def first_probe(acceptance_by_request: list[float]) -> tuple[int, int]:
        # A costly probe: an 8 ms draft step against a 10 ms target step (the budget alone waits 64 steps).
        schedule = fitted(target=(0.010, 0.0001), draft=(0.008, 0.0001), probe_after=4, max_probe_after=16)
        for index, acceptance in enumerate(acceptance_by_request):
            accept(schedule, f"old{index}", [acceptance] * 6, steps=10)
            schedule.forget(f"old{index}")
        for step in range(1, 400):
            if k := schedule.plan([Candidate("new", 6)], num_generating=1)["new"]:
                return step, k
        return 400, 0

    step, k = first_probe([1.0] + [0.0] * 7)  # engine-wide about 0.12 a position: not worth drafting
    assert step <= 4 and k == 6
    step, k = first_probe([0.0] * 8)  # alike: the budget's wait, and a short probe
    assert step > 16 and k == AdaptiveSchedule.probe_candidates


def test_the_draft_cost_is_fitted_when_context_rows_barely_vary():
    """A draft that accepts nothing at c=1 reads 1 or 2 context rows a step: too little spread to fit a
    context-row price, which must not keep the whole draft line unfitted (the schedule explores, drafting
    3 steps in 4, until it is fitted)."""
    schedule = AdaptiveSchedule(min_steps=4)
    for step in range(24):
        context, block = (2 if step % 5 == 0 else 1), (16, 9, 2)[step % 3]
        schedule.observe_draft(context, block, block - 1, 0.002 + 0.0001 * block)
    fit = schedule.draft_cost.fit()
    assert fit is not None and fit[0] == pytest.approx(0.002, abs=2e-4)


def test_a_position_drafted_long_ago_is_not_pinned_at_zero():
    """Evidence that decayed below one verification is topped up with the extrapolation: a deep
    position that failed once, long ago, is estimated from the positions before it, not as 0."""
    counts = AcceptanceCounts(decay=0.9)
    counts.observe(4, 0)  # one early failure at every position
    for _ in range(60):
        counts.observe(2, 1)  # since then: position 0 always accepted, position 1 never
    q = counts.estimate(4)
    # position 1: 0 of ~10 decayed trials, shrunk towards position 0's rate by 2 pseudo-trials
    assert q[0] == pytest.approx(1.0, abs=1e-3) and q[1] < 0.2 and q[2] < q[1] * 0.2
    counts = AcceptanceCounts(decay=0.9)
    counts.observe(5, 0)  # long ago
    for _ in range(60):
        counts.observe(3, 3)
    assert counts.estimate(5)[3] > 0.5  # decayed failure at position 3: follows positions 0-2 (all accepted)


def test_a_deep_position_that_failed_its_few_trials_is_not_estimated_at_zero():
    """Five verifications of 7 candidates (position 0 accepted 3 times, position 1 once, position 2
    never): as accepted / drafted, positions 2-6 read 0 and would never be drafted again (chat prompts
    at c=1 stayed at 2 candidates, 0.93x, where 7 ran 1.19x). As conditional rates, each shrunk towards
    the rate before it, they continue from positions 0 and 1."""
    counts = AcceptanceCounts(decay=1.0)
    for accepted in (0, 1, 2, 0, 1):
        counts.observe(7, accepted)
    c0 = 3 / 5
    c1 = (1 + 2 * c0) / (3 + 2)  # 1 accepted of the 3 that reached position 1
    c2 = (0 + 2 * c1) / (1 + 2)  # 0 of the 1 that reached position 2
    q = counts.estimate(7)
    assert q[:4] == pytest.approx([c0, c0 * c1, c0 * c1 * c2, c0 * c1 * c2 * c2])  # position 3: no trial, the rate before it
    assert all(later <= earlier for earlier, later in zip(q, q[1:])) and q[6] > 0


def test_the_reshape_is_priced_from_plain_steps_when_every_verifying_step_changed_shape():
    """A paused batch verifies only probes, each a new shape: fitted on those alone, the reshape folds
    into the line's fixed cost and every drafting step is priced as a reshape. Plain steps measure it
    apart (one that changed shape against one that did not), and the line takes that figure."""
    schedule = AdaptiveSchedule(min_steps=4)
    for _ in range(6):
        schedule.observe_target(1, 0.006, verified_candidates=False)
        schedule.observe_target(1, 0.010, verified_candidates=False, reshaped=True)  # 4 ms to change shape
    for rows in (2, 3, 5, 8) * 3:  # probes of several lengths: every one changed shape
        schedule.observe_target(rows, 0.006 + 0.0005 * rows + 0.004, reshaped=True)
    fixed, per_row, reshape = schedule.target_cost(1).fit()
    assert (fixed, per_row, reshape) == pytest.approx((0.006, 0.0005, 0.004))
    assert schedule.verify_step_seconds(8) == pytest.approx(0.010)  # 8 rows drafting steadily: no reshape


def test_a_schedule_restored_from_another_s_state_decides_as_it_does():
    """`state()` through JSON and `restore()`: the costs, means and acceptance come back, and the new
    schedule plans what the old one plans, from its first step (no exploration)."""
    import json

    old = fitted(target=(0.010, 0.002), draft=(0.002, 0.0001))
    accept(old, "a", [0.8, 0.6, 0.4])
    accept(old, "b", [0.2, 0.05, 0.0])
    old.forget("a")
    assert old.draft_cost.fit() is not None  # fitted (a running schedule fits as it plans), then
    for _ in range(130):  # the draft's latest steps all alike: only the kept fit prices them (a window that cannot refit)
        old.observe_draft(3, 5, 4, 0.0025)
    assert old.draft_cost.fit() is not None
    new = AdaptiveSchedule(min_steps=4)
    new.restore(json.loads(json.dumps(old.state())))
    assert new.draft_cost.fit() == pytest.approx(old.draft_cost.fit())
    for n in (1, 2, 4):
        assert new.target_cost(n).fit() == pytest.approx(old.target_cost(n).fit())
    assert new.engine_wide.estimate(3) == pytest.approx(old.engine_wide.estimate(3))
    assert new.prior_strength() == pytest.approx(old.prior_strength())
    for candidates in ([Candidate("x", 3)], [Candidate("x", 3), Candidate("y", 2)]):
        assert new.plan(candidates, num_generating=len(candidates)) == old.plan(candidates, num_generating=len(candidates))


@pytest.mark.parametrize("damage", ["version", "negative seconds", "negative target seconds", "accepted above drafted", "not a dict"])
def test_a_damaged_state_is_refused_and_changes_nothing(damage):
    import json

    state = json.loads(json.dumps(fitted(target=(0.010, 0.002), draft=(0.002, 0.0001)).state()))
    accept_state = AdaptiveSchedule()
    accept(accept_state, "a", [0.5])
    state["acceptance"] = accept_state.state()["acceptance"]
    if damage == "version":
        state["version"] = 99
    elif damage == "negative seconds":
        state["draft_cost"]["observations"][0][1] = -1.0
    elif damage == "negative target seconds":  # the draft's line is sound: it must not be taken alone
        state["target_costs"]["1"]["observations"][-1][1] = -1.0
    elif damage == "accepted above drafted":
        state["acceptance"]["accepted"] = [x + 10 for x in state["acceptance"]["drafted"]]
    else:
        state["target_costs"] = [1, 2]
    schedule = AdaptiveSchedule()
    with pytest.raises(ValueError):
        schedule.restore(state)
    assert schedule.state() == AdaptiveSchedule().state()  # all or nothing


def test_probes_do_not_shorten_the_shape_lifetime():
    """A paused batch verifies only probes, each a new shape. Counted, they made the lifetime one step, and
    starting to draft was charged a whole reshape (chat prompts at c=1 never started again)."""
    schedule = fitted((0.010, 0.002), (0.001, 0.0002))
    shapes_last(schedule, schedule.shape_window, 0.010)
    assert schedule.shape_lifetime() == schedule.shape_window
    schedule._chosen.extend([False, False])  # the latest plans: probes, not the schedule's choice
    for _ in range(schedule.shape_window):
        schedule.observe_target(3, 0.026, reshaped=True)
    assert schedule.shape_lifetime() == schedule.shape_window


def stuck_batch(**kwargs) -> tuple[AdaptiveSchedule, list[Candidate]]:
    """Two requests whose drafting would pay (10 ms + 2 ms a row; 3 candidates accepted at 0.8 0.6 0.45
    bring 2.85 tokens a request where a plain step brings 1), behind an engine-wide estimate of 0.3 0.1 0
    from six early verifications, which prices drafting below not drafting."""
    schedule = fitted(target=(0.010, 0.002), draft=(0.002, 0.0001), **kwargs)
    accept(schedule, "early", [0.3, 0.1, 0.0], steps=6)
    schedule.forget("early")
    return schedule, [Candidate("a", 3), Candidate("b", 3)]


def test_a_batch_that_stopped_drafting_re_tests_its_plan_and_drafts_again_when_it_pays():
    """A batch that drafts nothing measures nothing that could change its mind. After `retest_after`
    steps it drafts its plan for `retest_steps` steps, priced at the top of what the engine-wide counts
    allow; the verifications it brings (0.8 0.6 0.45) start it drafting by choice. Without re-tests
    (a wait longer than the run) it never drafts. (No probe falls within the run.)"""
    for retest_after, drafts in ((32, True), (1 << 30, False)):
        schedule, requests = stuck_batch(retest_after=retest_after, probe_after=128, max_probe_after=128)
        plans = []
        for step in range(120):
            ks = schedule.plan(requests, num_generating=2)
            plans.append(sum(ks.values()))
            for c in requests:  # each position accepted as the draft really does
                if ks[c.req_id]:
                    u = (step * 0.6180339887) % 1.0
                    schedule.observe_verification(c.req_id, ks[c.req_id], sum(1 for q in (0.8, 0.6, 0.45)[: ks[c.req_id]] if u < q))
        if drafts:
            first = next(i for i, k in enumerate(plans) if k)
            assert first == schedule.retest_after - 1 and plans[first + 1] > 0  # the re-test: two steps
            assert not any(plans[:first]) and sum(1 for k in plans[-60:] if k) >= 57  # then drafting by choice
        else:
            assert not any(plans)


def test_re_tests_that_do_not_bring_drafting_back_wait_twice_as_long():
    """Re-tests whose verifications never arrive (the estimate stays where it stopped): each wait doubles
    (a re-test starts on the wait's last step without drafting)."""
    schedule, requests = stuck_batch(retest_after=8, max_retest_after=32, probe_after=512, max_probe_after=512)
    steps = [step for step in range(300) if any(schedule.plan(requests, num_generating=2).values())]
    starts = [s for s in steps if s - 1 not in steps]
    assert [b - a for a, b in itertools.pairwise(starts)][:4] == [2 + 15, 2 + 31, 2 + 31, 2 + 31]
    assert all(s + 1 in steps for s in starts)  # each re-test lasts retest_steps (2) steps


def test_no_re_test_where_the_engine_wide_counts_say_the_draft_accepts_nothing():
    """Two hundred verifications that accepted nothing: even at the top of what they allow, no plan is
    within the margin of not drafting, and nothing is re-tested (no probe falls within the run). Six
    such verifications leave the doubt a re-test is for."""
    for steps, retested in ((200, False), (6, True)):
        schedule = fitted(target=(0.010, 0.002), draft=(0.002, 0.0001), probe_after=512, max_probe_after=512)
        accept(schedule, "early", [0.0, 0.0, 0.0], steps=steps)
        requests = [Candidate("a", 3), Candidate("b", 3)]
        assert any(any(schedule.plan(requests, num_generating=2).values()) for _ in range(500)) == retested


def test_a_closed_batch_drafts_the_same_block_for_every_request_it_drafts_for():
    """In an open batch the slots go to the request that accepts most; in a closed one the slowest
    request sets the end, so the requests the step's plan drafts for all draft the same block: the
    length that finishes the batch soonest, here longer than the slow request's share of the open plan."""
    schedule = fitted((0.010, 0.001), (0.0005, 0.0001), prior_weight=0.0)
    accept(schedule, "good", [0.95, 0.9, 0.85, 0.8])
    accept(schedule, "fair", [0.6, 0.45, 0.35, 0.3])
    requests = [Candidate("good", 4, num_remaining_tokens=100), Candidate("fair", 4, num_remaining_tokens=100)]
    open_plan = schedule.plan(requests, num_generating=2)
    closed_plan = schedule.plan(requests, num_generating=2, closed=True)
    assert open_plan["good"] > open_plan["fair"] > 0
    assert closed_plan["good"] == closed_plan["fair"] > open_plan["fair"]


def test_a_closed_batch_prices_the_whole_batch_s_rows_at_their_measured_price():
    """A line of steep slope and no fixed cost (its steps a few candidates each, every one paying the
    jump off the one-row kernel) against a measured mean of 32 rows at 30 ms: priced on the line, 8
    requests and 24 candidates cost 64 ms a step, and the closed batch would not draft; at the mean it
    finishes in about half the time of plain steps of 16 ms, and drafts 3 each."""
    schedule = AdaptiveSchedule(min_steps=4, prior_weight=0.0)
    for _ in range(11):  # plain steps of 8 requests (the first of a shape is not measured)
        schedule.observe_target(8, 0.016, verified_candidates=False, num_requests=8)
    for rows in (9, 12, 16, 20, 10, 14) * 2:  # the line: 2 ms a row, every step a change of shape
        schedule.observe_target(rows, 0.002 * rows, reshaped=True, num_requests=8)
    for _ in range(11):
        schedule.observe_target(32, 0.030, num_requests=8)
    for rows, context in ((8, 1), (16, 4), (24, 9), (32, 2), (12, 5)) * 2:
        schedule.observe_draft(context, rows, rows, 0.001 + 0.0001 * rows)
    requests = [Candidate(f"r{i}", 3, num_remaining_tokens=128) for i in range(8)]
    for c in requests:
        accept(schedule, c.req_id, [0.9, 0.8, 0.7])
    assert schedule.verify_step_seconds(32, 8) == pytest.approx(0.030)
    assert schedule.plan(requests, num_generating=8, last_rows=32) == dict.fromkeys((c.req_id for c in requests), 3)
    assert schedule.plan(requests, num_generating=8, last_rows=32, closed=True) == dict.fromkeys((c.req_id for c in requests), 3)


def test_a_row_count_price_moves_with_the_plain_step_measured_since():
    """24 rows measured at 20 ms while a plain step took 10; the machine then slows by half (plain steps
    of 15 ms, nothing drafted): 24 rows are priced at 30 ms, as the same machine now runs them. The
    factor stays within half to twice."""
    schedule = AdaptiveSchedule(min_steps=4)
    for _ in range(11):
        schedule.observe_target(8, 0.010, verified_candidates=False, num_requests=8)
    for _ in range(11):
        schedule.observe_target(24, 0.020, num_requests=8)
    assert schedule.verify_step_seconds(24, 8) == pytest.approx(0.020)
    for _ in range(60):
        schedule.observe_target(8, 0.015, verified_candidates=False, num_requests=8)
    assert schedule.plain_step_seconds(8) == pytest.approx(0.015, rel=1e-3)
    assert schedule.verify_step_seconds(24, 8) == pytest.approx(0.030, rel=1e-3)
    for _ in range(60):
        schedule.observe_target(8, 0.050, verified_candidates=False, num_requests=8)
    assert schedule.verify_step_seconds(24, 8) == pytest.approx(0.040, rel=1e-3)
