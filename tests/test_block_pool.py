"""KV block pool and KV cache manager: exact block ids, ref counts, LRU eviction, prefix-cache hashes.

CPU-only bookkeeping, no models. Block size 4 unless a test says otherwise.
"""

from __future__ import annotations

import pytest

from dflash.core.block_pool import NONE_HASH, BlockPool, hash_block_tokens
from dflash.core.config import CacheConfig, SamplingParams, SchedulerConfig, num_blocks_for_size
from dflash.core.kv_cache_manager import KVCacheManager
from dflash.core.request import Request


def make_request(req_id: str, token_ids: list[int], max_new_tokens: int = 8) -> Request:
    return Request(req_id, list(token_ids), SamplingParams(max_new_tokens=max_new_tokens))


def hashes_of(token_ids: list[int], kv_block_size: int) -> list:
    hashes, parent = [], None
    for start in range(0, len(token_ids) - kv_block_size + 1, kv_block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + kv_block_size])
        hashes.append(parent)
    return hashes


# ---- hashes -----------------------------------------------------------------------------------


def test_hash_chain_depends_on_every_token_before():
    a = hashes_of([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hashes_of([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    c = hashes_of([1, 2, 3, 0, 5, 6, 7, 8], 4)
    assert a == b[:2]  # same prefix, same hashes; the partial block is not hashed
    assert len(b) == 2
    assert c[1] != a[1]  # equal second block, different first block
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a)


def test_hash_parent_none_is_none_hash_and_extra_keys_matter():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(NONE_HASH, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1, 2], ("salt-a",)) != hash_block_tokens(None, [1, 2], ("salt-b",))
    assert hash_block_tokens(None, [1, 2], ("salt-a",)) != hash_block_tokens(None, [1, 2])
    parent = hash_block_tokens(None, [9, 9])
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(None, [1, 2])


# ---- pool -------------------------------------------------------------------------------------


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(num_blocks=6, kv_block_size=4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4, 5]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (3, 3, 0.5)


def test_freed_blocks_go_to_the_tail_and_are_evicted_lru_first():
    pool = BlockPool(num_blocks=6, kv_block_size=4)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.free_blocks([b2, b0])
    assert pool.free_block_ids() == [4, 5, 2, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [4, 5, 2]
    assert pool.free_block_ids() == [0]


def test_cached_block_stays_findable_after_free_until_evicted():
    pool = BlockPool(num_blocks=4, kv_block_size=2)
    b0, b1 = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([b0], [h])
    pool.free_blocks([b1, b0])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.get_cached_block(h) is b0 and b0.ref_cnt == 0
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 1]
    assert pool.get_cached_block(h) is b0  # not evicted yet
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is b0
    assert b0.block_hash is None and pool.get_cached_block(h) is None and pool.num_cached_blocks == 0


def test_touch_revives_a_free_cached_block_and_counts_references():
    pool = BlockPool(num_blocks=3, kv_block_size=2)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b0], [hash_block_tokens(None, [5, 6])])
    pool.free_blocks([b0])
    pool.touch([b0])
    assert b0.ref_cnt == 1 and pool.free_block_ids() == [1, 2]
    pool.touch([b0])
    pool.free_blocks([b0])
    assert b0.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.free_blocks([b0])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.assert_all_free()


def test_misuse_raises():
    pool = BlockPool(num_blocks=2, kv_block_size=2)
    (b0,) = pool.get_new_blocks(1)
    pool.free_blocks([b0])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([b0])
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, kv_block_size=4)


def test_same_hash_twice_keeps_the_first_block():
    pool = BlockPool(num_blocks=3, kv_block_size=2)
    b0, b1 = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([b0], [h])
    pool.cache_full_blocks([b1], [h])
    assert pool.get_cached_block(h) is b0 and b1.block_hash is None and pool.num_cached_blocks == 1


def test_without_prefix_caching_nothing_is_published():
    pool = BlockPool(num_blocks=3, kv_block_size=2, enable_prefix_caching=False)
    (b0,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([b0], [h])
    assert pool.get_cached_block(h) is None and b0.block_hash is None


def test_assert_all_free_names_leaked_blocks():
    pool = BlockPool(num_blocks=4, kv_block_size=2)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError, match=r"2 KV blocks not returned to the pool: \[0, 1\]"):
        pool.assert_all_free()
    pool.free_blocks(blocks)
    pool.assert_all_free()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=2, kv_block_size=2)
    (b0,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([b0], [h])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([b0])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and b0.block_hash is None


# ---- manager ----------------------------------------------------------------------------------


def test_allocate_slots_grows_the_block_table_only_when_needed():
    manager = KVCacheManager(BlockPool(num_blocks=8, kv_block_size=4))
    req = make_request("a", range(10))
    assert manager.allocate_slots(req, 10)
    assert manager.block_table("a") == [0, 1, 2]
    req.num_computed_tokens = 10
    assert manager.allocate_slots(req, 2)  # 12 positions: still 3 blocks
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate_slots(req, 3)  # 13 positions
    assert manager.block_table("a") == [0, 1, 2, 3]
    assert manager.allocate_slots(req, 2, num_computed_tokens=20)  # an explicit ledger (the draft's)
    assert manager.block_table("a") == [0, 1, 2, 3, 4, 5]
    manager.free(req)
    assert manager.block_table("a") == []
    manager.pool.assert_all_free()


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(BlockPool(num_blocks=4, kv_block_size=4))
    a, b = make_request("a", range(12)), make_request("b", range(50, 58))
    assert manager.allocate_slots(a, 12)
    assert not manager.allocate_slots(b, 8)
    assert manager.block_table("b") == [] and manager.num_free_blocks == 1
    assert manager.allocate_slots(b, 4)
    assert manager.block_table("b") == [3]


def test_prefix_hit_is_capped_to_leave_one_token_to_compute():
    manager = KVCacheManager(BlockPool(num_blocks=16, kv_block_size=4))
    prompt = list(range(100, 108))  # exactly two blocks
    a = make_request("a", prompt)
    assert manager.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    manager.cache_blocks(a, 8)
    assert manager.pool.num_cached_blocks == 2

    blocks, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert ([blk.block_id for blk in blocks], num_hit) == ([0], 4)  # not 8: the last token is recomputed
    blocks, num_hit = manager.get_computed_blocks(make_request("c", prompt + [7]))
    assert ([blk.block_id for blk in blocks], num_hit) == ([0, 1], 8)
    blocks, num_hit = manager.get_computed_blocks(make_request("d", prompt[:4] + [0, 0, 0, 0, 0]))
    assert ([blk.block_id for blk in blocks], num_hit) == ([0], 4)
    assert manager.get_computed_blocks(make_request("e", [0] + prompt)) == ([], 0)


def test_hit_blocks_are_shared_and_freed_tail_first():
    manager = KVCacheManager(BlockPool(num_blocks=4, kv_block_size=4))
    prompt = list(range(9))
    a = make_request("a", prompt)
    assert manager.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    manager.cache_blocks(a, 9)

    b = make_request("b", prompt)
    blocks, num_hit = manager.get_computed_blocks(b)
    assert manager.allocate_slots(b, 9 - num_hit, blocks)
    assert manager.block_table("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in manager.pool.blocks] == [2, 2, 1, 1]

    manager.free(a)  # blocks 0 and 1 are still b's; a's own tail block 2 becomes free
    assert manager.pool.free_block_ids() == [2]
    manager.free(b)
    assert manager.pool.free_block_ids() == [2, 3, 1, 0]  # the prefix (0, 1) is evicted last

    c = make_request("c", prompt)  # a hit on free cached blocks takes them out of the free queue
    blocks, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 8
    assert manager.allocate_slots(c, 1, blocks)
    assert manager.block_table("c") == [0, 1, 2]
    assert manager.pool.free_block_ids() == [3]
    manager.free(c)
    manager.pool.assert_all_free()


def test_hit_blocks_that_are_free_count_against_the_free_blocks():
    manager = KVCacheManager(BlockPool(num_blocks=3, kv_block_size=4))
    prompt = list(range(9))
    a = make_request("a", prompt)
    assert manager.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    manager.cache_blocks(a, 9)
    manager.free(a)
    b = make_request("b", prompt + list(range(20, 24)))  # 13 tokens: 2 hit blocks + 2 new ones
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert not manager.allocate_slots(b, 5, blocks)  # 3 blocks free, but 2 of them are the hits
    assert [blk.ref_cnt for blk in manager.pool.blocks] == [0, 0, 0]
    assert manager.pool.num_cached_blocks == 2


def test_cache_blocks_never_hashes_candidates():
    manager = KVCacheManager(BlockPool(num_blocks=4, kv_block_size=4))
    req = make_request("a", range(6))
    req.spec_token_ids = [7, 8]
    assert manager.allocate_slots(req, req.num_tokens_with_spec)
    manager.cache_blocks(req, req.num_tokens_with_spec)  # 8 rows computed, 6 committed
    assert manager.pool.num_cached_blocks == 1
    assert req.block_hashes[4] == hashes_of(list(range(6)), 4)


def test_two_managers_with_different_block_sizes_share_a_request():
    target = KVCacheManager(BlockPool(num_blocks=8, kv_block_size=4))
    draft = KVCacheManager(BlockPool(num_blocks=8, kv_block_size=2))
    req = make_request("a", range(9))
    for manager in (target, draft):
        assert manager.allocate_slots(req, 9)
        manager.cache_blocks(req, 9)
    assert set(req.block_hashes) == {2, 4}
    assert req.block_hashes[2] == hashes_of(list(range(9)), 2)
    assert target.pool.num_cached_blocks == 2 and draft.pool.num_cached_blocks == 4
    assert target.block_table("a") == [0, 1, 2] and draft.block_table("a") == [0, 1, 2, 3, 4]
    other = make_request("b", range(9))
    assert target.get_computed_blocks(other)[1] == 8 and draft.get_computed_blocks(other)[1] == 8


def test_manager_caching_can_be_turned_off():
    manager = KVCacheManager(BlockPool(num_blocks=4, kv_block_size=4))
    manager.enable_caching = False
    req = make_request("a", range(9))
    assert manager.allocate_slots(req, 9)
    manager.cache_blocks(req, 9)
    assert manager.pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)


# ---- configs ----------------------------------------------------------------------------------


def test_cache_config_size_in_gib_or_blocks():
    assert num_blocks_for_size(1.0, 1 << 20) == 1024
    assert CacheConfig(kv_block_size=16, kv_cache_size_gib=0.5).resolve_num_blocks(1 << 20) == 512
    assert CacheConfig(kv_block_size=16, num_blocks=7).resolve_num_blocks(1 << 20) == 7
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(kv_block_size=16, num_blocks=7, kv_cache_size_gib=1.0)
    with pytest.raises(ValueError, match="unset"):
        CacheConfig(kv_block_size=16).resolve_num_blocks(1 << 20)
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_size(1e-9, 1 << 20)
    with pytest.raises(ValueError, match="kv_block_size"):
        CacheConfig(kv_block_size=0, num_blocks=7)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop_strings": [""]}, "stop_strings"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"num_assistant_tokens": -1}, "num_assistant_tokens"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_and_scheduler_config_values():
    params = SamplingParams(max_new_tokens=0, stop_token_ids=[2, 3], stop_strings=["\n\n"])
    assert params.stop_token_ids == (2, 3) and params.stop_strings == ("\n\n",) and params.is_greedy
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=0)
