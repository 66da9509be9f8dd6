"""The "adaptive" schedule's arithmetic (core/adaptive.py), on observations with a known answer."""

from __future__ import annotations

import pytest

from dflash.core.adaptive import AdaptiveBlockSize


def feed(policy: AdaptiveBlockSize, *, base: float, per_row: float, rows: list[int], tokens_per_step: int,
         acceptance: list[float], steps: int = 100) -> None:  # fmt: skip
    """Steps whose target time is base + per_row * rows (draft time: half of that), and verifications
    whose position i is accepted in the share acceptance[i] of them."""
    for i in range(len(rows) * 4):
        n = rows[i % len(rows)]
        seconds = base + per_row * n
        policy.observe_step((n, seconds), (n, seconds / 2), tokens_per_step, 1.5 * seconds)
    for step in range(steps):
        accepted = sum(1 for q in acceptance if step < q * steps)  # position i accepted q_i * steps times
        policy.observe_verification(len(acceptance), accepted)


def test_without_a_cost_fit_it_explores_whole_half_and_single_blocks_step_by_step():
    policy = AdaptiveBlockSize()
    sizes = []
    for _ in range(6):
        sizes.append(policy.block_size(15))
        assert policy.block_size(15) == sizes[-1]  # the same for every request of a step
        policy.observe_step((16, 0.01), (17, 0.005), 2, 0.02)  # rows never vary: no fit
    assert sizes == [15, 8, 1, 15, 8, 1]
    policy.observe_verification(3, 1)
    assert policy.block_size(7) in (1, 4, 7)  # acceptance but no cost yet


def test_rows_that_never_vary_cannot_be_fitted_but_an_earlier_fit_is_kept():
    policy = AdaptiveBlockSize(min_steps=4, window=8)
    feed(policy, base=0.01, per_row=0.001, rows=[8], tokens_per_step=8, acceptance=[0.5, 0.2])
    assert policy.row_seconds() is None
    feed(policy, base=0.01, per_row=0.001, rows=[4, 8], tokens_per_step=8, acceptance=[0.5, 0.2])
    fitted = policy.row_seconds()
    assert fitted == pytest.approx(0.0015)
    feed(policy, base=0.01, per_row=0.001, rows=[8], tokens_per_step=8, acceptance=[0.5, 0.2])  # the window forgets
    assert policy.row_seconds() == fitted


def test_the_fitted_row_cost_is_the_slope_of_both_models():
    policy = AdaptiveBlockSize(min_steps=4)
    feed(policy, base=0.01, per_row=0.002, rows=[8, 16, 32], tokens_per_step=8, acceptance=[0.5])
    assert policy.row_seconds() == pytest.approx(0.002 + 0.001)


@pytest.mark.parametrize(
    "per_row, tokens_per_step, expected",
    [
        (0.0, 1, 5),  # free rows: every measured position pays, and the next one is tried
        (0.0001, 1, 5),  # b * R = 0.00015 * 1 / 0.017 s = 0.01: below every q
        (0.001, 8, 2),  # b * R = 0.0015 * 8 / 0.029 s = 0.41: only q = 0.6 and 0.45 pay
        (0.01, 8, 1),  # b * R = 0.77: nothing pays, one candidate still measures acceptance
    ],
)
def test_the_block_ends_where_acceptance_stops_paying(per_row, tokens_per_step, expected):
    policy = AdaptiveBlockSize(min_steps=4)
    feed(policy, base=0.01, per_row=per_row, rows=[4, 8, 16], tokens_per_step=tokens_per_step,
         acceptance=[0.6, 0.45, 0.2, 0.1])  # fmt: skip
    assert policy.block_size(15) == expected
    assert policy.block_size(1) == 1


def test_an_unmeasured_position_is_tried_when_all_measured_ones_pay():
    policy = AdaptiveBlockSize(min_steps=4)
    feed(policy, base=0.01, per_row=0.0, rows=[4, 8], tokens_per_step=1, acceptance=[0.9, 0.8])
    assert policy.block_size(5) == 3
