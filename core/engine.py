"""The engine: continuous batching on PagedAttention. The step loop lives here.

    engine = LLMEngine("out/target", EngineConfig(max_num_batched_tokens=256))
    results = engine.generate(["Write a haiku about CPUs."], SamplingParams(max_new_tokens=64))

One step, for every running request at once:

    scheduler.schedule()   -> which requests run and how many rows each: a prompt chunk, or [seed; candidates]
    runner.run()           -> one packed PagedAttention inference: logits of the rows that sample,
                              and (with a draft) the target hidden states of every row
    verification           -> greedy acceptance of the candidates plus the bonus token, or one sampled token
    scheduler.update_...   -> commit tokens, advance the KV ledger (rejected rows are not counted),
                              publish full blocks to the prefix cache
    draft ledger           -> the committed rows' hidden states go to the draft
    stop rules             -> EOS / stop ids / stop strings / max_new_tokens end requests, blocks go back
    draft                  -> one packed inference over every request's window: the next candidates
    outputs                -> text deltas for streaming, results with timings and acceptance

With a draft (`LLMEngine(target_dir, config, draft_dir=...)`), greedy output is the target's own,
token for token: a candidate is committed only where it equals the target's argmax.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .block_pool import BlockPool
from .config import CacheConfig, SamplingParams, SchedulerConfig
from .detokenizer import IncrementalDetokenizer
from .errors import InputError
from .kv_cache_manager import KVCacheManager
from .markov import MarkovHeadRunner, load_markov_head
from .metrics import SpecDecodingStats, StepTimes
from .draft_runner import DraftRunner, read_draft_spec
from .model_runner import StepInputs, StepOutputs, TargetRunner, read_ov_model
from .paged import SequenceSlice
from .request import Request, RequestStatus, default_finish_reason
from .sampler import Sampler
from .speculative import DFlashProposer
from .scheduler import Scheduler, SchedulerOutput
from .stopping import StopChecker
from .tokenization import Prompt, load_tokenizer, stop_token_ids_of, tokenize_prompt


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs besides the model folder."""

    device: str = "CPU"
    ov_config: dict[str, str] = field(default_factory=dict)
    kv_cache_size_gib: float | None = None  # the target's KV cache; default: 256 MiB
    num_kv_blocks: int | None = None  # alternative to kv_cache_size_gib (tests, tight budgets)
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    dynamic_split_fuse: bool = True
    draft_kv_cache_size_gib: float | None = None  # the draft's KV cache; default: as the target's
    num_draft_kv_blocks: int | None = None
    # DSpark drafts with a Markov head: K of the Top-K candidate scorer (None: the export's K;
    # 0: the dense Markov walk). use_markov_head=False runs the draft as plain DFlash (comparisons).
    markov_head_top_k: int | None = None
    use_markov_head: bool = True

    def scheduler_config(self, max_model_len: int | None) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            dynamic_split_fuse=self.dynamic_split_fuse,
            max_model_len=max_model_len,
        )


DEFAULT_KV_CACHE_GIB = 0.25


@dataclass
class RequestOutput:
    """What one step did for one request: new tokens and text, and whether it finished.

    The `new_text` of all of a request's outputs adds up to its result's text: text that a stop
    string may still cut is held back until it is safe, and the final output brings the rest.
    finish_reason is "stop", "length", "abort" or "error".
    """

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    """A finished request."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None
    ttft_s: float | None  # arrival to first generated token
    tpot_s: float | None  # mean time per generated token after the first
    stop_reason: str | None = None  # with "stop": which rule, e.g. "stop token 2", "stop string '\\n'"
    spec: SpecDecodingStats | None = None  # acceptance of this request's drafts (with a draft)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict:
        return {
            "id": self.req_id,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "num_generated_tokens": self.num_generated_tokens,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "error": self.error,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            **({"spec_decoding": self.spec.to_json()} if self.spec is not None else {}),
        }


@dataclass
class _Tracked:
    """Engine-side state of a request: its text so far, stop rules and timings."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    arrival: float
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    first_token_at: float | None = None
    finished_at: float | None = None
    num_streamed_chars: int = 0  # of the text, already handed out as RequestOutput.new_text
    final_text: str | None = None  # set when the request finishes: stop strings cut, nothing held back


class LLMEngine:
    """Continuous batching of many requests over one target on PagedAttention."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig | None = None, *, draft_dir: str | Path | None = None
    ):
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        draft_model = read_ov_model(draft_dir) if draft_dir is not None else None
        draft_spec = read_draft_spec(draft_model) if draft_model is not None else None
        markov = self._load_markov_head(draft_dir, draft_model) if draft_model is not None else None
        self.runner = TargetRunner(
            self.model_dir,
            device=self.config.device,
            ov_config=self.config.ov_config,
            hidden_layer_ids=draft_spec.target_layer_ids if draft_spec else (),
        )
        self.kv_cache_manager = self._make_kv_cache(self.runner, self.config.num_kv_blocks, self.config.kv_cache_size_gib)
        self.block_pool = self.kv_cache_manager.pool
        self.proposer: DFlashProposer | None = None
        if draft_model is not None:
            draft_runner = DraftRunner(draft_model, self.model_dir, device=self.config.device, ov_config=self.config.ov_config)
            draft_kv = self._make_kv_cache(
                draft_runner,
                self.config.num_draft_kv_blocks,
                self.config.draft_kv_cache_size_gib or self.config.kv_cache_size_gib,
            )
            self.proposer = DFlashProposer(draft_runner, draft_kv, markov=markov, markov_top_k=self.config.markov_head_top_k)
            # A target prefix hit is only usable as far as the draft holds the same prefix.
            self.kv_cache_manager.prefix_hit_limit = self._draft_prefix_hit
        model_config = _model_config(self.model_dir)
        max_model_len = model_config.get("max_position_embeddings")
        self.scheduler = Scheduler(self.config.scheduler_config(max_model_len), self.kv_cache_manager)
        self.vocab_size: int | None = model_config.get("vocab_size")
        self.eos_token_ids = stop_token_ids_of(self.model_dir, self.tokenizer)
        self.sampler = Sampler()
        self.spec_stats = SpecDecodingStats()  # over every request since the engine started
        self.times = StepTimes()
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[RequestOutput] = []  # requests that finished outside a step (errors at add)
        self._ids = itertools.count()

    def _load_markov_head(self, draft_dir: str | Path, draft_model) -> MarkovHeadRunner | None:
        """A DSpark draft's Markov head (None for markov_rank 0, or when told to ignore it); loaded
        before anything is compiled, so that a missing or unsupported head fails fast."""
        if not self.config.use_markov_head:
            return None
        return load_markov_head(
            draft_dir, draft_model, device=self.config.device, ov_config=self.config.ov_config,
            vocab_size=_model_config(self.model_dir).get("vocab_size"),
        )  # fmt: skip

    def _make_kv_cache(self, runner, num_blocks: int | None, size_gib: float | None) -> KVCacheManager:
        """A block pool sized in blocks or GiB (default 0.25 GiB), the runner's caches allocated to match."""
        cache = CacheConfig(
            block_size=runner.block_size,
            num_blocks=num_blocks,
            kv_cache_size_gib=None if num_blocks else (size_gib or DEFAULT_KV_CACHE_GIB),
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        num_blocks = cache.resolve_num_blocks(runner.bytes_per_block)
        runner.allocate_cache(num_blocks)
        return KVCacheManager(BlockPool(num_blocks, cache.block_size, cache.enable_prefix_caching))

    @property
    def warnings(self) -> list[str]:
        """Things users should know that did not stop a request (a draft that gave up)."""
        return self.proposer.warnings if self.proposer else []

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        req_id: str | None = None,
        chat: bool = False,
    ) -> str:
        """Queue a prompt (text, token ids, or chat messages). Returns its request id.

        A request that can never run (empty prompt, too long for the model or the cache) is not
        raised: it finishes at once with an error in its result, so the other requests go on.
        """
        params = params or SamplingParams()
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self._tracked:
            raise InputError(f"request id {req_id!r} is already in use", "give each running request its own id")
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, chat=chat)
        request = Request(req_id, token_ids, params)
        tracked = _Tracked(
            request=request,
            prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids),
            stop=StopChecker(params, self.eos_token_ids),
            arrival=time.perf_counter(),
        )
        self._tracked[req_id] = tracked
        bad_ids = [t for t in token_ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if not token_ids or (isinstance(prompt, str) and not prompt.strip()):
            self._finish_outside_step(tracked, "the prompt is empty")
        elif bad_ids:
            # The embedding Gather would not fail on them: it would silently read garbage.
            self._finish_outside_step(
                tracked, f"token id {bad_ids[0]} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        elif not self.scheduler.add_request(request):
            self._pending.append(self._book_finished(tracked))
        return req_id

    def abort_request(self, req_id: str) -> bool:
        """Stop a request now; its blocks return to the pool. False if unknown or already finished."""
        if not self.scheduler.abort_request(req_id):
            return False
        self._book_finished(self._tracked[req_id])
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    # ---- the step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return what each touched request produced."""
        step_start = time.perf_counter()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self._forget_drafts(sched.preempted_req_ids)
        if sched.scheduled:
            inputs = self._pack(sched)
            start = time.perf_counter()
            target_out = self.runner.run(inputs)
            target_s = time.perf_counter() - start
            self.times.target_s += target_s
            new_tokens = self._verify(sched, target_out.logits)
            self.scheduler.update_from_output(sched, new_tokens)
            if self.proposer is not None:
                self._feed_draft(sched, target_out)
            outputs += [self._after_tokens(req_id, tokens) for req_id, tokens in new_tokens.items()]
            if self.proposer is not None:
                self._draft(sched)
                if not any(s.is_prefill_chunk for s in sched.scheduled):  # a generation step: its cost per row
                    self.proposer.adaptive.observe_step((len(inputs.token_ids), target_s), self.proposer.last_inference,
                                                        sum(map(len, new_tokens.values())), time.perf_counter() - step_start)  # fmt: skip
        # Requests the scheduler finished on its own (out of cache, unschedulable) report here.
        # The id may already belong to a new request (the old one's result was collected and its
        # id reused): only a tracked request that really finished is booked.
        for req_id in sched.finished_req_ids:
            tracked = self._tracked.get(req_id)
            if tracked is not None and tracked.finished_at is None and tracked.request.is_finished:
                outputs.append(self._book_finished(tracked))
        self.times.step_s += time.perf_counter() - step_start
        self.times.num_steps += 1
        return outputs

    def _pack(self, sched: SchedulerOutput) -> StepInputs:
        """The scheduled rows of every request, in order, as one PagedAttention call."""
        seqs, token_ids, sample_rows = [], [], []
        for scheduled in sched.scheduled:
            request = self.scheduler.get_request(scheduled.req_id)
            start = scheduled.num_computed_tokens_before
            stop = start + scheduled.num_new_tokens
            first_row = len(token_ids)
            token_ids.extend(request.token_ids_with_spec(start, stop))
            if scheduled.samples:
                last_row = first_row + scheduled.num_new_tokens
                sample_rows.extend(range(last_row - scheduled.num_sampled_rows, last_row))
            block_table = self.kv_cache_manager.block_table(scheduled.req_id)
            seqs.append(SequenceSlice(start, scheduled.num_new_tokens, block_table))
        return StepInputs(
            seqs=seqs,
            token_ids=np.asarray(token_ids, dtype=np.int64),  # [num_tokens]
            sample_rows=np.asarray(sample_rows, dtype=np.int64),  # [num_sampled]
        )

    def _verify(self, sched: SchedulerOutput, logits: np.ndarray) -> dict[str, list[int]]:
        """New tokens of every request whose rows reached the end of its tokens.

        Without candidates: one sampled (or greedy) token. With k candidates (greedy only): the target's
        argmax at the seed row and at each candidate row; the longest prefix of candidates equal to
        it is accepted, then the target's own token after them (the bonus). Tokens past a stop
        token or max_new_tokens are cut, so nothing after a stop is ever committed.
        """
        new_tokens, row = {}, 0
        for scheduled in sched.scheduled:
            if not scheduled.samples:
                continue
            request = self.scheduler.get_request(scheduled.req_id)
            rows = logits[row : row + scheduled.num_sampled_rows]  # [1 + k, vocab]
            row += scheduled.num_sampled_rows
            if scheduled.num_spec_tokens == 0:
                sampled = self.sampler.sample(request.req_id, rows[0], request.sampling_params)
                tokens = self._cut_at_stop(request, [sampled])
            else:
                num_drafted = len(request.spec_token_ids)
                tokens = self._cut_at_stop(request, self._accept(request, rows.argmax(axis=-1)))
                # Counted after the cut: a stop inside the candidates ends the step early, and the
                # counters add up to the committed tokens (accepted + 1 per verification step).
                for stats in (self._tracked[request.req_id].spec, self.spec_stats):
                    stats.observe(num_drafted, len(tokens) - 1)
                self.proposer.observe(request, num_drafted, len(tokens) - 1)
            new_tokens[scheduled.req_id] = tokens
        return new_tokens

    def _accept(self, request: Request, target_tokens: np.ndarray) -> list[int]:
        """Greedy acceptance: candidates equal to the target's tokens, then the bonus token."""
        candidates = request.spec_token_ids
        num_accepted = 0
        while num_accepted < len(candidates) and candidates[num_accepted] == target_tokens[num_accepted]:
            num_accepted += 1
        return [int(t) for t in target_tokens[: num_accepted + 1]]

    def _cut_at_stop(self, request: Request, tokens: list[int]) -> list[int]:
        """The tokens a step may commit: none past max_new_tokens, none after a stop token and none
        after the token whose text completes a stop string, so that a step that accepts several
        tokens ends a request exactly where steps of one token would."""
        tracked = self._tracked[request.req_id]
        tokens = tokens[: request.sampling_params.max_new_tokens - request.num_output_tokens]
        stop_at = tracked.stop.first_stop(tokens)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
        if len(tokens) > 1 and request.sampling_params.stop_strings:
            tokens = tokens[: self._stop_string_end(tracked, tokens)]
        return tokens

    def _stop_string_end(self, tracked: _Tracked, tokens: list[int]) -> int:
        """How many of `tokens` to keep: up to the first one after which the text holds a stop string.

        The text is checked token by token as the incremental detokenizer builds it (it holds back
        incomplete characters, so a stop string shows at the same token as in one-token steps), on a
        copy of the request's detokenizer that shares the tokenizer.
        """
        probe = copy.deepcopy(tracked.detokenizer, {id(self.tokenizer): self.tokenizer})
        output = list(tracked.request.output_token_ids)
        for index, token in enumerate(tokens[:-1]):
            probe.add([token])
            output.append(token)
            if tracked.stop.check(output, probe.text) is not None:
                return index + 1
        return len(tokens)

    # ---- the draft -----------------------------------------------------------------------------------

    def _feed_draft(self, sched: SchedulerOutput, target_out: StepOutputs) -> None:
        """Hand each request's newly committed target hidden rows to the draft's ledger."""
        first_row = 0
        for scheduled in sched.scheduled:
            rows = slice(first_row, first_row + scheduled.num_new_tokens)
            first_row += scheduled.num_new_tokens
            request = self.scheduler.get_request(scheduled.req_id)
            if request is None or not self._drafts(request):
                continue
            start = scheduled.num_computed_tokens_before
            if not self.proposer.is_tracked(request.req_id):
                self.proposer.start(request, start)
            num_committed = request.num_computed_tokens - start  # rows of rejected candidates excluded
            self.proposer.ingest(request, start, target_out.hidden_states[rows][:num_committed])

    def _draft(self, sched: SchedulerOutput) -> None:
        """One draft inference for every running request; its candidates are verified next step."""
        start = time.perf_counter()
        requests = [self.scheduler.get_request(s.req_id) for s in sched.scheduled]
        candidates = self.proposer.propose(r for r in requests if r is not None and not r.is_finished)
        for req_id, tokens in candidates.items():
            self.scheduler.get_request(req_id).spec_token_ids = tokens
        self.times.draft_s += time.perf_counter() - start

    def _draft_prefix_hit(self, request: Request) -> int | None:
        return self.proposer.prefix_hit_tokens(request) if self._drafts(request) else None

    def _drafts(self, request: Request) -> bool:
        """Whether the draft follows this request (greedy, and num_assistant_tokens not 0)."""
        params = request.sampling_params
        return params.is_greedy and params.num_assistant_tokens != 0

    def _forget_drafts(self, req_ids: Iterable[str]) -> None:
        """Preempted requests are recomputed from scratch: their draft ledger starts over too."""
        if self.proposer is None:
            return
        for req_id in req_ids:
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                self.proposer.forget(tracked.request)

    def _after_tokens(self, req_id: str, tokens: list[int]) -> RequestOutput:
        """Stream the new text, then apply the stop rules."""
        tracked = self._tracked[req_id]
        if tracked.first_token_at is None:
            tracked.first_token_at = time.perf_counter()
        tracked.detokenizer.add(tokens)
        request = tracked.request
        stop = tracked.stop.check(request.output_token_ids, tracked.detokenizer.text)
        if stop is None:
            return RequestOutput(req_id, tokens, self._stream_delta(tracked), finished=False)
        status, reason = stop
        self.scheduler.finish_request(request, status, reason)
        output = self._book_finished(tracked)
        output.new_token_ids = tokens
        return output

    @staticmethod
    def _stream_delta(tracked: _Tracked) -> str:
        """The text not streamed yet, less the tail that a stop string could still claim (a stop
        string cut from the final text must never have been streamed)."""
        text = tracked.detokenizer.text
        end = len(text) - tracked.stop.num_held_back_chars
        if end <= tracked.num_streamed_chars:
            return ""
        delta = text[tracked.num_streamed_chars : end]
        tracked.num_streamed_chars = end
        return delta

    # ---- finishing ----------------------------------------------------------------------------------

    def _finish_outside_step(self, tracked: _Tracked, error: str) -> None:
        request = tracked.request
        request.status = RequestStatus.FINISHED_ERROR
        request.finish_reason = request.error = error
        self._pending.append(self._book_finished(tracked))

    def _book_finished(self, tracked: _Tracked) -> RequestOutput:
        """Record the finish time and the final text; the returned output tells the caller the
        request ended and carries the text not streamed yet."""
        tracked.finished_at = time.perf_counter()
        request = tracked.request
        self.sampler.forget(request.req_id)
        if self.proposer is not None:
            self.proposer.forget(request)
        tracked.detokenizer.flush()  # a trailing incomplete character is still part of the text
        tracked.final_text = tracked.stop.trim_text(tracked.detokenizer.text)
        delta = tracked.final_text[tracked.num_streamed_chars :]
        tracked.num_streamed_chars = len(tracked.final_text)
        return RequestOutput(request.req_id, [], delta, True, default_finish_reason(request.status), request.error)

    def result(self, req_id: str) -> GenerationResult:
        """The result of a finished request (and forget it)."""
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.final_text is None:
            raise ValueError(f"request {req_id!r} is unknown or has not finished")
        del self._tracked[req_id]
        request = tracked.request
        ttft = tpot = None
        if tracked.first_token_at is not None:
            ttft = tracked.first_token_at - tracked.arrival
            if request.num_output_tokens > 1 and tracked.finished_at is not None:
                tpot = (tracked.finished_at - tracked.first_token_at) / (request.num_output_tokens - 1)
        return GenerationResult(
            req_id=req_id,
            prompt=tracked.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            text=tracked.final_text,
            token_ids=list(request.output_token_ids),
            finish_reason=default_finish_reason(request.status),
            error=request.error,
            ttft_s=ttft,
            tpot_s=tpot,
            stop_reason=request.finish_reason if request.status == RequestStatus.FINISHED_STOPPED else None,
            spec=tracked.spec if self.proposer is not None else None,
        )

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
                self.abort_request(req_id)
                self._tracked.pop(req_id, None)
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
            self.abort_request(req_id)
            self._tracked.pop(req_id, None)


def _model_config(model_dir: Path) -> dict:
    """The exported config.json (for max_position_embeddings and vocab_size); {} if unreadable."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
