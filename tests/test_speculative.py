"""Speculative decoding in the engine: a DFlash/DSpark draft never changes the target's greedy tokens.

Every scenario runs the same prompts with a draft and compares, token for token, with the target
alone, then checks that both KV pools (target and draft) are full again and that the acceptance
counters add up to the tokens committed (each step that verified candidates commits accepted + 1
tokens, every other sampling step one).

The models are tiny checkpoints whose greedy choices the test controls (weights edited before export):

* "mixed" target: a random target whose layers write only 10% of their usual output into the
  residual stream, so its next token mostly follows the token embedding ("bigram" lm_head of the
  current token) but depends on the context about half the time. Its exact outputs need a correct KV.
* "chain" target: every layer's o_proj/down_proj is zero, so the final hidden state is the token's own
  embedding and the lm_head alone picks the next token: a fixed successor `succ(x)` on a long
  cycle of ordinary tokens, and the constant token A after A and after the mask token.
* "ctx" drafts: random drafts whose layers are scaled down the same way: the anchor row of a DSpark
  draft predicts the target's bigram token (often accepted), every row still reads the context
  (rows of a wrong ledger change the candidates).
* "zero" drafts: o_proj/down_proj zero, so block row r outputs the normed embedding of its own token:
  a DSpark-layout draft (candidate offset 0) proposes [succ(seed), next(mask), ...], a DFlash draft
  (offset 1) proposes next(mask) only. On the chain target next(mask) is A, which gives exactly
  one accepted candidate per step after an ordinary token, none for DFlash, and every candidate
  accepted once the sequence is in A.

Inference runs with f32 compute and f32 KV caches, where outputs do not depend on batch composition.
Candidates themselves are recorded (a spy on the proposer, no mock) and compared across scheduling
situations: with the same committed tokens, a correct draft ledger proposes the same candidates.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.draft_runner import ROW_BUCKET
from dflash.core.engine import EngineConfig, GenerationResult, LLMEngine, RequestOutput
from dflash.core.graph import (
    find_embedding_gather,
    find_lm_head,
    graft_embedding,
    graft_lm_head,
)
from dflash.core.metrics import SpecDecodingStats
from dflash.core.model_runner import read_ov_model
from dflash.core.request import Request
from dflash.exporters.constructed import (
    MASK,
    A,
    chain_of,
    chain_prompts,
    edit_weights,
    make_chain_target,
    make_scaled_draft,
    scale_residual_writes,
    unit_final_norm,
)
from dflash.exporters.draft import export_draft
from dflash.exporters.target import export_target
from dflash.exporters.tiny import _CORPUS, make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

F32 = EXACT_OV_CONFIG
NEW_TOKENS = 24
EOS = 2  # <|im_end|>
SPECIALS = (0, 1, EOS, MASK)  # never in the chain prompts; <|endoftext|>, <|im_start|> map to themselves

# 4 to 138 tokens with the tiny tokenizer; the last two span more than 2 KV blocks of 32.
TEXTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. OpenVINO runs models on Intel CPUs.",
    "import numpy as np\nx = np.arange(16).reshape(4, 4)\nfor i in range(10):\n    print(i * i)\n",
    " ".join(_CORPUS[:4]),
    " ".join(_CORPUS),
]
LONG = TEXTS[-1]
SIXTEEN = [TEXTS[i % len(TEXTS)] for i in range(14)] + [_CORPUS[1], _CORPUS[6]]
GREEDY = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS, ignore_eos=True)
MAX_STEPS = 2000


# ---- checkpoints with controlled greedy choices ---------------------------------------------------


@dataclass
class Models:
    mixed: Path  # the context-dependent target, fp32
    mixed_int8: Path  # the same target, int8 weights
    chain: Path  # the successor-chain target, fp32
    succ: dict[int, int]
    drafts: dict[str, Path]  # dspark_ctx, dflash_ctx, dspark_ctx_int8, dspark_zero, dflash_zero


def _draft(root: Path, target_hf: Path, name: str, kind: str, factor: float, weight_format: str = "fp32",
           draft_block_size: int = 4, num_layers: int = 2) -> Path:  # fmt: skip
    hf = make_scaled_draft(root / f"hf-{name}", target_hf, kind, factor, draft_block_size=draft_block_size, num_layers=num_layers)
    return export_draft(hf, root / f"ov-{name}", weight_format=weight_format)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("speculative")
    # initializer_range 0.05 and layers at 10%: about half the greedy tokens equal the bigram guess.
    mixed_hf = make_tiny_target(root / "hf-mixed", "qwen3", seed=3, initializer_range=0.05)
    edit_weights(mixed_hf, lambda w: (scale_residual_writes(w, 0.1), unit_final_norm(w)))
    chain_hf, succ = make_chain_target(root / "hf-chain")
    drafts = {
        "dspark_ctx": _draft(root, mixed_hf, "dspark_ctx", "dspark", 0.01),
        "dflash_ctx": _draft(root, mixed_hf, "dflash_ctx", "dflash", 1.0, draft_block_size=5),
        "dspark_ctx_int8": _draft(root, mixed_hf, "dspark_ctx_int8", "dspark", 0.01, weight_format="int8"),
        "dspark_zero": _draft(root, mixed_hf, "dspark_zero", "dspark", 0.0, num_layers=1),
        "dflash_zero": _draft(root, mixed_hf, "dflash_zero", "dflash", 0.0, num_layers=1),
    }
    return Models(
        mixed=export_target(mixed_hf, root / "ov-mixed", weight_format="fp32"),
        mixed_int8=export_target(mixed_hf, root / "ov-mixed-int8", weight_format="int8"),
        chain=export_target(chain_hf, root / "ov-chain", weight_format="fp32"),
        succ=succ,
        drafts=drafts,
    )


# ---- engines, shared across tests (a finished run leaves an engine clean) ---------------------------


class CandidateLog:
    """Every proposal of an engine's draft, keyed by (prompt, committed tokens, draft block size).

    The block size (mask rows) decides the candidates; near max_new_tokens only the first of them are
    verified, so two proposals under one key agree on their common prefix.

    A spy around DFlashDrafter._run: the real inference runs, its result is recorded.
    """

    def __init__(self, engine: LLMEngine):
        self.entries: dict[tuple, list[int]] = {}
        drafter = engine.drafter
        run = drafter._run
        offset = drafter.spec.candidate_position_offset

        def recording_run(windows):
            candidates = run(windows)
            for window in windows:
                request = window.request
                if request.req_id in candidates:
                    tokens = list(candidates[request.req_id])
                    key = (tuple(request.prompt_token_ids), request.num_tokens, window.num_block_rows - offset)
                    if len(tokens) > len(self.entries.get(key, ())):
                        self.entries[key] = tokens
            return candidates

        drafter._run = recording_run


@dataclass
class Engines:
    models: Models
    cache: dict[tuple, LLMEngine] = field(default_factory=dict)
    logs: dict[int, CandidateLog] = field(default_factory=dict)

    def get(self, target: str, draft: str | None, **config) -> LLMEngine:
        """An engine for target ("mixed", "mixed_int8", "chain") and draft (None: the target alone)."""
        key = (target, draft, tuple(sorted(config.items())))
        if key not in self.cache:
            settings = dict(ov_config=F32, num_kv_blocks=64, num_draft_kv_blocks=64, max_num_batched_tokens=256)
            settings.update(config)
            draft_dir = self.models.drafts[draft] if draft else None
            engine = LLMEngine(getattr(self.models, target), EngineConfig(**settings), draft_dir=draft_dir)
            if draft:
                self.logs[id(engine)] = CandidateLog(engine)
            self.cache[key] = engine
        return self.cache[key]

    def log(self, engine: LLMEngine) -> CandidateLog:
        return self.logs[id(engine)]


@pytest.fixture(scope="module")
def engines(models) -> Engines:
    return Engines(models)


# ---- running scenarios -----------------------------------------------------------------------------


@dataclass
class Run:
    results: list[GenerationResult]
    requests: list[Request]  # the scheduler's Request objects, in arrival order
    token_steps: list[int]  # per request: outputs that carried tokens (one per sampling step)
    spec_delta: SpecDecodingStats  # the engine-wide counters over this run


def drive(engine: LLMEngine, arrivals: Sequence[tuple[int, object, SamplingParams]],
          req_ids: Sequence[str | None] | None = None) -> Run:  # fmt: skip
    """Add each (step, prompt, params) before that step, run to the end, collect in arrival order."""
    before = copy.deepcopy(engine.spec_stats)
    req_ids = list(req_ids or [None] * len(arrivals))
    ids: list[str] = []
    requests: list[Request | None] = []
    token_steps: dict[str, int] = defaultdict(int)
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    for step in range(MAX_STEPS):
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            ids.append(engine.add_request(arrivals[i][1], arrivals[i][2], req_id=req_ids[i]))
            requests.append(engine.scheduler.get_request(ids[-1]))
        if not pending and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.new_token_ids:
                token_steps[output.req_id] += 1
    assert not engine.has_unfinished_requests(), f"still unfinished after {MAX_STEPS} steps"
    results = [engine.result(req_id) for req_id in ids]
    assert_pools_full(engine)
    delta = copy.deepcopy(engine.spec_stats)
    _subtract(delta, before)
    return Run(results, requests, [token_steps[r] for r in ids], delta)


def _subtract(stats: SpecDecodingStats, before: SpecDecodingStats) -> None:
    stats.num_drafts -= before.num_drafts
    stats.num_draft_tokens -= before.num_draft_tokens
    stats.num_accepted_tokens -= before.num_accepted_tokens
    for mine, theirs in ((stats.drafted_per_position, before.drafted_per_position),
                         (stats.accepted_per_position, before.accepted_per_position)):  # fmt: skip
        for i, count in enumerate(theirs):
            mine[i] -= count
        while mine and mine[-1] == 0:  # positions this run never drafted
            mine.pop()


def run_all(engine: LLMEngine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] = GREEDY) -> Run:
    all_params = params if isinstance(params, Sequence) else [params] * len(prompts)
    return drive(engine, [(0, p, sp) for p, sp in zip(prompts, all_params, strict=True)])


def assert_pools_full(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_used_blocks == 0
    engine.block_pool.assert_all_free()
    if engine.has_draft:
        assert engine.drafter.kv_cache_manager.pool.num_used_blocks == 0
        engine.drafter.kv_cache_manager.pool.assert_all_free()
        assert not engine.drafter._states, "the draft still tracks finished requests"


def reference(engines: Engines, target: str, prompts: Sequence, params) -> list[list[int]]:
    """The target alone (no draft), one roomy engine: f32 tokens do not depend on scheduling."""
    all_params = params if isinstance(params, Sequence) else [params] * len(prompts)
    run = run_all(engines.get(target, None), prompts, all_params)
    return [r.token_ids for r in run.results]


def check_metrics(run: Run) -> None:
    """Committed tokens = sum over verification steps of (accepted + 1) + one per step without
    candidates; the engine-wide counters are the sum of the per-request ones."""
    total = SpecDecodingStats()
    for result, steps in zip(run.results, run.token_steps):
        spec = result.spec
        assert spec is not None
        assert spec.num_drafts <= steps
        assert len(result.token_ids) == spec.num_accepted_tokens + steps, result.req_id
        assert spec.num_accepted_tokens <= spec.num_draft_tokens
        assert sum(spec.drafted_per_position) == spec.num_draft_tokens
        assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
        total.merge(spec)
    assert total.to_json() == run.spec_delta.to_json()


def check_same_candidates(entries: dict[tuple, list[int]], baseline: dict[tuple, list[int]], min_overlap: int = 1) -> None:
    """Where a run proposed for the same committed tokens and block size as the baseline, it proposed
    the same (as far as both verified)."""
    shared = [key for key in entries if key in baseline]
    assert len(shared) >= min_overlap
    for key in shared:
        mine, theirs = entries[key], baseline[key]
        n = min(len(mine), len(theirs))
        assert n > 0 and mine[:n] == theirs[:n], f"different candidates at {key[1]} tokens"


def ids_of(engine: LLMEngine, prompts: Sequence[str]) -> list[list[int]]:
    return [list(engine.tokenizer(p)["input_ids"]) for p in prompts]


# ---- the chain target: acceptance under control ------------------------------------------------------


def test_chain_target_follows_its_successors(models, engines):
    cycle, constant = chain_prompts(models.succ)
    run = run_all(engines.get("chain", None), cycle + constant)
    for prompt, result in zip(cycle + constant, run.results):
        assert result.token_ids == chain_of(models.succ, prompt[-1], NEW_TOKENS)
    assert all(t not in (A, MASK) for r in run.results[: len(cycle)] for t in r.token_ids)


def simulate_acceptance(num_new_tokens: int, k_max: int, accept: Callable[[int], int]) -> SpecDecodingStats:
    """The counters a request must show: the first token comes from the prompt step, then each step
    drafts min(K, room) candidates (room: what max_new_tokens leaves after the bonus token) and
    commits accept(k) + 1 tokens; a step with no room drafts nothing and commits one token."""
    stats, num_out = SpecDecodingStats(), 1
    while num_out < num_new_tokens:
        k = min(k_max, num_new_tokens - num_out - 1)
        accepted = accept(k) if k > 0 else 0
        stats.observe(k, accepted)
        num_out += accepted + 1
    return stats


@pytest.mark.parametrize(
    "draft, regime, accepted_by_position",
    [
        ("dspark_zero", "cycle", [1.0, 0.0, 0.0, 0.0]),  # [succ(seed) ✓, A ✗, ...]: partial, exactly 1
        ("dspark_zero", "constant", [1.0, 1.0, 1.0, 1.0]),  # [A, A, A, A] after A: full
        ("dflash_zero", "cycle", [0.0, 0.0, 0.0]),  # [A, A, A] after an ordinary token: zero
        ("dflash_zero", "constant", [1.0, 1.0, 1.0]),  # full
    ],
)
def test_full_partial_and_zero_acceptance(models, engines, draft, regime, accepted_by_position):
    cycle, constant = chain_prompts(models.succ)
    prompts = cycle if regime == "cycle" else constant
    engine = engines.get("chain", draft)
    run = run_all(engine, prompts)
    assert [r.token_ids for r in run.results] == [chain_of(models.succ, p[-1], NEW_TOKENS) for p in prompts]
    check_metrics(run)
    k_max = len(accepted_by_position)
    stats = run.spec_delta
    assert stats.num_drafts > 0
    assert stats.acceptance_by_position == pytest.approx(accepted_by_position)
    if accepted_by_position[-1] == 1.0:
        expected = simulate_acceptance(NEW_TOKENS, k_max, lambda k: k)  # full: 5, 5, 5, 5, then 3 tokens
    elif accepted_by_position[0] == 1.0:
        expected = simulate_acceptance(NEW_TOKENS, k_max, lambda k: 1)  # partial: 2 tokens per step
    else:
        expected = simulate_acceptance(NEW_TOKENS, k_max, lambda k: 0)  # zero: 1 token per step
    for result in run.results:
        assert result.spec.to_json() == expected.to_json()
        assert result.spec.drafted_per_position == expected.drafted_per_position
    merged = SpecDecodingStats()
    for _ in prompts:
        merged.merge(expected)
    assert stats.to_json() == merged.to_json()
    assert stats.mean_accepted_length == pytest.approx(
        {"dspark_zero-constant": 1 + 18 / 5, "dflash_zero-constant": 1 + 17 / 6}.get(
            f"{draft}-{regime}", 2.0 if accepted_by_position[0] == 1.0 else 1.0
        )
    )


def simulate_heuristic(num_new_tokens: int, k_max: int, start: int, accept: Callable[[int], int]) -> SpecDecodingStats:
    """simulate_acceptance under transformers' heuristic schedule: the block starts at `start`, grows
    by 2 (up to k_max) after a step that accepted every drafted candidate, else shrinks by 1 (not below 1)."""
    stats, num_out, block = SpecDecodingStats(), 1, min(start, k_max)
    while num_out < num_new_tokens:
        k = min(block, num_new_tokens - num_out - 1)
        accepted = accept(k) if k > 0 else 0
        stats.observe(k, accepted)
        num_out += accepted + 1
        if k > 0:
            block = min(k_max, block + 2) if accepted >= k else max(1, block - 1)
    return stats


@pytest.mark.parametrize(
    "draft, regime, accept",
    [
        ("dspark_zero", "cycle", lambda k: min(k, 1)),  # partial: the block oscillates 1, 3, 2, 1, 3, ...
        ("dspark_zero", "constant", lambda k: k),  # full: 2, 4, 4, ...
        ("dflash_zero", "cycle", lambda k: 0),  # zero: 2, 1, 1, ...
        ("dflash_zero", "constant", lambda k: k),  # full: 2, 3, 3, ...
    ],
)
def test_heuristic_schedule_follows_acceptance(models, engines, draft, regime, accept):
    cycle, constant = chain_prompts(models.succ)
    prompts = cycle if regime == "cycle" else constant
    engine = engines.get("chain", draft)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens=2,
                            num_assistant_tokens_schedule="heuristic")  # fmt: skip
    run = run_all(engine, prompts, params)
    assert [r.token_ids for r in run.results] == [chain_of(models.succ, p[-1], NEW_TOKENS) for p in prompts]
    check_metrics(run)
    expected = simulate_heuristic(NEW_TOKENS, engine.drafter.spec.max_candidates, 2, accept)
    for result in run.results:
        assert result.spec.to_json() == expected.to_json()
    assert_pools_full(engine)


@pytest.mark.parametrize("draft", ["dspark_ctx", "dflash_ctx"])
def test_adaptive_schedule_is_lossless_and_stays_in_the_block(engines, mixed_reference, draft):
    """The adaptive schedule changes how many candidates each step drafts (0 up to the request's
    num_assistant_tokens), never the tokens; 16 requests at once give it steps of many row counts."""
    engine = engines.get("mixed", draft)
    texts = list(mixed_reference)[:16]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens_schedule="adaptive")
    run = run_all(engine, texts, params)
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in texts]
    check_metrics(run)
    max_k = engine.drafter.spec.max_candidates
    assert all(len(r.spec.drafted_per_position) <= max_k for r in run.results)
    adaptive = engine.drafter.adaptive
    # the steps' costs reach the schedule (each shape measured from its second step on: in so short a
    # run every draft step may be the first of its shape), steps whose rows changed flagged as such
    # (exploration changes the block's size every step)
    observations = [o for cost in adaptive.target_costs.values() for o in cost.observations]
    assert observations and {model for model, _ in adaptive._seen_shapes} == {"target", "draft"}
    assert any(reshaped for (_, reshaped), _ in observations)
    assert engine.drafter.stats.num_decisions > 0
    assert_pools_full(engine)


def test_the_adaptive_schedule_knows_whether_requests_wait_for_a_place(engines, mixed_reference):
    """Three requests, two places, a small token budget: while the third waits, a request that ends
    early hands its place on, and the schedule plans for throughput (closed=False); once nothing waits,
    the running requests are all there is to finish (closed=True). Steps are priced at the batch's size,
    requests still reading their prompts (or admitted and held back by the token budget) included.
    Output stays the target's."""
    engine = engines.get("mixed", "dspark_ctx", max_num_seqs=2, max_num_batched_tokens=16)
    adaptive = engine.drafter.adaptive
    seen: list[tuple[bool, int, int, int]] = []

    def spy(candidates, **kwargs):
        num_requests = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        seen.append((kwargs["closed"], kwargs["num_generating"], len(candidates), num_requests))
        return plan(candidates, **kwargs)

    plan, adaptive.plan = adaptive.plan, spy
    try:
        texts = TEXTS[:3]
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens_schedule="adaptive")
        run = run_all(engine, texts, params)
    finally:
        del adaptive.plan  # the class's own again
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in texts]
    assert all(closed == (num_requests <= 2) for closed, _, _, num_requests in seen)
    assert all(batch == min(num_requests, 2) for _, batch, _, num_requests in seen)
    assert {closed for closed, *_ in seen} == {False, True}
    assert any(num_candidates < batch for _, batch, num_candidates, _ in seen)  # one still reads its prompt


class PausingSchedule:
    """The constant schedule, switched off on the steps where `on(step)` is false."""

    def __init__(self, on: Callable[[int], bool]):
        self.on, self.step = on, 0

    def plan(self, candidates, **_) -> dict[str, int]:
        self.step += 1
        return {c.req_id: c.cap if self.on(self.step) else 0 for c in candidates}

    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


@pytest.mark.parametrize("draft", ["dspark_ctx", "dflash_ctx"])
def test_drafting_paused_and_resumed_mid_request_is_lossless_and_catches_up(engines, mixed_reference, baseline, draft):
    """Drafting off for three steps, on for three, and so on: the target alone runs while it is off,
    the committed rows wait in the ledger, and the first draft step after a pause reads them all in
    one pass. Outputs equal the target alone, and the candidates after a catch-up equal those of a
    draft that never paused (same committed tokens, same block: the draft's KV is the same)."""
    engine = engines.get("mixed", draft)
    log = engines.log(engine)
    log.entries.clear()
    drafter = engine.drafter
    constant = drafter.schedules["constant"]
    drafter.schedules["constant"] = PausingSchedule(lambda step: (step // 3) % 2 == 1)
    idle_before = drafter.stats.num_idle_steps
    try:
        run = run_all(engine, SIXTEEN[:8])
    finally:
        drafter.schedules["constant"] = constant
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in SIXTEEN[:8]]
    check_metrics(run)
    assert drafter.stats.num_idle_steps > idle_before and run.spec_delta.num_drafts > 0
    check_same_candidates(log.entries, baseline[draft], min_overlap=5)


@pytest.mark.parametrize("draft", ["dspark_zero", "dflash_zero"])
def test_adaptive_schedule_stops_drafting_where_nothing_is_accepted(models, engines, draft):
    """On the chain target's cycle prompts the DFlash zero draft accepts nothing: the adaptive
    schedule turns drafting off (steps without a draft inference) and output stays the target's."""
    cycle, _ = chain_prompts(models.succ)
    engine = engines.get("chain", draft, max_num_batched_tokens=64)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, num_assistant_tokens_schedule="adaptive")
    prompts = cycle * 2
    run = run_all(engine, prompts, params)
    assert [r.token_ids for r in run.results] == [chain_of(models.succ, p[-1], 64) for p in prompts]
    check_metrics(run)
    stats = engine.drafter.stats
    if draft == "dflash_zero":
        assert stats.num_idle_steps > 0 and stats.drafting_share < 0.5
    else:  # the DSpark zero draft accepts its first candidate every step: drafting pays
        assert run.spec_delta.mean_accepted_length > 1.5


@pytest.mark.parametrize("draft", ["dspark_zero", "dflash_zero"])
def test_max_new_tokens_ends_inside_a_block(models, engines, draft):
    """Full acceptance: max_new_tokens that no whole number of blocks reaches is still met exactly."""
    _, constant = chain_prompts(models.succ)
    engine = engines.get("chain", draft)
    params = [SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=n, ignore_eos=True) for n in range(1, 12)]
    prompts = [constant[i % len(constant)] for i in range(len(params))]
    run = run_all(engine, prompts, params)
    for result, sp in zip(run.results, params):
        assert result.token_ids == [A] * sp.max_new_tokens
        assert result.finish_reason == "length"
    check_metrics(run)


@pytest.mark.parametrize("stop_index", [0, 3, 4, 7])
def test_stop_token_inside_the_candidates(models, engines, stop_index):
    """With the DSpark zero draft each step verifies [succ(seed), A, ...] and commits an accepted
    candidate (odd positions) then a bonus token (even positions). A stop token at an accepted
    candidate ends the request there: the bonus token after it is not committed."""
    cycle, _ = chain_prompts(models.succ)
    prompt = cycle[1]
    expected = chain_of(models.succ, prompt[-1], NEW_TOKENS)
    stop = expected[stop_index]
    params = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[stop])
    assert reference(engines, "chain", [prompt], params) == [expected[: stop_index + 1]]
    engine = engines.get("chain", "dspark_zero")
    run = run_all(engine, [prompt], params)
    result = run.results[0]
    assert result.token_ids == expected[: stop_index + 1]
    assert result.finish_reason == "stop" and result.stop_reason == f"stop token {stop}"
    check_metrics(run)


def test_stop_string_inside_the_candidates(models, engines):
    """A stop string completed by an accepted candidate ends the request at that token, as the
    target alone would: the tokens after it in the same block are not committed."""
    cycle, _ = chain_prompts(models.succ)
    engine = engines.get("chain", "dspark_zero")
    checked = 0
    for prompt in cycle:
        expected = chain_of(models.succ, prompt[-1], NEW_TOKENS)
        for index in range(3, NEW_TOKENS - 2, 2):  # accepted-candidate positions
            piece = engine.tokenizer.decode([expected[index]])
            before = engine.tokenizer.decode(expected[:index])
            if not (piece.isascii() and piece.strip() and len(piece) >= 2 and piece not in before):
                continue
            params = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_strings=[piece])
            ref = reference(engines, "chain", [prompt], params)[0]
            assert len(ref) == index + 1  # the target alone stops at the token completing it
            run = run_all(engine, [prompt], params)
            assert run.results[0].token_ids == ref
            assert run.results[0].finish_reason == "stop"
            check_metrics(run)
            checked += 1
            break
    assert checked >= 2


@pytest.mark.parametrize("draft", ["dspark_zero", "dflash_zero"])
def test_eos_accepted_as_a_candidate_ends_the_request(models, engines, draft):
    """EOS sits on the chain: a prompt ending four steps before it reaches EOS at output position 3,
    an accepted candidate for the DSpark draft (a bonus token for DFlash). Either way the request
    ends with EOS, as with the target alone."""
    pred = {y: x for x, y in models.succ.items() if x not in (0, 1, MASK, A)}
    last = pred[pred[pred[pred[EOS]]]]
    prompt = chain_prompts(models.succ)[0][2] + [last]
    params = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS)
    expected = chain_of(models.succ, last, 4)
    assert expected[-1] == EOS and reference(engines, "chain", [prompt], params) == [expected]
    run = run_all(engines.get("chain", draft), [prompt], params)
    result = run.results[0]
    assert result.token_ids == expected
    assert result.finish_reason == "stop" and result.stop_reason == f"stop token {EOS}"
    check_metrics(run)
    if draft == "dspark_zero":  # [t1 ✓, A ✗] then [t3 = EOS ✓ (cut: no bonus), A, ...]
        assert result.spec.num_drafts == 2 and result.spec.num_accepted_tokens == 1


def test_abort_while_drafting_returns_every_block(models, engines):
    cycle, constant = chain_prompts(models.succ)
    engine = engines.get("chain", "dspark_zero")
    ids = [engine.add_request(p, GREEDY) for p in cycle + constant]
    for _ in range(3):
        engine.step()
    assert engine.drafter.kv_cache_manager.pool.num_used_blocks > 0
    assert engine.abort_request(ids[1]) and engine.abort_request(ids[-1])
    engine.run_until_done()
    results = [engine.result(i) for i in ids]
    assert results[1].finish_reason == "abort" and results[-1].finish_reason == "abort"
    for prompt, result in list(zip(cycle + constant, results))[2:-1]:
        assert result.token_ids == chain_of(models.succ, prompt[-1], NEW_TOKENS)
    assert_pools_full(engine)


# ---- the mixed target: lossless in every scheduling situation ----------------------------------------

CTX_DRAFTS = ["dspark_ctx", "dflash_ctx"]


@pytest.fixture(scope="module")
def mixed_reference(engines) -> dict[str, list[int]]:
    """Target-alone tokens of every prompt the mixed scenarios use, by prompt text."""
    texts = list(dict.fromkeys(TEXTS + SIXTEEN))
    return dict(zip(texts, reference(engines, "mixed", texts, GREEDY)))


@pytest.fixture(scope="module")
def single_runs(engines, mixed_reference) -> dict[str, tuple[dict[tuple, list[int]], SpecDecodingStats]]:
    """Per draft: each prompt run alone (the single-request scenario), with the candidates it
    proposed (the reference for the draft ledger) and its acceptance counters."""
    out = {}
    for draft in CTX_DRAFTS:
        engine = engines.get("mixed", draft)
        log = engines.log(engine)
        log.entries.clear()
        stats = SpecDecodingStats()
        for text in mixed_reference:
            run = run_all(engine, [text])
            assert run.results[0].token_ids == mixed_reference[text]
            check_metrics(run)
            stats.merge(run.spec_delta)
        out[draft] = (dict(log.entries), stats)
        log.entries.clear()
    return out


@pytest.fixture(scope="module")
def baseline(single_runs) -> dict[str, dict[tuple, list[int]]]:
    return {draft: candidates for draft, (candidates, _) in single_runs.items()}


def test_single_requests_and_acceptance_of_the_ctx_drafts(single_runs):
    # The DSpark anchor row guesses the bigram token, right about half the time; the random
    # DFlash draft's mask rows hardly ever match.
    candidates, spark = single_runs["dspark_ctx"]
    assert 0.2 < spark.acceptance_by_position[0] < 0.9
    assert spark.mean_accepted_length > 1.2
    assert len({tuple(t) for t in candidates.values()}) > 10
    candidates, flash = single_runs["dflash_ctx"]
    assert flash.num_drafts > 0 and flash.acceptance_rate < 0.2
    assert len({tuple(t) for t in candidates.values()}) > 10


@pytest.mark.parametrize("draft", CTX_DRAFTS)
def test_block_keeps_its_mask_rows_near_max_new_tokens(engines, mixed_reference, baseline, draft):
    """When max_new_tokens leaves room for fewer candidates than the block drafts, the draft still
    runs the whole block (the mask rows attend to each other) and only its first rows are verified:
    the candidates are a prefix of what the same block drafts with room to spare."""
    engine = engines.get("mixed", draft)
    log = engines.log(engine)
    log.entries.clear()
    max_k = engine.drafter.spec.max_candidates
    texts = list(mixed_reference)[:6]
    for n in range(2, max_k + 2):
        params = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=n, ignore_eos=True)
        run = run_all(engine, texts, params)
        assert [r.token_ids for r in run.results] == [mixed_reference[t][:n] for t in texts]
    short = {key: tokens for key, tokens in log.entries.items() if len(tokens) < key[2]}
    assert short, "no proposal was cut by max_new_tokens"
    check_same_candidates(short, baseline[draft], min_overlap=len(short))


MIXED_SCENARIOS = {
    "batch_of_16": {},
    "token_budget_16": {"max_num_batched_tokens": 16},
    "no_split_fuse": {"dynamic_split_fuse": False},
    "no_prefix_caching": {"enable_prefix_caching": False},
    # 7 target blocks of 32 hold the longest request but not all sixteen at once.
    "target_preemption": {"num_kv_blocks": 7},
    "preemption_chunked": {"num_kv_blocks": 7, "max_num_batched_tokens": 24},
    "preemption_no_split_fuse": {"num_kv_blocks": 7, "dynamic_split_fuse": False},
}


@pytest.mark.parametrize("draft", CTX_DRAFTS)
@pytest.mark.parametrize("scenario", list(MIXED_SCENARIOS))
def test_sixteen_requests_lossless(engines, mixed_reference, baseline, draft, scenario):
    engine = engines.get("mixed", draft, **MIXED_SCENARIOS[scenario])
    log = engines.log(engine)
    log.entries.clear()
    run = run_all(engine, SIXTEEN)
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in SIXTEEN]
    check_metrics(run)
    check_same_candidates(log.entries, baseline[draft], min_overlap=20)
    assert not engine.warnings
    if "preemption" in scenario:
        assert any(r.num_preemptions > 0 for r in run.requests)


@pytest.mark.parametrize("draft", CTX_DRAFTS)
def test_padding_rows_change_no_candidate_and_keep_the_draft_calls_in_buckets(engines, mixed_reference, baseline, draft):
    """Every draft call is padded to a multiple of `row_bucket` rows by a sequence of its own that writes
    into scratch blocks no request holds. Run unpadded, sixteen requests propose exactly what the single
    requests proposed padded (the baseline), so the padding neither changes a candidate nor touches a
    request's keys and values."""
    engine = engines.get("mixed", draft, max_num_batched_tokens=255)  # an engine of its own
    runner, pool = engine.drafter.runner, engine.drafter.kv_cache_manager.pool
    assert runner.row_bucket == ROW_BUCKET and min(runner.scratch_blocks) == pool.num_blocks == runner.num_blocks
    rows_per_call: list[int] = []
    infer = runner._infer

    def recording_infer(seqs, rows, sample_rows):
        rows_per_call.append(len(rows["input_ids"]))
        return infer(seqs, rows, sample_rows)

    runner._infer = recording_infer
    log = engines.log(engine)
    schedule = engine.drafter.adaptive
    try:
        for bucket in (1, ROW_BUCKET):
            runner.row_bucket = bucket
            log.entries.clear()
            rows_per_call.clear()
            schedule._seen_shapes = {seen for seen in schedule._seen_shapes if seen[0] != "draft"}
            run = run_all(engine, SIXTEEN)
            assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in SIXTEEN]
            check_same_candidates(log.entries, baseline[draft], min_overlap=20)
            off_bucket = [rows for rows in rows_per_call if rows % ROW_BUCKET]
            assert off_bucket if bucket == 1 else not off_bucket, rows_per_call
            # the schedule knows the draft's shapes as OpenVINO runs them (its first step of each is not fitted)
            assert {rows for model, rows in schedule._seen_shapes if model == "draft"} == set(rows_per_call)
    finally:
        runner.row_bucket = ROW_BUCKET
        del runner._infer


@pytest.mark.parametrize("draft", CTX_DRAFTS)
def test_staggered_arrivals_with_mixed_num_assistant_tokens(engines, mixed_reference, baseline, draft):
    engine = engines.get("mixed", draft, max_num_batched_tokens=48)
    log = engines.log(engine)
    log.entries.clear()
    choices = [None, 0, 1, 2, 3, None, 8, 0]
    arrivals = [(2 * i, text, SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                             num_assistant_tokens=choices[i % len(choices)]))  # fmt: skip
                for i, text in enumerate(SIXTEEN[:12])]  # fmt: skip
    run = drive(engine, arrivals)
    assert [r.token_ids for r in run.results] == [mixed_reference[a[1]] for a in arrivals]
    check_metrics(run)
    max_k = engine.drafter.spec.max_candidates
    for (_, _, params), result in zip(arrivals, run.results):
        wanted = params.num_assistant_tokens
        if wanted == 0:
            assert result.spec.num_drafts == 0
        else:
            assert result.spec.num_drafts > 0
            k = max_k if wanted is None else min(wanted, max_k)
            assert len(result.spec.drafted_per_position) == k
    check_same_candidates(log.entries, baseline[draft], min_overlap=10)


@pytest.mark.parametrize("draft", CTX_DRAFTS)
def test_prefix_cache_hits_on_both_pipelines(engines, mixed_reference, baseline, draft):
    engine = engines.get("mixed", draft)
    log = engines.log(engine)
    kv_block_size = engine.block_pool.kv_block_size
    assert engine.drafter.kv_cache_manager.kv_block_size == kv_block_size
    prompt_len = len(ids_of(engine, [LONG])[0])
    expected_hit = (prompt_len - 1) // kv_block_size * kv_block_size
    assert expected_hit >= 2 * kv_block_size
    first = run_all(engine, [LONG])
    log.entries.clear()
    restored_before = engine.drafter.num_restored_tokens
    # The same prompt again, and the same prompt followed by other text, side by side.
    other = LONG + " And more."
    second = run_all(engine, [LONG, other])
    assert second.requests[0].num_prefix_cached_tokens == expected_hit
    assert second.requests[1].num_prefix_cached_tokens == expected_hit
    assert engine.drafter.num_restored_tokens - restored_before == 2 * expected_hit
    assert second.results[0].token_ids == first.results[0].token_ids == mixed_reference[LONG]
    assert second.results[1].token_ids == reference(engines, "mixed", [other], GREEDY)[0]
    check_metrics(second)
    # The restored draft KV proposes exactly what the draft proposed after computing the prompt.
    check_same_candidates(log.entries, baseline[draft], min_overlap=5)
    assert second.results[0].spec.to_json() == first.results[0].spec.to_json()


def test_a_full_draft_cache_makes_requests_wait_then_draft_again(engines, mixed_reference):
    """6 draft blocks hold any one request but not sixteen: requests wait for blocks that others
    give back, then draft; none gives up (no warning)."""
    engine = engines.get("mixed", "dspark_ctx", num_draft_kv_blocks=6)
    waits, num_warnings = engine.drafter.stats.num_kv_waits, len(engine.warnings)
    run = run_all(engine, SIXTEEN)
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in SIXTEEN]
    check_metrics(run)
    assert engine.drafter.stats.num_kv_waits > waits and len(engine.warnings) == num_warnings
    # Sixteen requests take turns on a cache that holds about one: most get their turn (12 here;
    # giving up at the first full cache, as requests did before, left most of them on the target).
    assert sum(1 for r in run.results if r.spec.num_drafts > 0) >= 10


def test_draft_cache_too_small_finishes_on_the_target(engines, mixed_reference):
    # 3 draft blocks: the 138-token prompt never fits, and the others take turns.
    engine = engines.get("mixed", "dspark_ctx", num_draft_kv_blocks=3)
    num_warnings = len(engine.warnings)
    run = run_all(engine, SIXTEEN)
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in SIXTEEN]
    check_metrics(run)
    new_warnings = engine.warnings[num_warnings:]
    assert any("draft KV cache is full" in w for w in new_warnings)
    gave_up = {r.req_id for r in run.results if any(f"request {r.req_id}:" in w for w in new_warnings)}
    assert gave_up and len(gave_up) < len(SIXTEEN)
    assert any(r.spec.num_drafts > 0 for r in run.results)
    long_ids = [r for r, t in zip(run.results, SIXTEEN) if t == LONG]
    assert all(r.req_id in gave_up and r.spec.num_drafts == 0 for r in long_ids)


def test_request_id_reuse(engines, mixed_reference):
    engine = engines.get("mixed", "dspark_ctx")
    for text in (TEXTS[2], TEXTS[4], TEXTS[2]):
        run = drive(engine, [(0, text, GREEDY)], req_ids=["again"])
        assert run.results[0].req_id == "again"
        assert run.results[0].token_ids == mixed_reference[text]
        check_metrics(run)
    # Reused right after its result is collected, while another request is still running.
    engine.add_request(LONG, GREEDY, req_id="other")
    engine.add_request(TEXTS[0], SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=3, ignore_eos=True), req_id="again")
    outputs: list[RequestOutput] = []
    while not any(o.req_id == "again" and o.finished for o in outputs):
        outputs += engine.step()
    assert engine.result("again").token_ids == mixed_reference[TEXTS[0]][:3]
    engine.add_request(TEXTS[1], GREEDY, req_id="again")
    engine.run_until_done()
    assert engine.result("again").token_ids == mixed_reference[TEXTS[1]]
    assert engine.result("other").token_ids == mixed_reference[LONG]
    assert_pools_full(engine)


def test_chain_scenarios_with_long_accepted_runs(models, engines):
    """Full and partial acceptance side by side, under preemption and a small token budget."""
    # Twelve prompts of one KV block (18 to 29 tokens) that outgrow it: with 12 blocks in all, the
    # requests admitted first must be preempted for the others to grow.
    rng = np.random.default_rng(1)
    ordinary = [t for t in models.succ if t not in SPECIALS and t != A]
    prompts = [[int(t) for t in rng.choice(ordinary, size=18 + i)] + ([A] if i % 2 else []) for i in range(12)]
    expected = [chain_of(models.succ, p[-1], NEW_TOKENS) for p in prompts]
    for config in ({}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 12}, {"dynamic_split_fuse": False}):
        engine = engines.get("chain", "dspark_zero", **config)
        run = run_all(engine, prompts)
        assert [r.token_ids for r in run.results] == expected, config
        check_metrics(run)
        if "num_kv_blocks" in config:
            assert any(r.num_preemptions > 0 for r in run.requests)


# ---- int8 -----------------------------------------------------------------------------------------


def test_int8_draft_and_int8_target(engines, mixed_reference):
    texts = TEXTS[:5]
    engine = engines.get("mixed", "dspark_ctx_int8")
    run = run_all(engine, texts)
    assert [r.token_ids for r in run.results] == [mixed_reference[t] for t in texts]
    check_metrics(run)
    assert run.spec_delta.num_accepted_tokens > 0
    int8_reference = reference(engines, "mixed_int8", texts, GREEDY)
    for draft in ("dspark_ctx", "dspark_ctx_int8"):
        run = run_all(engines.get("mixed_int8", draft), texts)
        assert [r.token_ids for r in run.results] == int8_reference
        check_metrics(run)
        assert run.spec_delta.num_accepted_tokens > 0


def _compressed(value: ov.Output) -> bool:
    """Whether a weight subgraph starts from an 8-bit (or smaller) integer Constant."""
    stack, seen = [value.get_node()], set()
    while stack:
        node = stack.pop()
        if node.get_instance_id() in seen:
            continue
        seen.add(node.get_instance_id())
        if node.get_type_name() == "Constant" and node.get_output_element_type(0) in (ov.Type.u8, ov.Type.i8,
                                                                                      ov.Type.u4, ov.Type.i4):  # fmt: skip
            return True
        stack.extend(v.get_node() for v in node.input_values())
    return False


def test_graft_keeps_compressed_target_weights(models):
    target = read_ov_model(models.mixed_int8)
    gather = find_embedding_gather(target)
    matmul, port = find_lm_head(target)
    assert _compressed(gather.input_value(0)) and _compressed(matmul.input_value(1 - port))
    draft = read_ov_model(models.drafts["dspark_ctx"])
    graft_embedding(draft, target)
    graft_lm_head(draft, target)
    names = {name for p in draft.inputs for name in p.get_names()}
    assert "input_ids" in names and "inputs_embeds" not in names
    logits = next(o for o in draft.outputs if "logits" in o.get_names())
    assert not any("last_hidden_state" in o.get_names() for o in draft.outputs)
    head = logits.get_node().input_value(0).get_node()
    assert head.get_type_name() == "MatMul"
    assert any(_compressed(v) for v in head.input_values() if v.get_partial_shape().rank.get_length() == 2)
    lookups = [op for op in draft.get_ordered_ops() if op.get_type_name() == "Gather" and _compressed(op.input_value(0))]
    assert lookups, "the grafted embedding lookup lost its compressed table"


# ---- the peer: openvino-genai's own DFlash path on the same checkpoint ----------------------------


@pytest.mark.parametrize("target, draft", [("mixed", "dflash_ctx"), ("chain", "dflash_zero")])
def test_acceptance_equals_openvino_genai_dflash(models, engines, tmp_path, target, draft):
    """openvino-genai 2026.4.1 runs DFlash with optimum-intel's stateful export of the same checkpoint
    (one request at a time). Under f32 both compute the same draft on the same hidden states, so each
    request must accept the same candidates in the same number of steps, and both outputs must equal
    the target alone. The chain pair covers full and zero acceptance; the mixed pair's random draft
    shows that the engines agree where acceptance depends on real draft numerics."""
    import openvino_genai as ov_genai

    from dflash.exporters.genai_draft import export_genai_stateful_draft

    checkpoint = models.drafts[draft].parent / f"hf-{draft}"
    stateful = export_genai_stateful_draft(checkpoint, tmp_path / "stateful", compress_to_fp16=False)
    engine = engines.get(target, draft)
    k = engine.drafter.spec.max_candidates
    if target == "chain":
        cycle, constant = chain_prompts(models.succ)
        prompts = cycle[:3] + constant[:3]
    else:
        prompts = ids_of(engine, TEXTS[:6])
    params = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens=k)
    ours = [run_all(engine, [p], params).results[0] for p in prompts]
    expected = reference(engines, target, prompts, GREEDY)

    scheduler = ov_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False  # its DFlash path rejects prefix caching
    scheduler.num_kv_blocks = 64
    scheduler.max_num_batched_tokens = 256
    properties = {**F32, "draft_model": ov_genai.draft_model(str(stateful), "CPU", **F32)}
    pipeline = ov_genai.ContinuousBatchingPipeline(str(getattr(models, target)), scheduler, "CPU", properties)
    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.num_assistant_tokens = NEW_TOKENS, True, k
    for prompt, mine, reference_tokens in zip(prompts, ours, expected):
        (theirs,) = pipeline.generate([ov.Tensor(np.asarray([prompt], dtype=np.int64))], [config])
        metrics = theirs.extended_perf_metrics
        assert list(theirs.m_generation_ids[0]) == reference_tokens == mine.token_ids
        assert mine.spec.num_accepted_tokens == metrics.get_num_accepted_tokens()
        # One draft inference per verification step (genai's own draft-token counter stays 0 here).
        assert mine.spec.num_drafts == len(metrics.draft_model_metrics.raw_metrics.m_durations)
    if target == "chain":  # the cycle prompts accept nothing, the constant ones everything
        assert [r.spec.acceptance_rate for r in ours] == [0.0] * 3 + [1.0] * 3
    assert_pools_full(engine)
