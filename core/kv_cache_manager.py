"""Maps requests onto the blocks of one KV pool: block tables, prefix-cache hits, publishing, freeing.

One manager per model cache. The target's manager is driven by the scheduler; the draft's (its own
pool, block size and count) is driven by the engine, whose draft ledger differs from the target's
`num_computed_tokens`, which is why `allocate_slots` takes an explicit count.

Block layout of one request in a verify step (block size 4): committed tokens t0..t5 with KV
for t0..t4, so the rows are the seed t5 and the candidates c1..c3:

    | t0 t1 t2 t3 | t4 t5 c1 c2 | c3 .  .  .  |
      KV computed      ^ rows start at num_computed_tokens = 5

If c1 is accepted and c2, c3 are rejected, c1 and a bonus token are committed and
num_computed_tokens becomes 5 + 4 - 2 = 7. The third block stays in the table: the next step's rows
start at position 7 and overwrite the rejected slots.

Only blocks full of committed tokens whose KV is computed are ever published.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from dflash.core.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block lists over one `BlockPool`, keyed by req_id.

    `enable_caching` starts as the pool's prefix-caching flag; set it False to stop this manager
    finding or publishing prefix blocks (e.g. to measure without cache reuse).
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.kv_block_size = pool.kv_block_size
        self.enable_caching = pool.enable_prefix_caching
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks of a request already published

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def max_num_tokens(self) -> int:
        """The most token positions one request could ever hold: the whole pool."""
        return self.pool.num_blocks * self.kv_block_size

    def block_table(self, req_id: str) -> list[int]:
        """The request's block ids in position order (empty if it holds none)."""
        return [block.block_id for block in self._req_blocks.get(req_id, ())]

    def num_blocks_of(self, req_id: str) -> int:
        return len(self._req_blocks.get(req_id, ()))

    def get_computed_blocks(self, request: Request, *, limit: int | None = None) -> tuple[list[KVBlock], int]:
        """The longest published prefix of the request's committed tokens: (blocks, num tokens).

        For a request that holds no blocks (a waiting one). The hit is capped at num_tokens - 1:
        the last token is always computed again, because its row yields the logits to sample from.
        Nothing is reserved here; pass the blocks to `allocate_slots` before anything else touches
        the pool.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.kv_block_size
        if limit is not None:  # the caller's cap, in tokens
            max_hit_blocks = min(max_hit_blocks, limit // self.kv_block_size)
        blocks: list[KVBlock] = []
        for block_hash in self._block_hashes(request)[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.kv_block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] | None = None,
        num_computed_tokens: int | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` rows after the computed ones; False (and no change) if full.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`, appended first and
        referenced. `num_computed_tokens` defaults to the request's (the target ledger); the draft
        manager passes its own. Blocks beyond what is needed (left by rolled-back candidates) are
        kept and reused.
        """
        new_computed_blocks = list(new_computed_blocks or ())
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        req_blocks = self._req_blocks.get(request.req_id, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {request.req_id} already holds blocks; cache hits are for admission")
        num_total = num_computed_tokens + len(new_computed_blocks) * self.kv_block_size + num_new_tokens
        num_needed = _cdiv(num_total, self.kv_block_size) - len(req_blocks) - len(new_computed_blocks)
        # Hit blocks that sit in the free queue stop being free once referenced.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        self.pool.touch(new_computed_blocks)  # before get_new_blocks, so the hits are not evicted
        req_blocks = req_blocks + new_computed_blocks + self.pool.get_new_blocks(max(num_needed, 0))
        self._req_blocks[request.req_id] = req_blocks
        if new_computed_blocks:
            self._num_published[request.req_id] = len(new_computed_blocks)
        return True

    def cache_blocks(self, request: Request, num_committed_tokens: int) -> None:
        """Publish the request's full blocks among its first `num_committed_tokens` tokens.

        The count is capped at the committed tokens, so candidates are never hashed. The target's
        scheduler calls this after every step; for the draft the engine calls it for prompt blocks.
        """
        if not self.enable_caching:
            return
        req_blocks = self._req_blocks.get(request.req_id, [])
        num_full = min(num_committed_tokens, request.num_tokens) // self.kv_block_size
        num_full = min(num_full, len(req_blocks))
        num_published = self._num_published.get(request.req_id, 0)
        if num_full <= num_published:
            return
        block_hashes = self._block_hashes(request)
        self.pool.cache_full_blocks(
            req_blocks[num_published:num_full], block_hashes[num_published:num_full]
        )
        self._num_published[request.req_id] = num_full

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so a shared prefix outlives the tail in the cache."""
        req_blocks = self._req_blocks.pop(request.req_id, [])
        self._num_published.pop(request.req_id, None)
        self.pool.free_blocks(reversed(req_blocks))

    # ---- linear-attention state: hooks a hybrid target's manager fills in (core/hybrid_cache.py) --------

    def limit_spec_tokens(self, request: Request, num_spec: int) -> int:
        """How many of `num_spec` candidates the cache lets the next step verify: all of them here."""
        return num_spec

    def state_inputs(self, scheduled: Sequence) -> dict:
        """Extra inputs of the target call for these ScheduledRequests: none here."""
        return {}

    def commit_state(self, request: Request, scheduled) -> None:
        """Called once the scheduler booked a step of `request`: nothing to do here."""

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of every full committed block, computed once per block and kept on the request."""
        hashes = request.block_hashes.setdefault(self.kv_block_size, [])
        tokens = request.all_token_ids
        for start in range(len(hashes) * self.kv_block_size, len(tokens) - self.kv_block_size + 1, self.kv_block_size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start : start + self.kv_block_size]))
        return hashes
