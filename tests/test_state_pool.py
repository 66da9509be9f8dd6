"""The linear-attention state pool (core/state_pool.py): committed blocks, checkpoints, promotion."""

from __future__ import annotations

import pytest

from dflash.core.request import RequestStatus
from dflash.core.state_pool import StatePool


def test_committed_blocks_are_zeroed_and_checkpoints_promoted():
    zeroed = []
    pool = StatePool(8, zero=zeroed.append)
    a, b = pool.allocate("a"), pool.allocate("b")
    assert (a, b) == (0, 1) and zeroed == [0, 1]
    assert pool.la_block_indices("a") == ([0, 0], 0)  # prefill / decode: read and write the committed block
    checkpoints = pool.reserve_checkpoints("a", 4)
    assert checkpoints == [2, 3, 4, 5] and zeroed == [0, 1]  # checkpoints are written whole, never zeroed
    assert pool.la_block_indices("a") == ([0, 2, 3, 4, 5], 1)
    assert pool.promote("a", 2) == 3  # seed + 1 accepted candidate
    assert pool.committed("a") == 3 and pool.la_block_indices("a") == ([3, 3], 0)
    assert pool.num_free == 6
    pool.reserve_checkpoints("b", 3)
    pool.release_checkpoints("b")  # nothing verified (abort mid-step, or the request finished)
    pool.free("a")
    pool.free("b")
    assert pool.num_free == 8


def test_exhaustion_and_misuse_are_errors():
    pool = StatePool(3)
    pool.allocate("a")
    with pytest.raises(MemoryError, match="exhausted"):
        pool.reserve_checkpoints("a", 3)
    assert pool.num_free == 2 and not pool.can_allocate(3)
    with pytest.raises(ValueError, match="already owns"):
        pool.allocate("a")
    pool.reserve_checkpoints("a", 2)
    with pytest.raises(ValueError, match="checkpoint 3 of 2"):
        pool.promote("a", 3)
    pool.free("a")
    assert pool.num_free == 3


# ---- the hybrid cache manager under the real scheduler (core/hybrid_cache.py), no model ------------


def _hybrid_scheduler(num_state_blocks: int, num_kv_blocks: int = 16, budget: int = 32):
    from dflash.core.block_pool import BlockPool
    from dflash.core.config import SchedulerConfig
    from dflash.core.hybrid_cache import HybridCacheManager
    from dflash.core.scheduler import Scheduler

    zeroed: list[int] = []
    manager = HybridCacheManager(BlockPool(num_kv_blocks, 4, enable_prefix_caching=False), StatePool(num_state_blocks, zero=zeroed.append))
    return Scheduler(SchedulerConfig(budget, 8, True, None), manager), manager, zeroed


def _request(req_id: str, num_prompt: int):
    from dflash.core.config import SamplingParams
    from dflash.core.request import Request

    return Request(req_id, list(range(10, 10 + num_prompt)), SamplingParams(max_new_tokens=20))


def test_hybrid_cache_checkpoints_each_verified_row_and_keeps_the_accepted_state():
    scheduler, manager, zeroed = _hybrid_scheduler(num_state_blocks=8)
    a = _request("a", 6)
    scheduler.add_request(a)
    out = scheduler.schedule()  # the prompt: [c, c], interval 0, from past 0
    la = manager.state_inputs(out.scheduled)
    assert la["la.block_indices"].tolist() == [0, 0] and la["la.cache_interval"].tolist() == [0]
    assert la["la.past_lens"].tolist() == [0] and zeroed == [0]
    scheduler.update_from_output(out, {"a": [7]})
    a.spec_token_ids = (1, 2, 3)
    out = scheduler.schedule()  # seed + 3 candidates: 4 checkpoints
    la = manager.state_inputs(out.scheduled)
    assert la["la.block_indices"].tolist() == [0, 1, 2, 3, 4] and la["la.cache_interval"].tolist() == [1]
    assert la["la.block_indices_begins"].tolist() == [0, 5] and la["la.past_lens"].tolist() == [6]
    scheduler.update_from_output(out, {"a": [1, 9]})  # one candidate accepted + the bonus: 2 rows kept
    assert manager.state_pool.committed("a") == 2 and manager.state_pool.num_free == 7
    assert zeroed == [0]  # checkpoints are written whole, never zeroed
    scheduler.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert manager.state_pool.num_free == 8


def test_hybrid_cache_verifies_fewer_candidates_when_checkpoints_are_short_and_frees_on_preemption():
    scheduler, manager, zeroed = _hybrid_scheduler(num_state_blocks=4)
    a, b = _request("a", 6), _request("b", 5)
    for request in (a, b):
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [7], "b": [7]})
    a.spec_token_ids = b.spec_token_ids = (1, 2, 3)
    out = scheduler.schedule()  # 2 free state blocks: a verifies seed + 1 candidate, b only its seed
    assert [(s.req_id, s.num_spec_tokens) for s in out.scheduled] == [("a", 1), ("b", 0)]
    assert manager.state_inputs(out.scheduled)["la.cache_interval"].tolist() == [1, 0]
    scheduler.update_from_output(out, {"a": [5], "b": [8]})  # a's candidate rejected: its old block stays
    assert manager.state_pool.num_free == 2
    # Preemption by recompute frees the state; readmission gets a zeroed block.
    scheduler._preempt(b)
    assert manager.state_pool.num_free == 3 and not manager.state_pool.owns("b")
    scheduler.schedule()
    assert manager.state_pool.owns("b") and zeroed[-1] == manager.state_pool.committed("b")


def test_hybrid_cache_refuses_prefix_caching():
    from dflash.core.block_pool import BlockPool
    from dflash.core.hybrid_cache import HybridCacheManager

    with pytest.raises(ValueError, match="prefix caching"):
        HybridCacheManager(BlockPool(4, 4, enable_prefix_caching=True), StatePool(2))


def test_hybrid_cache_recovers_checkpoints_of_a_step_never_booked():
    """A step whose inference failed is never booked: its checkpoints are given back when the request
    is scheduled again, verifying or not."""
    scheduler, manager, _ = _hybrid_scheduler(num_state_blocks=8)
    a = _request("a", 6)
    scheduler.add_request(a)
    scheduler.update_from_output(scheduler.schedule(), {"a": [7]})
    a.spec_token_ids = (1, 2, 3)
    scheduler.schedule()  # reserves 4 checkpoints; the inference "fails"
    assert manager.state_pool.num_free == 3
    out = scheduler.schedule()  # the verification again (planned while the stale blocks were held): no leak
    (verify,) = out.scheduled
    assert manager.state_pool.num_free == 8 - 1 - verify.num_new_tokens and verify.num_spec_tokens >= 1
    assert manager.state_inputs(out.scheduled)["la.cache_interval"].tolist() == [1]
    a.spec_token_ids = ()
    out = scheduler.schedule()  # now a plain decode: the stale checkpoints go back
    assert manager.state_pool.num_free == 7 and manager.state_inputs(out.scheduled)["la.block_indices"].tolist() == [0, 0]
