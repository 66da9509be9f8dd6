"""The KV block pool of one model: block ids, reference counts, an LRU free queue, prefix-cache hashes.

A block holds the keys and values of `kv_block_size` consecutive token positions of one request. The
pool knows nothing about requests or models: the target and the draft each get their own pool (with
their own block size and count), and a `KVCacheManager` maps requests onto blocks.

Prefix caching. A block full of committed tokens is published under a hash that chains over every
token before it (`hash_block_tokens`), so equal hashes mean equal prefixes. When its last user frees
it, a published block keeps its hash and goes to the tail of the free queue: it can still be found
(and taken back out with `touch`) until `get_new_blocks` evicts it from the head, least recently
freed first.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

# A distinct type so that a hash is never confused with a block id or a token id.
BlockHash = NewType("BlockHash", bytes)

# The parent of the first block of every sequence. Fixed rather than random: dflash runs one process
# for one user, and a fixed seed keeps block hashes reproducible across runs.
NONE_HASH = BlockHash(hashlib.sha256(b"dflash/none-hash").digest())


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """The hash of one full block: its tokens, the hash of the block before it, optional extra keys.

    `parent_hash` None means the first block (NONE_HASH is used). `extra_keys` tells apart blocks
    whose tokens are equal but whose KV is not (e.g. a per-request cache salt). sha256 over the whole
    chain makes a collision (two different prefixes with one hash) practically impossible, so a cache
    hit is not re-checked token by token.
    """
    parent = NONE_HASH if parent_hash is None else parent_hash
    payload = pickle.dumps((parent, tuple(int(t) for t in token_ids), extra_keys), protocol=4)
    return BlockHash(hashlib.sha256(payload).digest())


@dataclass(slots=True, eq=False)
class KVBlock:
    """One KV block. ref_cnt counts the requests using it; block_hash is set once it is published."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """A fixed set of KV blocks with an O(1) LRU free queue and a hash -> block prefix-cache index.

    Free blocks sit in an OrderedDict in eviction order (head = evicted first): popping the head,
    appending at the tail and removing a revived block from the middle are all O(1). Block tables stay
    append-only: a block computed twice under one hash is not merged, the second copy simply stays
    unpublished.
    """

    def __init__(self, num_blocks: int, kv_block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or kv_block_size < 1:
            raise ValueError(f"num_blocks and kv_block_size must be >= 1, got {num_blocks}, {kv_block_size}")
        self.num_blocks = num_blocks
        self.kv_block_size = kv_block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses (published ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """The fraction of blocks in use, 0.0 to 1.0."""
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (next evicted first)."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their cached hashes.

        The caller checks `num_free_blocks` first; asking for more is a bug and raises ValueError.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; a block nobody uses goes to the free queue's tail.

        Free in the order blocks should be evicted: the manager passes a request's blocks in
        reverse, so the tail of a chain is evicted before the prefix other requests may share.
        """
        for block in blocks:
            if block.ref_cnt < 1:
                raise RuntimeError(f"KV block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block published under `block_hash`, or None (always None without prefix caching)."""
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Publish blocks[i] under block_hashes[i]; each block must be full of committed tokens.

        Blocks already published are skipped; so is a block whose hash another block already holds
        (the same prefix computed twice): the first copy stays the one found.
        """
        if not self.enable_prefix_caching:
            return
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every published hash; only while no block is in use. Returns whether it did."""
        if self.num_used_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def assert_all_free(self) -> None:
        """Raise AssertionError naming the leaked blocks unless every block is back in the pool."""
        leaked = [b.block_id for b in self.blocks if b.ref_cnt != 0 or b.block_id not in self._free]
        if leaked:
            raise AssertionError(f"{len(leaked)} KV blocks not returned to the pool: {leaked}")

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
