"""DFlash drafting: the draft as a second continuous-batching pipeline beside the target.

The hidden ledger of a request (positions are token positions):

    [0, num_consumed)                     in the draft's KV as context rows (type 0)
    [num_consumed, num_consumed + d)      pending: committed target hidden rows the draft has not read
    num_tokens - 1                        the seed: the newest committed token, no hidden row yet

A window is [pending rows (type 0) ; seed + mask rows (type 1)] at positions num_consumed onward,
so the draft never runs ahead of or skips committed target rows. After the window, num_consumed
grows by d; the block rows stay in the draft's KV only until the next window overwrites them (the
next `past_lens` does not count them), which is how a rejected block is rolled back.

One draft step, after each target step (`DFlashDrafter.step`):

    observe      the verdicts: acceptance for the schedules
    ingest       the committed target hidden rows go to each request's ledger
    plan         each request's schedule says how many candidates it drafts (0 is a choice)
    run          if any request drafts: one packed inference over the windows of the requests that
                 draft (each catches up on the committed rows it has not read, then its block);
                 otherwise none. A request that does not draft keeps its rows pending.
    select       candidates from the candidate rows (argmax, or the DSpark Markov head); for a
                 sampling request with sampled proposals, drawn from each row's distribution after
                 the request's temperature/top-k/top-p (along the Markov walk for DSpark), and kept
                 with the candidates for speculative sampling (core/verification.py)

A request for which the draft's KV cache has no room now waits (its rows stay pending) and drafts
again when other requests give blocks back. A request whose draft cannot go on (it could never fit
the draft's cache, rows missing from the ledger) stops drafting and finishes on the target alone:
its tokens are still the target's own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .adaptive import AdaptiveSchedule, Candidate
from .config import DRAFT_PROPOSALS, SamplingParams
from .draft_runner import BLOCK_ROW, CONTEXT_ROW, DraftInputs, DraftRunner
from .drafter import Candidates, Proposal, TargetStep
from .kv_cache_manager import KVCacheManager
from .markov import MarkovHeadRunner
from .metrics import DraftingStats
from .paged import SequenceSlice
from .request import Request
from .sampler import DRAFT_STREAM, draw_rows, filtered_probs_rows, request_key, uniform
from .schedules import make_schedules

logger = logging.getLogger("dflash")

# A request that does not draft keeps its committed hidden rows until it drafts again; past this
# many bytes of them, the draft runs anyway to read them (context rows only).
MAX_PENDING_BYTES = 64 << 20


@dataclass
class DraftState:
    """The draft's view of one request."""

    num_consumed: int = 0  # target positions whose hidden rows are in the draft's KV
    pending: list[np.ndarray] = field(default_factory=list)  # committed hidden rows after num_consumed
    num_pending: int = 0
    enabled: bool = True

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


def drafts(request: Request) -> bool:
    """Whether the draft follows this request (num_assistant_tokens not 0; greedy or sampling)."""
    return request.sampling_params.num_assistant_tokens != 0


def sample_rows(logits: np.ndarray, params: SamplingParams, key: int, position: int) -> Proposal:
    """Sampled DFlash candidates: one token drawn from each candidate row's distribution after the
    request's temperature, top-k and top-p, kept with those distributions; row i's draw is keyed by the
    output position `position + i` of its candidate. # [k, V] -> Proposal"""
    probs = filtered_probs_rows(logits, params, dtype=np.float32)
    us = np.array([uniform(key, position + i, DRAFT_STREAM) for i in range(len(probs))])
    return Proposal(draw_rows(us, probs), probs)


class DFlashDrafter:
    """Keeps each request's ledger, asks the schedules for candidate counts, drafts them in one pass."""

    def __init__(
        self,
        runner: DraftRunner,
        kv_cache_manager: KVCacheManager,
        *,
        markov: MarkovHeadRunner | None = None,
        markov_top_k: int | None = None,
        proposals: str = "argmax",
    ):
        self.runner = runner
        self.spec = runner.spec
        self.kv_cache_manager = kv_cache_manager
        # A DSpark head picks each candidate after the one before (Top-K lattice, or dense walk with
        # K 0); without one, each candidate row's argmax.
        self.markov = markov
        self.markov_top_k = markov.resolve_top_k(markov_top_k) if markov is not None else 0
        # Under sampling: "argmax" proposes the draft's deterministic candidates (as for greedy),
        # "sampled" draws them from the draft's distributions (core/verification.py).
        if proposals not in DRAFT_PROPOSALS:
            raise ValueError(f"proposals must be one of {', '.join(DRAFT_PROPOSALS)}, got {proposals!r}")
        self.proposals = proposals
        self._keys: dict[str, int] = {}  # per sampling request with sampled proposals: its key (from its seed)
        self.schedules = make_schedules(self.spec.max_candidates)
        self.stats = DraftingStats()
        self.seconds = 0.0  # in draft steps (inference, head and bookkeeping)
        self._states: dict[str, DraftState] = {}
        self._last_target_rows: int | None = None  # rows of the latest target step (a next step of other rows reshapes)
        self.warnings: list[str] = []
        self.num_restored_tokens = 0  # prompt positions restored from the draft's prefix cache
        row_bytes = 4 * runner.hidden_states_width
        self._max_pending_rows = max(1, MAX_PENDING_BYTES // row_bytes)

    @property
    def infer_seconds(self) -> float:
        """Seconds inside the draft's infer() calls (the Markov head's walk counts as host work)."""
        return self.runner.infer_seconds

    @property
    def adaptive(self) -> AdaptiveSchedule:
        return self.schedules["adaptive"]

    # ---- the seam ------------------------------------------------------------------------------

    def prefix_hit_limit(self, request: Request) -> int | None:
        """How much of the request's prompt the draft's cache holds (caps the target's prefix hit)."""
        if not drafts(request):
            return None
        _, num_tokens = self.kv_cache_manager.get_computed_blocks(request)
        return num_tokens

    def forget(self, request: Request) -> None:
        """The request finished or was preempted: its draft blocks go back, its ledger is dropped."""
        self._states.pop(request.req_id, None)
        self._keys.pop(request.req_id, None)
        self.kv_cache_manager.free(request)
        for schedule in self.schedules.values():
            schedule.forget(request.req_id)

    def reset_prefix_cache(self) -> bool:
        """Forget the draft's cached prompt blocks (only while none is in use). Returns whether it did."""
        return self.kv_cache_manager.pool.reset_prefix_cache()

    def step(self, target_step: TargetStep) -> Candidates:
        """Read a target step's committed rows; draft the next step's candidates."""
        start = time.perf_counter()
        self._observe(target_step)
        self._ingest(target_step)
        requests = [r for _, r in target_step.scheduled if r is not None and not r.is_finished]
        reshaped = self._last_target_rows is not None and target_step.num_rows != self._last_target_rows
        self._last_target_rows = target_step.num_rows
        windows = self._plan(requests, max(len(requests), target_step.num_batch), closed=target_step.num_waiting == 0)
        candidates: Candidates = {}
        if windows:
            candidates = self._run(windows)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if target_step.is_generation:
            verified = any(v.num_drafted for v in target_step.verdicts.values())
            self.adaptive.observe_target(target_step.num_rows, target_step.seconds, verified, reshaped,
                                         num_requests=len(target_step.scheduled))  # fmt: skip
        if windows:
            self.stats.num_draft_steps += 1
            context, block = sum(w.num_context for w in windows), sum(w.num_block_rows for w in windows)
            self.adaptive.observe_draft(context, block, sum(w.num_candidates for w in windows), seconds,
                                        shape_rows=self.runner.padded_rows(context + block))  # fmt: skip
        return candidates

    # ---- the ledger --------------------------------------------------------------------------

    def _observe(self, target_step: TargetStep) -> None:
        for _, request in target_step.scheduled:
            verdict = target_step.verdicts.get(request.req_id) if request is not None else None
            if verdict is not None and verdict.num_drafted:
                schedule = self.schedules[request.sampling_params.num_assistant_tokens_schedule]
                schedule.observe_verification(request.req_id, verdict.num_drafted, verdict.num_accepted)

    def _ingest(self, target_step: TargetStep) -> None:
        """Hand each request's newly committed target hidden rows to its ledger."""
        first_row = 0
        for scheduled, request in target_step.scheduled:
            rows = slice(first_row, first_row + scheduled.num_new_tokens)
            first_row += scheduled.num_new_tokens
            if request is None or request.is_finished or not drafts(request):
                continue
            start = scheduled.num_computed_tokens_before
            if request.req_id not in self._states:
                self._start(request, start)
            num_committed = request.num_computed_tokens - start  # rows of rejected candidates excluded
            self._append(request, start, target_step.hidden_states[rows][:num_committed])

    def _start(self, request: Request, first_position: int) -> None:
        """Track a request whose first target rows start at `first_position` (> 0 after a prefix hit)."""
        state = self._states[request.req_id] = DraftState()
        if first_position > 0 and not self._restore_prefix(request, state, first_position):
            self._disable(request, "the draft's prefix cache does not hold the target's cached prompt prefix")

    def _append(self, request: Request, first_position: int, rows: np.ndarray) -> None:
        """Committed target hidden rows for positions [first_position, first_position + len(rows))."""
        state = self._states[request.req_id]
        if not state.enabled:
            return
        skip = state.next_position - first_position  # rows the ledger already has (a recompute)
        if skip < 0:
            self._disable(request, f"target hidden rows {state.next_position}..{first_position} are missing")
            return
        if skip < len(rows):
            state.pending.append(rows[skip:])
            state.num_pending += len(rows) - skip

    # ---- one draft step -------------------------------------------------------------------------

    def _may_draft(self, request: Request) -> bool:
        """Tracked, its ledger caught up with the committed tokens, room for a candidate."""
        state = self._states.get(request.req_id)
        return (
            state is not None
            and state.enabled
            and state.next_position == request.num_tokens - 1
            and request.num_computed_tokens == request.num_tokens - 1
            and request.sampling_params.max_new_tokens - request.num_output_tokens > 1
        )

    def _cap(self, request: Request) -> int:
        wanted = request.sampling_params.num_assistant_tokens
        return self.spec.max_candidates if wanted is None else min(wanted, self.spec.max_candidates)

    def _plan(self, requests: list[Request], num_batch: int, closed: bool) -> list[_Window]:
        """Each schedule decides for its requests (`num_batch`: the batch the adaptive schedule prices
        the step at, `TargetStep.num_batch`; `closed`: no request waits for a place); a window for each
        request that drafts."""
        by_schedule: dict[str, list[Candidate]] = {}
        for request in requests:
            if self._may_draft(request):
                state = self._states[request.req_id]
                name = request.sampling_params.num_assistant_tokens_schedule
                remaining = request.sampling_params.max_new_tokens - request.num_output_tokens
                by_schedule.setdefault(name, []).append(Candidate(request.req_id, self._cap(request), state.num_pending, remaining))
        blocks: dict[str, int] = {}
        for name in ("constant", "heuristic"):
            blocks.update(self.schedules[name].plan(by_schedule.get(name, ())))
        offset = self.spec.candidate_position_offset
        others = [(c.num_pending_rows, k + offset, k) for name in ("constant", "heuristic")
                  for c in by_schedule.get(name, ()) if (k := blocks[c.req_id])]  # fmt: skip
        others = tuple(sum(counts) for counts in zip(*others)) if others else (0, 0, 0)
        blocks.update(self.adaptive.plan(by_schedule.get("adaptive", ()), num_generating=num_batch, candidate_offset=offset,
                                         other_draft_rows=others, last_rows=self._last_target_rows, closed=closed))  # fmt: skip
        self.stats.num_decisions += len(blocks)
        self.stats.num_drafting += sum(1 for k in blocks.values() if k)
        # Only requests that draft read their pending rows (a request that stays paused until it ends
        # never costs the draft anything); past MAX_PENDING_BYTES a request reads them anyway.
        windows = [self._window(r, blocks.get(r.req_id, 0)) for r in requests
                   if blocks.get(r.req_id) or self._pending_is_full(r)]  # fmt: skip
        windows = [w for w in windows if w is not None]
        if blocks and not windows:  # requests that could have drafted, and no draft inference
            self.stats.num_idle_steps += 1
        return windows

    def _pending_is_full(self, request: Request) -> bool:
        state = self._states.get(request.req_id)
        return state is not None and state.enabled and state.num_pending > self._max_pending_rows

    def _window(self, request: Request, block: int) -> _Window | None:
        state = self._states.get(request.req_id)
        if state is None or not state.enabled:
            return None
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
            # Blocks other requests hold come back when they end: wait (the rows stay pending) unless
            # the request could never fit the whole draft cache or has waited too long.
            never_fits = request.max_num_tokens + num_block_rows > self.kv_cache_manager.max_num_tokens
            if never_fits or state.num_pending > self._max_pending_rows:
                self._disable(request, "the draft KV cache is full")
            else:
                self.stats.num_kv_waits += 1
            return None
        return _Window(request, state, state.num_pending, num_candidates, num_block_rows)

    def _run(self, windows: list[_Window]) -> Candidates:
        """One packed inference over the windows; candidates of the requests that drafted."""
        logits = self.runner.run(self._pack(windows))
        drafting, row = [], 0
        for window in windows:
            window.state.num_consumed += window.num_context
            window.state.pending, window.state.num_pending = [], 0
            self._publish_prompt_blocks(window.request, window.state)
            if window.num_candidates:
                drafting.append((window.request, logits[row : row + window.num_candidates]))
                row += window.num_candidates
        return self._select(drafting)

    def _select(self, drafting: list[tuple[Request, np.ndarray]]) -> Candidates:
        """Each request's candidates from its candidate rows' logits [k, vocab]: deterministic
        (tuples), or drawn from the draft's distributions (Proposals) for sampled proposals."""
        sampling = [self._sampling(request) for request, _ in drafting]
        if self.markov is None:
            candidates: Candidates = {}
            for (request, logits), how in zip(drafting, sampling):
                if how is None:
                    candidates[request.req_id] = tuple(int(t) for t in self.runner.token_ids(logits))
                else:
                    candidates[request.req_id] = sample_rows(self.runner.full_logits(logits), *how)
            return candidates
        # The token before the first candidate row is the seed/anchor: the newest committed token.
        picked = self.markov.select_candidates(
            [logits for _, logits in drafting], [request.all_token_ids[-1] for request, _ in drafting], self.markov_top_k,
            sampling=sampling, vocab_ids=self.runner.vocab_ids,
        )  # fmt: skip
        return {request.req_id: tokens if isinstance(tokens, Proposal) else tuple(tokens)
                for (request, _), tokens in zip(drafting, picked)}  # fmt: skip

    def _sampling(self, request: Request) -> tuple[SamplingParams, int, int] | None:
        """How to draw a request's candidates: None for deterministic ones (greedy requests, and
        every request with argmax proposals), else its params, its key and the output position of
        its first candidate (the draws are keyed by position: sampler.uniform)."""
        params = request.sampling_params
        if params.is_greedy or self.proposals != "sampled":
            return None
        key = self._keys.get(request.req_id)
        if key is None:
            key = self._keys[request.req_id] = request_key(params.seed)
        return params, key, request.num_output_tokens

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
        padding = self.runner.padding(row)
        if padding is not None:  # steady shapes (draft_runner.ROW_BUCKET): rows no request reads
            seqs.append(padding)
            token_ids += [self.spec.mask_token_id] * padding.num_new_rows
            token_types += [CONTEXT_ROW] * padding.num_new_rows
            hidden.append(np.zeros((padding.num_new_rows, width), dtype=np.float32))
        return DraftInputs(
            seqs=seqs,
            token_ids=np.asarray(token_ids, dtype=np.int64),  # [num_tokens]
            token_type_ids=np.asarray(token_types, dtype=np.int64),  # [num_tokens]
            hidden_states=np.concatenate(hidden, axis=0).astype(np.float32, copy=False),  # [num_tokens, k*H]
            candidate_rows=np.asarray(candidate_rows, dtype=np.int64),  # [num_candidates]
        )

    # ---- prefix caching -----------------------------------------------------------------------

    def _restore_prefix(self, request: Request, state: DraftState, num_tokens: int) -> bool:
        kv_block_size = self.kv_cache_manager.kv_block_size
        blocks, hit = self.kv_cache_manager.get_computed_blocks(request)
        if num_tokens % kv_block_size or hit < num_tokens:
            return False
        if not self.kv_cache_manager.allocate_slots(request, 0, blocks[: num_tokens // kv_block_size], num_computed_tokens=0):
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
