"""The caches of a hybrid target: KV blocks for its attention layers, state blocks for its linear ones.

Qwen3.5's GatedDeltaNet layers keep, per sequence, a recurrent state and a causal-convolution window
instead of one KV row per token: one state block (core/state_pool.py), read and written whole by every
call. The scheduler drives this manager as it drives a plain `KVCacheManager`; the hooks the plain one
leaves empty do the rest, so the step loop has no branch for hybrid targets:

    allocate_slots     besides the KV slots: a zeroed committed state block when the request holds
                       none (admission, or re-admission after preemption by recompute: the recompute
                       rebuilds the state from position 0), and one checkpoint block per row when the
                       rows verify candidates
    limit_spec_tokens  a verification of n rows needs n checkpoints: verify only as many candidates as
                       the free state blocks allow (fewer candidates verified is still exact)
    state_inputs       the call's `la.*` inputs: per sequence [c, c] (interval 0: read the committed
                       block, write the final state back) or [c, t1..tn] (interval 1: the state after
                       row k goes to checkpoint t_k, c is left alone)
    commit_state       after the step is booked: the checkpoint of the last kept row (seed + accepted
                       candidates) becomes the committed block, the others are freed. Rejected rows
                       leave no trace in the state, as the KV side forgets them through past_lens.
    free               the committed block and any checkpoints go back (finish, abort, preemption)

This is openvino.genai's scheme (checkpoints per verified row, promotion of the accepted one).
Prefix caching is not supported: a prefix hit would need the state at a block boundary
(`la.cache_interval` N); the loader refuses it for hybrid targets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .block_pool import BlockPool, KVBlock
from .kv_cache_manager import KVCacheManager
from .request import Request
from .state_pool import StatePool


class HybridCacheManager(KVCacheManager):
    """A `KVCacheManager` whose requests also hold linear-attention state blocks from `state_pool`."""

    def __init__(self, pool: BlockPool, state_pool: StatePool):
        if pool.enable_prefix_caching:
            raise ValueError("prefix caching is not supported for hybrid linear-attention targets")
        super().__init__(pool)
        self.state_pool = state_pool

    def limit_spec_tokens(self, request: Request, num_spec: int) -> int:
        """As many of `num_spec` candidates as free state blocks give checkpoints for (every row needs one)."""
        if not num_spec:
            return 0
        rows_before = request.num_tokens - request.num_computed_tokens  # the seed (and any prompt rows)
        free = self.state_pool.num_free
        return num_spec if rows_before + num_spec <= free else max(0, free - rows_before)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] | None = None,
        num_computed_tokens: int | None = None,
    ) -> bool:
        """KV slots as the plain manager gives them, plus the state blocks the rows need; False (and no
        change) when either pool is short."""
        req_id, pool = request.req_id, self.state_pool
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_checkpoints = num_new_tokens if computed + num_new_tokens > request.num_tokens else 0
        needs_committed = not pool.owns(req_id)
        if not (needs_committed or num_checkpoints or pool.has_checkpoints(req_id)):
            # A prompt chunk or a plain decode step of a request that holds its block: KV only.
            return super().allocate_slots(request, num_new_tokens, new_computed_blocks, num_computed_tokens)
        pool.release_checkpoints(req_id)  # any left by a step that was never booked (a failed inference)
        if not pool.can_allocate(needs_committed + num_checkpoints):
            return False
        if not super().allocate_slots(request, num_new_tokens, new_computed_blocks, num_computed_tokens):
            return False
        if needs_committed:
            pool.allocate(req_id)  # zeroed: la.past_lens 0 does not reset a state
        if num_checkpoints:
            pool.reserve_checkpoints(req_id, num_checkpoints)
        return True

    def state_inputs(self, scheduled: Sequence) -> dict[str, np.ndarray]:
        """The `la.*` inputs of one call, for the ScheduledRequests in packing order."""
        blocks, begins, intervals = self.state_pool.pack([s.req_id for s in scheduled])
        return {
            "la.block_indices": blocks,  # [sum of (1 + blocks written)] i32
            "la.block_indices_begins": begins,  # [num_seqs + 1]
            "la.past_lens": np.array([s.num_computed_tokens_before for s in scheduled], dtype=np.int32),  # [num_seqs]
            "la.cache_interval": intervals,  # [num_seqs]
        }

    def commit_state(self, request: Request, scheduled) -> None:
        """After the scheduler booked the step: keep the state after the rows it counted as computed."""
        kept = request.num_computed_tokens - scheduled.num_computed_tokens_before
        if self.state_pool.has_checkpoints(request.req_id):
            if kept >= 1:
                self.state_pool.promote(request.req_id, kept)
            else:
                self.state_pool.release_checkpoints(request.req_id)  # nothing kept: c still holds the state
        elif kept != scheduled.num_new_tokens:
            # Interval 0 wrote the state after every row into c: it must all have been kept.
            raise RuntimeError(
                f"request {request.req_id!r}: {kept} of {scheduled.num_new_tokens} rows kept without checkpoints"
            )

    def free(self, request: Request) -> None:
        super().free(request)
        self.state_pool.free(request.req_id)
