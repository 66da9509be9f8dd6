"""Who runs this step and with how many rows: token budget, chunked prefill, admission, preemption.

There is no prefill phase and no decode phase here, only token accounting: each request has
`num_computed_tokens` (KV in the cache) and `num_tokens_with_spec` (committed tokens plus draft
candidates), and a step gives it rows from the first towards the second. A whole prompt, a prompt
chunk, a recompute after preemption and a [seed; candidates] verify window are all the same thing.

One step of the engine:

    sched_out = scheduler.schedule()
    ... one packed inference over sched_out.scheduled, sampling / acceptance ...
    scheduler.update_from_output(sched_out, new_token_ids, num_rejected)
    ... the engine checks stop rules and calls scheduler.finish_request(...) ...

Policy (FCFS): running requests first, in admission order, then waiting ones while the token budget,
max_num_seqs and the KV cache allow. When a running request cannot get blocks, the most recently
admitted running request is preempted by recompute (its KV freed, requeued at the front) until the
allocation fits or the request itself is the victim.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dflash.core.config import SchedulerConfig
from dflash.core.kv_cache_manager import KVCacheManager
from dflash.core.request import Request, RequestStatus, default_finish_reason


@dataclass(slots=True)
class ScheduledRequest:
    """The rows one request runs this step: positions [num_computed_tokens_before, + num_new_tokens).

    is_prefill_chunk: the rows include committed tokens before the last one (a prompt, a prompt
        chunk or a recompute), as opposed to a [seed; candidates] generation window.
    samples: the rows reach the end of the committed tokens, so logits are needed: for the last
        `1 + num_spec_tokens` rows (the seed row, then one row per candidate).
    num_spec_tokens: how many of the rows are draft candidates (always the last ones): the first
        num_spec_tokens of the request's spec_token_ids.
    """

    req_id: str
    num_new_tokens: int
    num_computed_tokens_before: int
    is_prefill_chunk: bool
    samples: bool
    num_spec_tokens: int = 0

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits the step needs (counted from the end of the rows)."""
        return 1 + self.num_spec_tokens if self.samples else 0


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs. The runner packs `scheduled` in this order into one inference."""

    scheduled: list[ScheduledRequest]
    # Requests whose KV was freed this step; they recompute from scratch when readmitted.
    preempted_req_ids: list[str]
    # Requests finished since the previous schedule() (any reason): drop per-request state for them.
    finished_req_ids: set[str]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class _Step:
    """A step being built: what is scheduled so far and the budget left."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    def add(self, request: Request, num_new_tokens: int) -> None:
        before = request.num_computed_tokens
        end = before + num_new_tokens
        self.scheduled.append(
            ScheduledRequest(
                req_id=request.req_id,
                num_new_tokens=num_new_tokens,
                num_computed_tokens_before=before,
                is_prefill_chunk=before < request.num_tokens - 1,
                samples=end >= request.num_tokens,
                num_spec_tokens=max(0, end - request.num_tokens),
            )
        )
        self.budget -= num_new_tokens
        self.num_batched_tokens += num_new_tokens


class Scheduler:
    """Holds the waiting queue and the running list; decides each step; books its results."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        prefix_hit_limit: Callable[[Request], int | None] | None = None,
    ):
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        # Caps a request's prefix-cache hit in tokens (None: no cap). A speculative engine passes
        # the draft's, so the target restores no more of a prompt than the draft's own cache holds.
        self.prefix_hit_limit = prefix_hit_limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request by req_id
        self._finished_req_ids: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> bool:
        """Queue a request. Returns False if it finished at once instead:

        FINISHED_ERROR (request.error says why) when it can never run: an empty prompt, prompt +
        max_new_tokens beyond max_model_len or beyond the whole KV cache, or (dynamic_split_fuse off)
        a prompt longer than max_num_batched_tokens. Failing here beats a request that waits forever.
        FINISHED_LENGTH when max_new_tokens is 0: there is nothing to compute.
        """
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in the scheduler")
        if request.is_finished:
            raise ValueError(f"request {request.req_id!r} is already finished")
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = ()
        error = self._admission_error(request)
        if error is not None:
            self.finish_request(request, RequestStatus.FINISHED_ERROR, error)
            return False
        if request.sampling_params.max_new_tokens == 0:
            self.finish_request(request, RequestStatus.FINISHED_LENGTH)
            return False
        self.requests[request.req_id] = request
        self.waiting.append(request)
        return True

    def abort_request(self, req_id: str) -> bool:
        """Finish an unfinished request as aborted and free its blocks; False if unknown/finished."""
        request = self.requests.get(req_id)
        if request is None:
            return False
        self.finish_request(request, RequestStatus.FINISHED_ABORTED, "aborted")
        return True

    def finish_request(self, request: Request, status: RequestStatus, reason: str | None = None) -> None:
        """End a request: leave the queues, free its KV, record status and reason.

        `reason` is free text ("stop token 2", an error message); it defaults to a short word for the
        status. For FINISHED_ERROR it is also stored as request.error. Finishing twice is a no-op.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status.name} is not a finished status")
        if request.is_finished:
            return
        if self.requests.pop(request.req_id, None) is not None:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status
        request.finish_reason = reason or default_finish_reason(status)
        if status == RequestStatus.FINISHED_ERROR:
            request.error = request.finish_reason
        request.spec_token_ids = ()
        self._finished_req_ids.add(request.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's rows. Requests stay unchanged except for admission (RUNNING,
        prefix-cache hits counted as computed), preemption, and candidates trimmed to what fits."""
        step = _Step(budget=self.config.max_num_batched_tokens)
        if self.config.dynamic_split_fuse:
            self._schedule_running(step)
            self._schedule_waiting(step, allow_chunk=True)
        else:
            self._schedule_prompts_or_generation(step)
        if not step.scheduled and not step.preempted_req_ids and not self.running and self.waiting:
            self._fail_unschedulable(self.waiting[0])
        assert step.num_batched_tokens <= self.config.max_num_batched_tokens
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(step.scheduled, step.preempted_req_ids, finished, step.num_batched_tokens)

    def _schedule_prompts_or_generation(self, step: _Step) -> None:
        """dynamic_split_fuse off: a step of prompts if any can run, else a step of generation rows.

        Prompts go first, as in GenAI's and vLLM v0's non-chunked schedulers. The only running
        requests still in prefill are recomputes longer than the whole budget, run in chunks (the
        one case where chunking cannot be avoided).

        Generation rows run whenever no prompt rows did, even after a preemption: a recompute chunk
        that preempted itself for want of blocks would otherwise be readmitted, preempt itself
        again, and so on forever, while the requests holding the blocks never got a step to finish.
        """
        self._schedule_running(step, in_prefill=True)
        self._schedule_waiting(step, allow_chunk=False)
        if not step.scheduled:
            self._schedule_running(step, in_prefill=False)

    def _schedule_running(self, step: _Step, in_prefill: bool | None = None) -> None:
        """Give running requests their rows in admission order; `in_prefill` filters (None: all)."""
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            index += 1
            if in_prefill is not None and self._in_prefill(request) != in_prefill:
                continue
            num_new_tokens = self._num_rows_for_running(request, step.budget)
            if num_new_tokens == 0:
                continue  # nothing to compute (update_from_output not applied yet): skip, not stop
            if not self._allocate_or_preempt(request, num_new_tokens, step):
                break  # the request preempted itself: it was the last running one
            step.add(request, num_new_tokens)

    def _schedule_waiting(self, step: _Step, allow_chunk: bool) -> None:
        """Admit waiting requests in order while budget, max_num_seqs and blocks allow.

        Nothing is admitted in a step that preempted: the freed blocks would only be taken back by
        the next request in line, and the victim would thrash.
        """
        if step.preempted_req_ids:
            return
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0], step, allow_chunk):
                break  # strict FCFS: a later request never overtakes the head

    def _admit(self, request: Request, step: _Step, allow_chunk: bool) -> bool:
        limit = self.prefix_hit_limit(request) if self.prefix_hit_limit is not None else None
        hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request, limit=limit)
        num_new_tokens = request.num_tokens - num_hit_tokens
        if num_new_tokens > step.budget:
            # Without split-fuse only a recompute longer than the whole budget may be chunked.
            if not allow_chunk and num_new_tokens <= self.config.max_num_batched_tokens:
                return False
            num_new_tokens = step.budget
        if not self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit_blocks):
            return False
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        request.num_prefix_cached_tokens = num_hit_tokens
        self.running.append(request)
        step.add(request, num_new_tokens)
        return True

    def _num_rows_for_running(self, request: Request, budget: int) -> int:
        """Rows from num_computed_tokens towards the end of the candidates, at most `budget`.

        Only the candidates that can still be committed count (accepted + bonus token within
        max_new_tokens, so the KV never outgrows the admission check), and only as many as fit the
        budget: verifying a prefix of the candidates is still exact. The step's ScheduledRequest
        says how many are verified (num_spec_tokens); the request's candidates stay as they are.
        """
        num_spec = min(len(request.spec_token_ids), max(0, request.max_num_tokens - 1 - request.num_tokens))
        if num_spec:
            num_spec = self.kv_cache_manager.limit_spec_tokens(request, num_spec)  # a hybrid target's checkpoints
        return max(0, min(request.num_tokens + num_spec - request.num_computed_tokens, budget))

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, step: _Step) -> bool:
        """Allocate the rows' KV slots, preempting from the back of `running` until they fit.

        False when the request itself had to be preempted. Victims always come after the request
        in `running`, so nothing already scheduled this step is ever preempted.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            step.preempted_req_ids.append(victim.req_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free the KV, forget progress, requeue at the front."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED  # until readmitted (then RUNNING)
        request.num_computed_tokens = 0
        request.spec_token_ids = ()
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _fail_unschedulable(self, request: Request) -> None:
        """Livelock guard: nothing runs and the head of the queue still cannot start."""
        message = (
            f"request {request.req_id!r} cannot start: it needs KV blocks for "
            f"{request.num_tokens} tokens but only {self.kv_cache_manager.num_free_blocks} blocks "
            "are free while nothing else runs; enlarge the KV cache"
        )
        self.finish_request(request, RequestStatus.FINISHED_ERROR, message)

    @staticmethod
    def _in_prefill(request: Request) -> bool:
        return request.num_computed_tokens < request.num_tokens - 1

    def _admission_error(self, request: Request) -> str | None:
        """Why the request can never run, or None."""
        num_prompt = request.num_prompt_tokens
        max_new = request.sampling_params.max_new_tokens
        if num_prompt == 0:
            return f"request {request.req_id!r} has an empty prompt"
        max_model_len = self.config.max_model_len
        if max_model_len is not None and request.max_num_tokens > max_model_len:
            return (
                f"prompt ({num_prompt} tokens) + max_new_tokens ({max_new}) exceeds max_model_len "
                f"({max_model_len}); shorten the prompt or lower max_new_tokens"
            )
        # The newest token never needs KV, so a request holds at most max_num_tokens - 1 positions.
        num_kv_tokens = max(request.max_num_tokens - 1, request.num_tokens)
        if num_kv_tokens > self.kv_cache_manager.max_num_tokens:
            return (
                f"prompt ({num_prompt} tokens) + max_new_tokens ({max_new}) needs KV for "
                f"{num_kv_tokens} tokens, more than the whole cache holds "
                f"({self.kv_cache_manager.max_num_tokens}); enlarge the KV cache or lower max_new_tokens"
            )
        if not self.config.dynamic_split_fuse and num_prompt > self.config.max_num_batched_tokens:
            return (
                f"prompt ({num_prompt} tokens) is longer than max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and dynamic_split_fuse is off; raise "
                "max_num_batched_tokens or turn dynamic_split_fuse on"
            )
        return None

    # ---- booking a step's results ----------------------------------------------------------------

    def update_from_output(
        self,
        sched_out: SchedulerOutput,
        new_token_ids: Mapping[str, Sequence[int]],
        num_rejected: Mapping[str, int] | None = None,
    ) -> None:
        """Commit a step: append accepted tokens, advance num_computed_tokens, publish full blocks.

        new_token_ids[req_id]: for every scheduled request with `samples`, the accepted candidates
        followed by the bonus token (1 to 1 + num_spec_tokens tokens); nothing for prefill chunks.
        num_rejected[req_id]: rejected candidates, whose rows are not counted as computed (their
        slots get overwritten next step). Optional: left out, it follows from the tokens given
        (num_spec_tokens + 1 - len(tokens)), which also stays right when the caller cut the tokens
        at a stop. Requests finished since schedule() are skipped. Stop rules are the caller's.
        """
        num_rejected = num_rejected or {}
        for scheduled in sched_out.scheduled:
            request = self.requests.get(scheduled.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != scheduled.num_computed_tokens_before:
                raise RuntimeError(f"request {request.req_id!r}: step booked twice or out of order")
            tokens = new_token_ids.get(scheduled.req_id, ())
            self._commit(request, scheduled, tokens, num_rejected.get(scheduled.req_id))
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            self.kv_cache_manager.commit_state(request, scheduled)  # a hybrid target keeps the accepted state

    @staticmethod
    def _commit(
        request: Request, scheduled: ScheduledRequest, tokens: Sequence[int], rejected: int | None
    ) -> None:
        end = scheduled.num_computed_tokens_before + scheduled.num_new_tokens
        if not scheduled.samples:
            if tokens or rejected:
                raise ValueError(f"request {request.req_id!r}: a prefill chunk yields no tokens")
            request.num_computed_tokens = end
            return
        if not 1 <= len(tokens) <= 1 + scheduled.num_spec_tokens:
            raise ValueError(
                f"request {request.req_id!r}: got {len(tokens)} tokens, expected 1 to "
                f"{1 + scheduled.num_spec_tokens} (accepted candidates + bonus)"
            )
        if rejected is not None and not 0 <= rejected <= scheduled.num_spec_tokens:
            raise ValueError(
                f"request {request.req_id!r}: {rejected} rejected of {scheduled.num_spec_tokens} candidates"
            )
        request.append_output_token_ids(tokens)
        request.spec_token_ids = ()
        # The newest committed token never has KV yet; fewer computed rows than that is still
        # correct (they are recomputed), more would claim KV of tokens that were not committed.
        request.num_computed_tokens = min(end - (rejected or 0), request.num_tokens - 1)
