"""DFlash drafting: the draft as a second continuous-batching pipeline beside the target.

The hidden ledger of a request (positions are token positions):

    [0, num_consumed)                     in the draft's KV as context rows (type 0)
    [num_consumed, num_consumed + d)      pending: committed target hidden rows the draft has not read
    num_tokens - 1                        the seed: the newest committed token, no hidden row yet

A window is [pending rows (type 0) ; seed + mask rows (type 1)] at positions num_consumed onward,
so the draft never runs ahead of or skips committed target rows. After the window, num_consumed
grows by d; the block rows stay in the draft's KV only until the next window overwrites them (the
next `past_lens` does not count them), which is how a rejected block is rolled back.

A request whose draft cannot go on (draft cache full, rows missing from the ledger) stops drafting
and finishes on the target alone: its tokens are still the target's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from .adaptive import AdaptiveBlockSize
from .draft_runner import BLOCK_ROW, CONTEXT_ROW, DraftInputs, DraftRunner
from .kv_cache_manager import KVCacheManager
from .markov import MarkovHeadRunner
from .paged import SequenceSlice
from .request import Request

logger = logging.getLogger("dflash")


@dataclass
class DraftState:
    """The draft's view of one request."""

    num_consumed: int = 0  # target positions whose hidden rows are in the draft's KV
    pending: list[np.ndarray] = field(default_factory=list)  # committed hidden rows after num_consumed
    num_pending: int = 0
    enabled: bool = True
    num_assistant_tokens: int | None = None  # the "heuristic" schedule's current value

    @property
    def next_position(self) -> int:
        """The position whose hidden row the ledger expects next."""
        return self.num_consumed + self.num_pending


@dataclass
class _Window:
    request: Request
    state: DraftState
    num_context: int
    num_candidates: int
    num_block_rows: int


class DFlashProposer:
    """Plans one draft window per request, runs them in one packed inference, returns candidates."""

    def __init__(
        self,
        runner: DraftRunner,
        kv_cache_manager: KVCacheManager,
        *,
        markov: MarkovHeadRunner | None = None,
        markov_top_k: int | None = None,
    ):
        self.runner = runner
        self.spec = runner.spec
        self.kv_cache_manager = kv_cache_manager
        # A DSpark head picks each candidate after the one before (Top-K lattice, or dense walk with
        # K 0); without one, each candidate row's argmax.
        self.markov = markov
        self.markov_top_k = markov.resolve_top_k(markov_top_k) if markov is not None else 0
        self._states: dict[str, DraftState] = {}
        self.warnings: list[str] = []
        self.num_restored_tokens = 0  # prompt positions restored from the draft's prefix cache
        self.adaptive = AdaptiveBlockSize()  # the "adaptive" schedule's acceptance and cost figures
        self.last_inference = (0, 0.0)  # (rows, seconds) of the latest propose() (0 rows: it ran none)

    # ---- the ledger --------------------------------------------------------------------------

    def start(self, request: Request, first_position: int) -> None:
        """Track a request whose first target rows start at `first_position` (> 0 after a prefix hit)."""
        state = self._states[request.req_id] = DraftState()
        if first_position > 0 and not self._restore_prefix(request, state, first_position):
            self._disable(request, "the draft's prefix cache does not hold the target's cached prompt prefix")

    def ingest(self, request: Request, first_position: int, rows: np.ndarray) -> None:
        """Committed target hidden rows for positions [first_position, first_position + len(rows))."""
        state = self._states.get(request.req_id)
        if state is None or not state.enabled:
            return
        skip = state.next_position - first_position  # rows the ledger already has (a recompute)
        if skip < 0:
            self._disable(request, f"target hidden rows {state.next_position}..{first_position} are missing")
            return
        if skip < len(rows):
            state.pending.append(rows[skip:])
            state.num_pending += len(rows) - skip

    def forget(self, request: Request) -> None:
        """The request finished or was preempted: its draft blocks go back, its ledger is dropped."""
        self._states.pop(request.req_id, None)
        self.kv_cache_manager.free(request)

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._states

    # ---- one draft step -------------------------------------------------------------------------

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Run every request's window in one inference; candidates per request that drafted."""
        windows = [w for w in (self._plan(r) for r in requests) if w is not None]
        self.last_inference = (0, 0.0)
        if not windows:
            return {}
        inputs = self._pack(windows)
        start = time.perf_counter()
        logits = self.runner.run(inputs)
        self.last_inference = (len(inputs.token_ids), time.perf_counter() - start)
        drafting, row = [], 0
        for window in windows:
            window.state.num_consumed += window.num_context
            window.state.pending, window.state.num_pending = [], 0
            self._publish_prompt_blocks(window.request, window.state)
            if window.num_candidates:
                drafting.append((window.request, logits[row : row + window.num_candidates]))
                row += window.num_candidates
        return self._select(drafting)

    def _select(self, drafting: list[tuple[Request, np.ndarray]]) -> dict[str, list[int]]:
        """Each request's candidates from its candidate rows' logits [k, vocab]."""
        if self.markov is None:
            return {request.req_id: [int(t) for t in logits.argmax(axis=-1)] for request, logits in drafting}
        # The token before the first candidate row is the seed/anchor: the newest committed token.
        picked = self.markov.select_candidates(
            [logits for _, logits in drafting], [request.all_token_ids[-1] for request, _ in drafting], self.markov_top_k
        )
        return {request.req_id: tokens for (request, _), tokens in zip(drafting, picked)}

    def block_size(self, request: Request) -> int:
        """Mask rows of the request's draft block: num_assistant_tokens (default: all a block yields),
        capped by the block. 0 for requests that do not draft (sampling, num_assistant_tokens=0)."""
        params = request.sampling_params
        if not params.is_greedy:
            return 0  # acceptance compares with the target's greedy tokens
        wanted = params.num_assistant_tokens
        wanted = self.spec.max_candidates if wanted is None else min(wanted, self.spec.max_candidates)
        if params.num_assistant_tokens_schedule == "adaptive" and wanted:
            return self.adaptive.block_size(wanted)
        if params.num_assistant_tokens_schedule == "heuristic" and wanted:
            state = self._states.get(request.req_id)
            if state is not None and state.num_assistant_tokens is not None:
                return state.num_assistant_tokens
        return wanted

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """After verification: acceptance for the "adaptive" schedule; the "heuristic" schedule grows
        the block by 2 when every candidate was accepted and shrinks it by 1 (not below 1) otherwise,
        within the draft's block."""
        self.adaptive.observe_verification(num_drafted, num_accepted)
        state = self._states.get(request.req_id)
        if state is None or request.sampling_params.num_assistant_tokens_schedule != "heuristic":
            return
        current = self.block_size(request)
        grown = current + 2 if num_accepted >= num_drafted else current - 1
        state.num_assistant_tokens = max(1, min(grown, self.spec.max_candidates))

    def _plan(self, request: Request) -> _Window | None:
        state = self._states.get(request.req_id)
        if state is None or not state.enabled or request.is_finished:
            return None
        caught_up = state.next_position == request.num_tokens - 1 and request.num_computed_tokens == request.num_tokens - 1
        block = self.block_size(request) if caught_up else 0
        # Verified: only as many as leave room in max_new_tokens for the accepted ones plus the bonus.
        # The block keeps all its mask rows even so: they attend to each other, so a shorter block
        # would draft different candidates.
        room = request.sampling_params.max_new_tokens - request.num_output_tokens - 1
        num_candidates = max(0, min(block, room))
        num_block_rows = block + self.spec.candidate_position_offset if num_candidates else 0
        num_rows = state.num_pending + num_block_rows
        if num_rows == 0:
            return None
        if not self.kv_cache_manager.allocate_slots(request, num_rows, num_computed_tokens=state.num_consumed):
            self._disable(request, "the draft KV cache is full")
            return None
        return _Window(request, state, state.num_pending, num_candidates, num_block_rows)

    def _pack(self, windows: list[_Window]) -> DraftInputs:
        seqs, token_ids, token_types, hidden, candidate_rows = [], [], [], [], []
        width = self.runner.hidden_states_width
        row = 0
        for w in windows:
            seqs.append(SequenceSlice(w.state.num_consumed, w.num_context + w.num_block_rows,
                                      self.kv_cache_manager.block_table(w.request.req_id)))  # fmt: skip
            # Context rows: only their hidden states matter; block rows: only their tokens.
            token_ids += [self.spec.mask_token_id] * w.num_context
            token_types += [CONTEXT_ROW] * w.num_context
            hidden += w.state.pending
            if w.num_block_rows:
                seed = w.request.all_token_ids[-1]
                token_ids += [seed] + [self.spec.mask_token_id] * (w.num_block_rows - 1)
                token_types += [BLOCK_ROW] * w.num_block_rows
                hidden.append(np.zeros((w.num_block_rows, width), dtype=np.float32))
                first = row + w.num_context + self.spec.candidate_position_offset
                candidate_rows += range(first, first + w.num_candidates)
            row += w.num_context + w.num_block_rows
        return DraftInputs(
            seqs=seqs,
            token_ids=np.asarray(token_ids, dtype=np.int64),  # [num_tokens]
            token_type_ids=np.asarray(token_types, dtype=np.int64),  # [num_tokens]
            hidden_states=np.concatenate(hidden, axis=0).astype(np.float32, copy=False),  # [num_tokens, k*H]
            candidate_rows=np.asarray(candidate_rows, dtype=np.int64),  # [num_candidates]
        )

    # ---- prefix caching -----------------------------------------------------------------------

    def prefix_hit_tokens(self, request: Request) -> int:
        """How much of the request's prompt the draft's cache holds (caps the target's prefix hit)."""
        _, num_tokens = self.kv_cache_manager.get_computed_blocks(request)
        return num_tokens

    def _restore_prefix(self, request: Request, state: DraftState, num_tokens: int) -> bool:
        block_size = self.kv_cache_manager.block_size
        blocks, hit = self.kv_cache_manager.get_computed_blocks(request)
        if num_tokens % block_size or hit < num_tokens:
            return False
        if not self.kv_cache_manager.allocate_slots(request, 0, blocks[: num_tokens // block_size], num_computed_tokens=0):
            return False
        state.num_consumed = num_tokens
        self.num_restored_tokens += num_tokens
        return True

    def _publish_prompt_blocks(self, request: Request, state: DraftState) -> None:
        # Draft KV past the prompt may hold block rows of rejected candidates: only prompt blocks are
        # published, and only once their rows are context rows.
        self.kv_cache_manager.cache_blocks(request, min(state.num_consumed, request.num_prompt_tokens))

    # ---- giving up -------------------------------------------------------------------------------

    def _disable(self, request: Request, reason: str) -> None:
        state = self._states.get(request.req_id)
        if state is not None:
            state.enabled = False
            state.pending, state.num_pending = [], 0
        self.kv_cache_manager.free(request)
        message = f"request {request.req_id}: {reason}; it finishes on the target alone"
        self.warnings.append(message)
        logger.warning(message)
