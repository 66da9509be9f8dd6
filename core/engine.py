"""The engine: continuous batching on PagedAttention. The step loop lives here.

    engine = LLMEngine("out/target", EngineConfig(max_num_batched_tokens=256))
    results = engine.generate(["Write a haiku about CPUs."], SamplingParams(max_new_tokens=64))

One step, for every running request at once (`LLMEngine.step`):

    schedule   scheduler.schedule(): which requests run and how many rows each: a prompt chunk,
               or [seed; candidates]
    run        one packed PagedAttention inference of the target: logits of the rows that need them,
               and (with a draft) the hidden states of every row
    verify     acceptance of the candidates plus the bonus token (greedy, or speculative sampling),
               or one sampled token; cut at stops (core/verification.py)
    commit     scheduler.update_from_output(): tokens appended, KV ledger advanced (rejected rows
               not counted), full blocks published; stop rules applied (text is decoded only for
               stop strings, for an output's new_text when read, and at the end)
    draft      drafter.step(): the committed rows go to the draft, which proposes the candidates
               that the next step verifies (core/drafter.py: the target alone drafts nothing)

With a draft (`LLMEngine(target_dir, config, draft_dir=...)`), greedy output is the target's own,
token for token: a candidate is committed only where it equals the target's argmax. Sampled output is
distributed as the target's own: candidates pass the speculative sampling rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .blas_threads import one_blas_thread
from .config import EngineConfig, SamplingParams
from .detokenizer import IncrementalDetokenizer
from .drafter import NoDrafter, TargetStep, draft_probs
from .errors import InputError
from .loading import load_pipelines
from .metrics import SpecDecodingStats, StepTimes
from .model_runner import pack_target_rows
from .outputs import GenerationResult, RequestOutput, TrackedRequest
from .request import Request, RequestStatus
from .sampler import Sampler
from .schedule_memory import ScheduleMemory
from .scheduler import Scheduler, SchedulerOutput
from .stopping import StopChecker
from .tokenization import Prompt, stop_token_ids_of, tokenize_prompt
from .verification import Verdict, accept_greedy, accept_sampled, cut_at_stop

__all__ = ["EngineConfig", "GenerationResult", "LLMEngine", "RequestOutput"]


class LLMEngine:
    """Continuous batching of many requests over one target on PagedAttention."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, *, draft_dir: str | Path | None = None
    ):
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        pipelines = load_pipelines(self.model_dir, draft_dir, self.config)
        self.tokenizer = pipelines.tokenizer
        self.runner, self.drafter, self.kv_cache_manager = pipelines.runner, pipelines.drafter, pipelines.kv_cache_manager
        self.block_pool = self.kv_cache_manager.pool
        model_config = pipelines.model_config
        self.scheduler = Scheduler(
            self.config.scheduler_config(model_config.get("max_position_embeddings")),
            self.kv_cache_manager,
            prefix_hit_limit=self.drafter.prefix_hit_limit,  # a target hit only as far as the draft holds it
        )
        self.vocab_size: int | None = model_config.get("vocab_size")
        self.eos_token_ids = stop_token_ids_of(self.model_dir, self.tokenizer)
        self.sampler = Sampler()
        self.spec_stats = SpecDecodingStats()  # over every request since the engine started
        self.times = StepTimes()
        self._tracked: dict[str, TrackedRequest] = {}
        self._pending: list[RequestOutput] = []  # requests that finished outside a step (errors, aborts)
        self._ids = itertools.count()
        # One engine may be driven from several threads: every public call holds this lock, so steps
        # never overlap and requests added from another thread join the next step.
        self._lock = threading.RLock()
        # what the adaptive schedule measured of this machine's steps, from an earlier engine (config.schedule_memory)
        self._schedule_memory: ScheduleMemory | None = None
        if self.config.schedule_memory is not None and self.has_draft:
            self._schedule_memory = ScheduleMemory.for_engine(self.config.schedule_memory, self.model_dir, Path(draft_dir), self.config)
            self._schedule_memory.load(self.drafter.adaptive)

    @property
    def has_draft(self) -> bool:
        return not isinstance(self.drafter, NoDrafter)

    @property
    def warnings(self) -> list[str]:
        """Things users should know that did not stop a request (a draft that gave up)."""
        return self.drafter.warnings

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, req_id: str | None = None,
                    chat: bool = False) -> str:  # fmt: skip
        """Queue a prompt (text, token ids, or chat messages). Returns its request id.

        A request that can never run (empty prompt, too long for the model or the cache) is not
        raised: it finishes at once with an error in its result, so the other requests go on.
        """
        with self._lock:
            return self._add_request(prompt, params or SamplingParams(), req_id, chat)

    def _add_request(self, prompt: Prompt, params: SamplingParams, req_id: str | None, chat: bool) -> str:
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self._tracked:
            raise InputError(f"request id {req_id!r} is already in use", "give each running request its own id")
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, chat=chat)
        request = Request(req_id, token_ids, params)
        tracked = self._tracked[req_id] = TrackedRequest(
            request, text, IncrementalDetokenizer(self.tokenizer, token_ids), StopChecker(params, self.eos_token_ids)
        )
        bad_ids = [t for t in token_ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if not token_ids or (isinstance(prompt, str) and not prompt.strip()):
            self._fail_at_add(tracked, "the prompt is empty")
        elif bad_ids:
            # The embedding Gather would not fail on them: it would silently read garbage.
            self._fail_at_add(tracked, f"token id {bad_ids[0]} is outside the model's vocabulary of {self.vocab_size} tokens")
        elif not self.scheduler.add_request(request):
            self._pending.append(self._finish(tracked))
        return req_id

    def abort_request(self, req_id: str) -> bool:
        """Stop a request now; its blocks return to the pool, and the next step returns its final
        output (finish_reason "abort"). False if unknown or already finished."""
        with self._lock:
            if not self.scheduler.abort_request(req_id):
                return False
            self._pending.append(self._finish(self._tracked[req_id]))
            return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, the target's and the draft's, so that the next requests
        compute their prompts in full; only while no request runs. Returns whether it did."""
        with self._lock:
            if self.has_unfinished_requests():
                return False
            return all([self.block_pool.reset_prefix_cache(), self.drafter.reset_prefix_cache()])

    @contextlib.contextmanager
    def running_at_most(self, num_requests: int) -> Iterator[None]:
        """Within the block, at most `num_requests` requests run at once (never more than the engine's
        max_num_seqs); the others wait in the scheduler's queue, where the adaptive schedule sees that
        a request that ends early hands its place on."""
        with self._lock:
            config = self.scheduler.config
            self.scheduler.config = dataclasses.replace(config, max_num_seqs=min(num_requests, config.max_num_seqs))
        try:
            yield
        finally:
            with self._lock:
                self.scheduler.config = config

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished_requests() or bool(self._pending)

    # ---- the step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return what each touched request produced."""
        with self._lock, one_blas_thread():  # numpy's BLAS workers would spin on the inference's cores
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        for req_id in sched.preempted_req_ids:  # recomputed from scratch: the draft starts over too
            self.drafter.forget(self._tracked[req_id].request)
        if sched.scheduled:
            target_step = self._run_target(sched, start)
            self.scheduler.update_from_output(sched, {req_id: v.tokens for req_id, v in target_step.verdicts.items()})
            outputs += [self._commit(req_id, verdict) for req_id, verdict in target_step.verdicts.items()]
            self._draft(self._batch_after(target_step))
        outputs += self._finished_by_scheduler(sched)
        self.times.end_step(time.perf_counter() - start, self.runner.infer_seconds, self.drafter.infer_seconds)
        if self._schedule_memory is not None and not self.scheduler.has_unfinished_requests():
            self._schedule_memory.save(self.drafter.adaptive)  # idle: what this run measured, for the next
        return outputs

    def _run_target(self, sched: SchedulerOutput, step_start: float) -> TargetStep:
        """Pack the scheduled rows, run the target once, verify what reached the end of its tokens."""
        scheduled = [(s, self.scheduler.get_request(s.req_id)) for s in sched.scheduled]
        inputs = pack_target_rows(scheduled, self.kv_cache_manager.block_table, self.kv_cache_manager.state_inputs)
        start = time.perf_counter()
        target_out = self.runner.run(inputs)
        self.times.target_s += time.perf_counter() - start
        verdicts = self._verify(scheduled, target_out.logits)
        return TargetStep(scheduled, target_out.hidden_states, verdicts, len(inputs.token_ids),
                          time.perf_counter() - step_start)  # fmt: skip

    def _batch_after(self, target_step: TargetStep) -> TargetStep:
        """The step with the batch as it stands once the scheduler has taken its outcome: the requests
        waiting for a place, and the batch's size (running, and waiting ones there is room for)."""
        num_requests = len(self.scheduler.running) + len(self.scheduler.waiting)
        num_batch = min(num_requests, self.scheduler.config.max_num_seqs)
        return dataclasses.replace(target_step, num_waiting=num_requests - num_batch, num_batch=num_batch)

    def _verify(self, scheduled: list[tuple], logits: np.ndarray) -> dict[str, Verdict]:
        """What each request that reached the end of its tokens commits: one sampled (or greedy)
        token, or its accepted candidates plus the bonus; cut at stops."""
        verdicts, row = {}, 0
        for s, request in scheduled:
            if not s.samples:
                continue
            rows = logits[row : row + s.num_sampled_rows]  # [1 + k, vocab]
            row += s.num_sampled_rows
            tracked = self._tracked[request.req_id]
            params, candidates = request.sampling_params, request.spec_token_ids[: s.num_spec_tokens]
            position = request.num_output_tokens  # of the first token this step commits: keys its draws
            if s.num_spec_tokens == 0:
                tokens = [self.sampler.sample(request.req_id, rows[0], params, position)]
            elif params.is_greedy:
                tokens = accept_greedy(candidates, rows.argmax(axis=-1))
            else:
                probs = draft_probs(request.spec_token_ids, s.num_spec_tokens)
                tokens = accept_sampled(candidates, probs, rows, params, self.sampler.key(request.req_id, params), position)
            verdict = verdicts[s.req_id] = Verdict(cut_at_stop(tracked, tokens, self.tokenizer), s.num_spec_tokens)
            for stats in (tracked.spec, self.spec_stats):
                stats.observe(verdict.num_drafted, verdict.num_accepted)
        return verdicts

    def _commit(self, req_id: str, verdict: Verdict) -> RequestOutput:
        """Apply the stop rules to the committed tokens (the scheduler has appended them)."""
        tracked = self._tracked[req_id]
        stop = tracked.check_stop()
        if stop is None:
            return tracked.step_output(verdict.tokens)  # its text is decoded if someone reads it
        self.scheduler.finish_request(tracked.request, *stop)
        output = self._finish(tracked)
        output.new_token_ids = verdict.tokens
        return output

    def _draft(self, target_step: TargetStep) -> None:
        """The draft's candidates, verified by the next step (the scheduler may verify fewer)."""
        seconds_before = self.drafter.seconds  # the drafter times itself (the target alone: 0)
        for req_id, tokens in self.drafter.step(target_step).items():
            self.scheduler.get_request(req_id).spec_token_ids = tokens
        self.times.draft_s += self.drafter.seconds - seconds_before

    def _finished_by_scheduler(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Requests the scheduler finished on its own (out of cache, unschedulable). The id may
        already belong to a new request (the old one's result was collected and its id reused):
        only a tracked request that really finished is booked."""
        outputs = []
        for req_id in sched.finished_req_ids:
            tracked = self._tracked.get(req_id)
            if tracked is not None and tracked.finished_at is None and tracked.request.is_finished:
                outputs.append(self._finish(tracked))
        return outputs

    # ---- finishing ----------------------------------------------------------------------------------

    def _fail_at_add(self, tracked: TrackedRequest, error: str) -> None:
        request = tracked.request
        request.status = RequestStatus.FINISHED_ERROR
        request.finish_reason = request.error = error
        self._pending.append(self._finish(tracked))

    def _finish(self, tracked: TrackedRequest) -> RequestOutput:
        self.sampler.forget(tracked.request.req_id)
        self.drafter.forget(tracked.request)
        return tracked.finish()

    def result(self, req_id: str) -> GenerationResult:
        """The result of a finished request (and forget it)."""
        with self._lock:
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.final_text is None:
                raise ValueError(f"request {req_id!r} is unknown or has not finished")
            del self._tracked[req_id]
            return tracked.result(with_spec=self.has_draft)

    # ---- convenience ----------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion together; results in prompt order."""
        prompts = list(prompts)
        all_params = params if isinstance(params, Sequence) else [params] * len(prompts)
        req_ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, all_params, strict=True)]
        try:
            self.run_until_done(on_output)
        except BaseException:
            for req_id in req_ids:  # Ctrl-C or a failed inference: give every block back
                self._forget(req_id)
            raise
        return [self.result(req_id) for req_id in req_ids]

    def run_until_done(self, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        while self.has_unfinished_requests():
            for output in self.step():
                if on_output is not None:
                    on_output(output)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[str]:
        """Yield the text of one request as it is generated; the pieces add up to its final text.

        Returns as soon as this request ends; other requests keep running in later steps (the
        outputs they produce during the stream are not returned: collect them with `result`).
        Raises InputError when the request fails (an empty prompt, one too long for the model).
        """
        req_id = self.add_request(prompt, params, chat=chat)
        try:
            finished = False
            while not finished and self.has_unfinished_requests():  # (aborted elsewhere: ends)
                for output in self.step():
                    if output.req_id != req_id:
                        continue
                    if output.new_text:
                        yield output.new_text
                    if output.finished and output.error:
                        raise InputError(output.error, "fix the prompt, or raise the engine's limits")
                    finished = finished or output.finished
        finally:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        """Abort a request of our own (if it still runs) and drop it, with no output for anyone."""
        with self._lock:
            if self.scheduler.abort_request(req_id):
                self._finish(self._tracked[req_id])  # blocks back; its output goes nowhere
            self._tracked.pop(req_id, None)
