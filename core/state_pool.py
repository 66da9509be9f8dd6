"""Linear-attention state blocks of a hybrid target (Qwen3.5): a pool of its own, beside the KV pools.

`core/hybrid_cache.py` drives it for the engine (admission, verification, promotion, freeing); the
behaviour it relies on was measured against transformers (docs/hybrid-targets.md §3):

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from .errors import InputError, ModelFormatError

ZeroBlock = Callable[[int], None]

# Model inputs `paged_attention_transformation` adds for linear-attention (GatedDeltaNet, causal conv)
# layers: the paging of the state blocks, and one table of state blocks per layer and kind.
LA_INPUTS = ("la.block_indices", "la.block_indices_begins", "la.past_lens", "la.cache_interval")
STATE_TABLE_PREFIXES = ("conv_state_table.", "gated_delta_state_table.")
# rt_info of an exported hybrid target whose rotary embedding reads `position_ids` (exporters/hybrid.py):
# without it every row of a packed call gets the position of the last row (wrong tokens).
ROPE_FROM_POSITION_IDS = "dflash/rope_from_position_ids"


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

    def owns(self, req_id: str) -> bool:
        return req_id in self._owned

    def has_checkpoints(self, req_id: str) -> bool:
        owned = self._owned.get(req_id)
        return owned is not None and bool(owned.checkpoints)

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

    def pack(self, req_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`la.block_indices`, `la.block_indices_begins` and `la.cache_interval` (i32) of one call
        over these requests, in order (`la_block_indices` of each, concatenated)."""
        blocks, begins, intervals = [], [0], []
        for req_id in req_ids:
            owned = self._owned[req_id]
            if owned.checkpoints:
                blocks.append(owned.committed)
                blocks.extend(owned.checkpoints)
                intervals.append(1)
            else:
                blocks.extend((owned.committed, owned.committed))
                intervals.append(0)
            begins.append(len(blocks))
        return (np.array(blocks, dtype=np.int32), np.array(begins, dtype=np.int32), np.array(intervals, dtype=np.int32))

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


def state_table_names(other_inputs: Sequence[str], model: ov.Model) -> list[str]:
    """The state tables of a converted hybrid target ([] for a pure-attention one).

    Refuses a hybrid target whose rotary embedding does not read `position_ids` (optimum-intel's own
    export, not `dflash export`'s): it would give wrong tokens for every packed row but the last.
    """
    tables = [name for name in other_inputs if name.startswith(STATE_TABLE_PREFIXES)]
    if not tables and not any(name in LA_INPUTS for name in other_inputs):
        return []
    missing = [name for name in LA_INPUTS if name not in other_inputs]
    if missing or not tables:
        raise ModelFormatError(
            f"hybrid linear-attention target with an unexpected PagedAttention layout (missing {', '.join(missing) or 'state tables'})",
            "export it with `dflash export` on openvino 2026.4.1 (docs/hybrid-targets.md)",
        )
    if not model.has_rt_info(ROPE_FROM_POSITION_IDS):
        raise ModelFormatError(
            "this hybrid linear-attention target takes its rotary positions from its KV length, not position_ids: "
            "packed rows would get wrong positions",
            "re-export it with `dflash export`, which rewires them (docs/hybrid-targets.md §2)",
        )
    return tables


class StateTables:
    """The state tables of a compiled hybrid target: one [num_blocks, ...] tensor per linear-attention
    layer and kind (conv window, recurrent state), allocated once and bound to the infer request (the
    plugin reads and writes them in place). Block b is row b of every table."""

    def __init__(self, compiled: ov.CompiledModel, names: Sequence[str]):
        self._specs = []
        for name in names:
            port = compiled.input(name)
            shape = port.get_partial_shape()
            if shape[1:].is_dynamic:
                raise ModelFormatError(f"state table {name} has no static block shape after compiling: {shape}")
            self._specs.append((name, port.get_element_type(), tuple(d.get_length() for d in shape[1:])))
        self._tensors: list[ov.Tensor] = []
        self._rows: list[np.ndarray] = []  # per table, its bytes as [num_blocks, bytes per block]
        self.num_blocks = 0

    @property
    def bytes_per_block(self) -> int:
        """Memory one state block costs across every table."""
        return sum((int(np.prod(shape)) * elem_type.bitwidth + 7) // 8 for _, elem_type, shape in self._specs)

    def allocate(self, request: ov.InferRequest, num_blocks: int) -> None:
        self._tensors, self._rows = [], []
        for name, elem_type, shape in self._specs:
            tensor = ov.Tensor(elem_type, ov.Shape([num_blocks, *shape]))
            rows = np.frombuffer(tensor.data.data, dtype=np.uint8).reshape(num_blocks, -1)  # bytes: any element type
            rows[:] = 0
            request.set_tensor(name, tensor)
            self._tensors.append(tensor)
            self._rows.append(rows)
        self.num_blocks = num_blocks

    def zero(self, block: int) -> None:
        for rows in self._rows:
            rows[block] = 0
