"""Linear-attention state blocks of a hybrid target (Qwen3.5): a pool of its own, beside the KV pools.

NOT WIRED INTO THE ENGINE YET (issue 17; `TargetRunner` still refuses hybrid targets). It holds the
bookkeeping that docs/hybrid-targets.md §5 plans, with the behaviour measured there:

- One state block is one slot in every `conv_state_table.N` and `gated_delta_state_table.N` of the
  paged model (the same id in each). It does not grow with tokens: a request owns one committed
  block for its whole life.
- `la.past_lens = 0` does not reset a state: a committed block is zeroed when it is handed out
  (`allocate`, through the `zero` callback that writes the tables).
- Speculative verification of n rows reads the committed block c and writes the state after row k
  into checkpoint t_k (`la.cache_interval` 1, `la.block_indices` [c, t1..tn]); c is left alone.
  Checkpoints are written whole, so they are not zeroed. After acceptance, `promote(req, k)` makes
  t_k the committed block (k = seed + accepted candidates) and frees the old one and the others;
  `release` frees them all (abort, finish, or a step that ran no verification).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import InputError

ZeroBlock = Callable[[int], None]


@dataclass
class _Owned:
    committed: int
    checkpoints: list[int] = field(default_factory=list)


class StatePool:
    """A free list of `num_blocks` state-block ids and, per request, its committed block and checkpoints."""

    def __init__(self, num_blocks: int, zero: ZeroBlock | None = None):
        if num_blocks <= 0:
            raise InputError(f"a linear-attention state pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._owned: dict[str, _Owned] = {}
        self._zero = zero or (lambda _block: None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int = 1) -> bool:
        return len(self._free) >= count

    def allocate(self, req_id: str) -> int:
        """Hand `req_id` a zeroed committed block (admission, or a recompute after preemption)."""
        if req_id in self._owned:
            raise ValueError(f"request {req_id} already owns state block {self._owned[req_id].committed}")
        block = self._take(1)[0]
        self._zero(block)
        self._owned[req_id] = _Owned(committed=block)
        return block

    def committed(self, req_id: str) -> int:
        return self._owned[req_id].committed

    def reserve_checkpoints(self, req_id: str, count: int) -> list[int]:
        """`count` checkpoint blocks for a verification of `count` rows (seed + candidates)."""
        owned = self._owned[req_id]
        if owned.checkpoints:
            raise ValueError(f"request {req_id} still holds checkpoints of an earlier step")
        owned.checkpoints = self._take(count)
        return list(owned.checkpoints)

    def la_block_indices(self, req_id: str) -> tuple[list[int], int]:
        """This request's `la.block_indices` and `la.cache_interval` for the coming call."""
        owned = self._owned[req_id]
        if owned.checkpoints:
            return [owned.committed, *owned.checkpoints], 1
        return [owned.committed, owned.committed], 0

    def promote(self, req_id: str, rows_kept: int) -> int:
        """Keep the state after `rows_kept` verified rows (1-based checkpoint); free the rest."""
        owned = self._owned[req_id]
        if not 1 <= rows_kept <= len(owned.checkpoints):
            raise ValueError(f"checkpoint {rows_kept} of {len(owned.checkpoints)} reserved for {req_id}")
        kept = owned.checkpoints.pop(rows_kept - 1)
        self._free.extend([owned.committed, *owned.checkpoints])
        owned.committed, owned.checkpoints = kept, []
        return kept

    def release_checkpoints(self, req_id: str) -> None:
        owned = self._owned.get(req_id)
        if owned is not None:
            self._free.extend(owned.checkpoints)
            owned.checkpoints = []

    def free(self, req_id: str) -> None:
        """Everything `req_id` holds goes back (finish, abort, preemption)."""
        owned = self._owned.pop(req_id, None)
        if owned is not None:
            self._free.extend([owned.committed, *owned.checkpoints])

    def _take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"linear-attention state pool exhausted: {count} blocks wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]
