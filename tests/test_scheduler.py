"""Scheduler decisions: token budget, chunked prefill, admission, preemption, spec rows, rollback.

CPU-only bookkeeping, no models. The last tests drive whole runs through a fake paged model that
stores each row's token in its KV slot (through the block table) and predicts from what it reads
back, so any bookkeeping slip (a stale or foreign slot, a wrong past length) changes the output.
"""

from __future__ import annotations

import random

import pytest

from dflash.core.block_pool import BlockPool
from dflash.core.config import SamplingParams, SchedulerConfig
from dflash.core.kv_cache_manager import KVCacheManager
from dflash.core.request import Request, RequestStatus
from dflash.core.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 16,
    budget: int = 8,
    max_num_seqs: int = 8,
    split: bool = True,
    max_model_len: int | None = None,
    caching: bool = True,
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching)
    config = SchedulerConfig(budget, max_num_seqs, split, max_model_len)
    return Scheduler(config, KVCacheManager(pool)), pool


def make_request(req_id: str, num_prompt: int, max_new_tokens: int = 8, first: int = 0) -> Request:
    prompt = [(first + i) % 97 + 3 for i in range(num_prompt)]
    return Request(req_id, prompt, SamplingParams(max_new_tokens=max_new_tokens))


def rows(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.req_id, s.num_new_tokens) for s in out.scheduled]


def commit(scheduler: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """Book a step in which every sampling request accepts no candidate and gets `token`."""
    scheduler.update_from_output(out, {s.req_id: [token] for s in out.scheduled if s.samples})


def table(scheduler: Scheduler, req_id: str) -> list[int]:
    return scheduler.kv_cache_manager.block_table(req_id)


# ---- budget, chunking, admission --------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks():
    scheduler, _ = make_scheduler(budget=4)
    scheduler.add_request(make_request("a", 10))
    seen = []
    for _ in range(4):
        out = scheduler.schedule()
        (s,) = out.scheduled
        seen.append((s.num_computed_tokens_before, s.num_new_tokens, s.is_prefill_chunk, s.samples))
        commit(scheduler, out)
    assert seen == [(0, 4, True, False), (4, 4, True, False), (8, 2, True, True), (10, 1, False, True)]
    assert scheduler.get_request("a").output_token_ids == [1, 1]


def test_running_requests_come_first_and_waiting_ones_fill_the_budget():
    scheduler, _ = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6, first=50))
    out = scheduler.schedule()
    assert rows(out) == [("a", 6), ("b", 2)] and out.num_batched_tokens == 8
    commit(scheduler, out)
    scheduler.add_request(make_request("c", 6, first=20))
    out = scheduler.schedule()
    assert rows(out) == [("a", 1), ("b", 4), ("c", 3)]
    assert [s.samples for s in out.scheduled] == [True, True, False]


def test_max_num_seqs_limits_admission():
    scheduler, pool = make_scheduler(budget=64, max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 2, first=ord(name)))
    out = scheduler.schedule()
    assert rows(out) == [("a", 2), ("b", 2)]
    commit(scheduler, out)
    scheduler.finish_request(scheduler.get_request("a"), RequestStatus.FINISHED_STOPPED, "eos")
    out = scheduler.schedule()
    assert rows(out) == [("b", 1), ("c", 2)] and out.finished_req_ids == {"a"}
    commit(scheduler, out)
    assert scheduler.schedule().finished_req_ids == set()  # reported once


def test_without_split_fuse_a_step_is_all_prompts_or_all_generation():
    scheduler, _ = make_scheduler(budget=8, split=False)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5, first=30))
    plan = []
    for step in range(5):
        if step == 3:
            scheduler.add_request(make_request("c", 4, first=60))
        out = scheduler.schedule()
        kinds = {s.is_prefill_chunk for s in out.scheduled}
        assert len(kinds) == 1  # never mixed
        plan.append((rows(out), kinds.pop()))
        commit(scheduler, out)
    assert plan == [
        ([("a", 5)], True),  # b does not fit the 3 tokens left and is not chunked
        ([("b", 5)], True),  # prompts go first
        ([("a", 1), ("b", 1)], False),
        ([("c", 4)], True),
        ([("a", 1), ("b", 1), ("c", 1)], False),
    ]


def test_without_split_fuse_a_recompute_longer_than_the_budget_is_chunked_alone():
    scheduler, _ = make_scheduler(num_blocks=5, budget=8, split=False, caching=False)
    scheduler.add_request(make_request("a", 6, max_new_tokens=10))
    scheduler.add_request(make_request("b", 6, max_new_tokens=10, first=40))
    for _ in range(4):
        commit(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # a needs a third block, then b needs one: b preempts itself
    assert rows(out) == [("a", 1)] and out.preempted_req_ids == ["b"]
    commit(scheduler, out)
    b = scheduler.get_request("b")
    assert b.num_tokens == 9 and b.status == RequestStatus.PREEMPTED
    out = scheduler.schedule()
    assert rows(out) == [("b", 8)]  # 9 tokens > budget 8: the one case chunking is allowed; a waits
    assert out.scheduled[0].is_prefill_chunk and not out.scheduled[0].samples


# ---- requests that can never run --------------------------------------------------------------


def test_a_request_too_big_for_the_cache_fails_at_add_time():
    scheduler, pool = make_scheduler(num_blocks=4)  # 16 token positions
    too_big = make_request("big", 10, max_new_tokens=8)  # needs KV for 17 tokens
    assert not scheduler.add_request(too_big)
    assert too_big.status == RequestStatus.FINISHED_ERROR
    assert "more than the whole cache holds (16)" in too_big.error
    assert scheduler.add_request(make_request("fits", 10, max_new_tokens=7))
    out = scheduler.schedule()
    assert out.finished_req_ids == {"big"} and rows(out) == [("fits", 8)]


def test_max_model_len_and_split_fuse_limits_fail_at_add_time():
    scheduler, _ = make_scheduler(max_model_len=20)
    long = make_request("long", 10, max_new_tokens=11)
    assert not scheduler.add_request(long)
    assert "exceeds max_model_len (20)" in long.error
    assert scheduler.add_request(make_request("ok", 10, max_new_tokens=10))

    scheduler, _ = make_scheduler(budget=8, split=False)
    prompt = make_request("prompt", 9)
    assert not scheduler.add_request(prompt)
    assert "longer than max_num_batched_tokens (8)" in prompt.error
    assert make_scheduler(budget=8, split=True)[0].add_request(make_request("prompt", 9))

    empty = Request("empty", [])
    assert not scheduler.add_request(empty) and "empty prompt" in empty.error
    assert scheduler.add_request(make_request("x", 2))
    with pytest.raises(ValueError, match="already in the scheduler"):
        scheduler.add_request(make_request("x", 2))


def test_zero_new_tokens_finishes_at_once():
    scheduler, _ = make_scheduler()
    req = Request("a", [5, 6], SamplingParams(max_new_tokens=0))
    assert not scheduler.add_request(req)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.finish_reason == "length"
    assert not scheduler.has_unfinished_requests()


def test_livelock_guard_fails_the_head_request():
    scheduler, pool = make_scheduler(num_blocks=4)
    stolen = pool.get_new_blocks(4)  # blocks held outside this scheduler
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4, first=9))
    out = scheduler.schedule()
    assert out.is_empty and out.finished_req_ids == {"a"}
    assert scheduler.get_request("a") is None
    assert scheduler.has_unfinished_requests()  # b is next in line
    pool.free_blocks(stolen)
    out = scheduler.schedule()
    assert rows(out) == [("b", 4)]


def test_livelock_guard_message():
    scheduler, pool = make_scheduler(num_blocks=4)
    pool.get_new_blocks(4)
    req = make_request("a", 4)
    scheduler.add_request(req)
    scheduler.schedule()
    assert req.status == RequestStatus.FINISHED_ERROR and "cannot start" in req.error
    assert "enlarge the KV cache" in req.error


# ---- preemption and abort ---------------------------------------------------------------------


def test_preemption_takes_the_most_recent_first_and_requeues_in_order():
    scheduler, pool = make_scheduler(num_blocks=4, budget=64, caching=False)
    for name, first in (("a", 0), ("b", 20), ("c", 40)):
        scheduler.add_request(make_request(name, 4, max_new_tokens=12, first=first))
    commit(scheduler, scheduler.schedule())
    assert [table(scheduler, n) for n in "abc"] == [[0], [1], [2]]
    a = scheduler.get_request("a")
    a.spec_token_ids = [9] * 8  # 9 rows from position 4: 13 positions, 4 blocks
    out = scheduler.schedule()
    assert rows(out) == [("a", 9)] and out.preempted_req_ids == ["c", "b"]
    assert table(scheduler, "a") == [0, 3, 2, 1]
    b, c = scheduler.get_request("b"), scheduler.get_request("c")
    assert list(scheduler.waiting) == [b, c]
    for req in (b, c):
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert req.num_preemptions == 1 and req.num_tokens == 5 and table(scheduler, req.req_id) == []


def test_a_request_that_is_the_last_running_one_preempts_itself():
    scheduler, pool = make_scheduler(num_blocks=4, budget=64)
    assert scheduler.add_request(make_request("a", 11, max_new_tokens=4))
    scheduler.add_request(make_request("b", 4, first=50))
    commit(scheduler, scheduler.schedule())
    assert table(scheduler, "a") == [0, 1, 2] and table(scheduler, "b") == [3]
    out = scheduler.schedule()
    assert rows(out) == [("a", 1)] and out.preempted_req_ids == ["b"]
    commit(scheduler, out)
    scheduler.abort_request("a")
    out = scheduler.schedule()
    # b recomputes; its published prompt block is still cached, so only the last token runs
    assert rows(out) == [("b", 1)] and out.scheduled[0].num_computed_tokens_before == 4
    assert table(scheduler, "b")[0] == 3
    assert scheduler.get_request("b").num_prefix_cached_tokens == 4


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler, pool = make_scheduler(num_blocks=4, budget=8)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("b", 8, first=30))
    out = scheduler.schedule()
    assert rows(out) == [("a", 8)]  # b has no blocks left to start with
    commit(scheduler, out)
    assert scheduler.abort_request("b") and scheduler.abort_request("a")
    assert not scheduler.abort_request("a") and not scheduler.abort_request("nope")
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"a", "b"}
    assert scheduler.get_request("a") is None
    pool.assert_all_free()


# ---- speculative rows and rollback ------------------------------------------------------------


def test_spec_rows_are_scheduled_and_rejected_candidates_roll_back():
    scheduler, pool = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 4, max_new_tokens=10))
    commit(scheduler, scheduler.schedule(), token=50)
    a = scheduler.get_request("a")
    assert (a.num_tokens, a.num_computed_tokens) == (5, 4)

    a.spec_token_ids = [51, 52, 53]
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens_before, s.num_new_tokens, s.num_spec_tokens) == (4, 4, 3)
    assert s.samples and not s.is_prefill_chunk and s.num_sampled_rows == 4
    assert a.token_ids_with_spec(4, 8) == [50, 51, 52, 53]
    assert table(scheduler, "a") == [0, 1]
    scheduler.update_from_output(out, {"a": [51, 60]}, {"a": 2})  # c1 accepted, bonus 60
    assert a.output_token_ids == [50, 51, 60] and a.spec_token_ids == ()
    assert (a.num_tokens, a.num_computed_tokens) == (7, 6)
    assert table(scheduler, "a") == [0, 1]  # the rejected slot (position 7) is reused next step
    assert pool.num_cached_blocks == 1  # only the full block of committed, computed tokens

    a.spec_token_ids = [61, 62, 63, 64]
    out = scheduler.schedule()
    assert rows(out) == [("a", 5)] and table(scheduler, "a") == [0, 1, 2]
    scheduler.update_from_output(out, {"a": [70]})  # all rejected; num_rejected follows
    assert (a.num_tokens, a.num_computed_tokens) == (8, 7)
    assert table(scheduler, "a") == [0, 1, 2]
    assert pool.num_cached_blocks == 1  # block 1 holds 4 committed tokens but only 3 computed
    out = scheduler.schedule()
    assert rows(out) == [("a", 1)] and out.scheduled[0].num_computed_tokens_before == 7
    commit(scheduler, out)
    assert pool.num_cached_blocks == 2
    scheduler.abort_request("a")
    pool.assert_all_free()


def test_candidates_are_trimmed_to_the_budget_and_to_max_new_tokens():
    scheduler, _ = make_scheduler(budget=3)
    scheduler.add_request(make_request("a", 2, max_new_tokens=10))
    commit(scheduler, scheduler.schedule())
    a = scheduler.get_request("a")
    a.spec_token_ids = [5, 6, 7, 8]
    out = scheduler.schedule()
    assert rows(out) == [("a", 3)] and out.scheduled[0].num_spec_tokens == 2
    assert a.spec_token_ids == [5, 6, 7, 8]  # the candidates are a value: the step says how many run

    scheduler, _ = make_scheduler(budget=16)
    scheduler.add_request(make_request("b", 2, max_new_tokens=3))
    commit(scheduler, scheduler.schedule())
    b = scheduler.get_request("b")
    b.spec_token_ids = [5, 6, 7, 8]  # 1 output of 3: at most 1 candidate + bonus can still commit
    out = scheduler.schedule()
    assert rows(out) == [("b", 2)] and out.scheduled[0].num_spec_tokens == 1


def test_tokens_cut_at_a_stop_keep_the_ledger_consistent():
    scheduler, _ = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 4))
    commit(scheduler, scheduler.schedule())
    a = scheduler.get_request("a")
    a.spec_token_ids = [5, 6, 7]
    out = scheduler.schedule()
    # all 3 accepted (0 rejected), but the caller keeps only 2 tokens because the 2nd is a stop
    scheduler.update_from_output(out, {"a": [5, 6]}, {"a": 0})
    assert (a.num_tokens, a.num_computed_tokens) == (7, 6)


def test_update_rejects_inconsistent_results():
    scheduler, _ = make_scheduler(budget=4)
    scheduler.add_request(make_request("a", 6))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="prefill chunk yields no tokens"):
        scheduler.update_from_output(out, {"a": [1]})
    commit(scheduler, out)
    with pytest.raises(RuntimeError, match="booked twice"):
        commit(scheduler, out)
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="got 0 tokens"):
        scheduler.update_from_output(out, {})
    with pytest.raises(ValueError, match="got 2 tokens"):
        scheduler.update_from_output(out, {"a": [1, 2]})


# ---- whole runs through a fake paged model ----------------------------------------------------

VOCAB = 23
EOS = 0


def next_token(context: list[int]) -> int:
    """A deterministic "model": the next token depends on every token of the context."""
    value = len(context)
    for token in context:
        value = (value * 31 + token + 7) % 1_000_003
    return value % VOCAB


def reference_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain autoregressive decoding, one token at a time, stopping after EOS."""
    output: list[int] = []
    while len(output) < max_new_tokens and EOS not in output:
        output.append(next_token(prompt + output))
    return output


class FakePagedModel:
    """Writes every row's token into its KV slot, then predicts from the context read back."""

    def __init__(self, scheduler: Scheduler):
        pool = scheduler.kv_cache_manager.pool
        self.scheduler = scheduler
        self.slots: list[int | None] = [None] * (pool.num_blocks * pool.kv_block_size)

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        manager = self.scheduler.kv_cache_manager
        for s in out.scheduled:  # write all rows first: a row may attend to earlier rows of its step
            request = self.scheduler.get_request(s.req_id)
            block_table = manager.block_table(s.req_id)
            start = s.num_computed_tokens_before
            tokens = request.token_ids_with_spec(start, start + s.num_new_tokens)
            for position, token in enumerate(tokens, start):
                self.slots[self._slot(block_table, position)] = token
        predictions = {}
        for s in out.scheduled:
            block_table = manager.block_table(s.req_id)
            end = s.num_computed_tokens_before + s.num_new_tokens
            predictions[s.req_id] = [
                next_token([self.slots[self._slot(block_table, p)] for p in range(position + 1)])
                for position in range(end - s.num_sampled_rows, end)
            ]
        return predictions


def cut_at_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def accept(candidates: list[int], predictions: list[int]) -> list[int]:
    """Greedy verification: the longest matching prefix of candidates, then the bonus token."""
    accepted = 0
    while accepted < len(candidates) and candidates[accepted] == predictions[accepted]:
        accepted += 1
    return list(candidates[:accepted]) + [predictions[accepted]]


def propose(request: Request, rng: random.Random) -> list[int]:
    """A draft that is right for a few tokens, then guesses."""
    tokens, proposal = list(request.all_token_ids), []
    num_right = rng.randint(0, 4)
    for _ in range(rng.randint(0, 5)):
        token = next_token(tokens) if len(proposal) < num_right else rng.randrange(VOCAB)
        proposal.append(token)
        tokens.append(token)
    return proposal


def run_engine(scheduler: Scheduler, arrivals: dict[int, list[Request]], seed: int) -> int:
    """The step loop the engine will run; returns how many steps it took."""
    rng, model = random.Random(seed), FakePagedModel(scheduler)
    step = 0
    while scheduler.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request in arrivals.get(step, []):
            assert scheduler.add_request(request)
        out = scheduler.schedule()
        predictions = model.run(out)
        new_tokens, num_rejected = {}, {}
        for s in out.scheduled:
            if s.samples:
                candidates = scheduler.get_request(s.req_id).spec_token_ids[: s.num_spec_tokens]
                accepted = accept(candidates, predictions[s.req_id])
                # the stop rule cuts after EOS; num_rejected still counts only real rejections
                new_tokens[s.req_id] = cut_at_eos(accepted)
                num_rejected[s.req_id] = len(candidates) + 1 - len(accepted)
        scheduler.update_from_output(out, new_tokens, num_rejected if step % 2 else None)
        for req_id in new_tokens:
            request = scheduler.get_request(req_id)
            assert request.num_output_tokens <= request.sampling_params.max_new_tokens
            if EOS in request.output_token_ids:
                assert request.output_token_ids[-1] == EOS  # nothing committed past a stop
                scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, "eos")
            elif request.num_output_tokens == request.sampling_params.max_new_tokens:
                scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
        for request in scheduler.running:
            if request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = propose(request, rng)
        step += 1
        assert step < 2000, "no progress"
    return step


@pytest.mark.parametrize(
    "num_blocks, budget, split, caching",
    [
        (64, 16, True, True),
        (8, 8, True, True),  # tight caches: preemption
        (7, 8, True, False),
        (8, 12, False, True),
        (7, 12, False, False),
        (64, 12, False, False),
    ],
)
def test_whole_runs_match_the_reference_and_return_every_block(num_blocks, budget, split, caching):
    scheduler, pool = make_scheduler(num_blocks, budget, max_num_seqs=4, split=split, caching=caching)
    rng = random.Random(num_blocks * 100 + budget)
    shared_prefix = [rng.randrange(1, VOCAB) for _ in range(9)]
    requests, arrivals = [], {}
    for i in range(10):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3))]
        prompt = shared_prefix[: rng.randint(0, 9)] + own if i % 3 else own
        request = Request(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(3, 12)))
        requests.append(request)
        arrivals.setdefault(rng.choice([0, 0, 1, 3, 6]), []).append(request)

    run_engine(scheduler, arrivals, seed=budget)

    for request in requests:
        assert request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        expected = reference_output(request.prompt_token_ids, request.sampling_params.max_new_tokens)
        assert request.output_token_ids == expected, request.req_id
    pool.assert_all_free()
    if num_blocks < 10:
        assert sum(r.num_preemptions for r in requests) > 0
    if caching:
        assert sum(r.num_prefix_cached_tokens for r in requests) > 0
