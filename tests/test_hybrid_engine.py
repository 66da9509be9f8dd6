"""The engine on hybrid linear-attention targets (tiny random Qwen3.5: 3 GatedDeltaNet layers + 1
full-attention layer), with real OpenVINO inference on exports of the project's own exporters.

* The target alone equals transformers' greedy `generate` (its own Qwen3.5 implementation) batched,
  with chunked prefill, with preemption by recompute (a KV pool too small for every request) and with
  a state pool that holds two requests; and equals openvino-genai's ContinuousBatchingPipeline on
  the same IR.
* Speculative decoding stays lossless: with full, partial and zero acceptance, concurrent requests,
  chunked prefill, preemption and a state pool too small for every verification, the tokens are the
  target's own. The "sharp" target (random weights of initializer_range 0.2) depends on its state
  strongly enough that a state block not zeroed before reuse, or a state that kept a rejected
  candidate, changes its tokens (both checked by breaking the engine on purpose). Candidates come
  from an oracle (the target's own continuation with one planted error, so every checkpoint gets
  promoted) on the sharp target; on the "chain" target (every layer silenced,
  exporters/constructed.py) zero drafts give exactly full, partial and zero acceptance.
* Every KV and state block is back in its pool after every scenario (finish, abort, stop inside
  the candidates).

optimum-intel 2.2.0 exports qwen3_5_text only with transformers 5.2.x. Exact comparisons run with
f32 compute and caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import transformers

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.core.errors import InputError
from dflash.exporters.constructed import (
    chain_of,
    chain_prompts,
    make_chain_target,
    make_scaled_draft,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not transformers.__version__.startswith("5.2."),
        reason=f"optimum-intel 2.2.0 exports qwen3_5_text only with transformers 5.2.x (have {transformers.__version__})",
    ),
]

F32 = EXACT_OV_CONFIG
NEW_TOKENS = 24
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens_schedule="constant")
_rng = np.random.default_rng(0)
PROMPTS = [[int(t) for t in _rng.integers(4, 500, n)] for n in (5, 13, 40, 70, 9, 33)]


@dataclass
class Models:
    sharp_hf: Path
    sharp: Path  # random hybrid target whose tokens depend on its state, fp32 IR
    chain: Path  # the successor-chain hybrid target, fp32 IR
    succ: dict[int, int]
    drafts: dict[str, Path]  # dspark_zero, dflash_zero


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    from dflash.exporters.draft import export_draft
    from dflash.exporters.target import export_target
    from dflash.exporters.tiny import make_tiny_target

    root = tmp_path_factory.mktemp("hybrid-engine")
    sharp_hf = make_tiny_target(root / "hf-sharp", "qwen3_5_text", seed=3, initializer_range=0.2)
    chain_hf, succ = make_chain_target(root / "hf-chain", family="qwen3_5_text")
    drafts = {}
    for name, kind in (("dspark_zero", "dspark"), ("dflash_zero", "dflash")):
        hf = make_scaled_draft(root / f"hf-{name}", chain_hf, kind, 0.0, num_layers=1)
        drafts[name] = export_draft(hf, root / f"ov-{name}", weight_format="fp32")
    return Models(
        sharp_hf=sharp_hf,
        sharp=export_target(sharp_hf, root / "ov-sharp", weight_format="fp32"),
        chain=export_target(chain_hf, root / "ov-chain", weight_format="fp32"),
        succ=succ,
        drafts=drafts,
    )


@pytest.fixture(scope="module")
def expected(models) -> list[list[int]]:
    """transformers' greedy `generate` of every prompt (EOS does not stop it: the engine ignores it too)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(models.sharp_hf, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist() for p in PROMPTS]


def engine_for(target: Path, draft: Path | None = None, **config) -> LLMEngine:
    settings = dict(ov_config=F32, num_kv_blocks=32, num_draft_kv_blocks=32, max_num_batched_tokens=256)
    return LLMEngine(target, EngineConfig(**{**settings, **config}), draft_dir=draft)


def run(engine: LLMEngine, prompts, params: SamplingParams = GREEDY):
    """(token ids per prompt, the scheduler's Request objects); checks that every block came back."""
    ids = [engine.add_request(p, params) for p in prompts]
    requests = [engine.scheduler.get_request(i) for i in ids]
    engine.run_until_done()
    results = [engine.result(i) for i in ids]
    assert_pools_full(engine)
    return results, requests


def assert_pools_full(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.block_pool.assert_all_free()
    state = engine.kv_cache_manager.state_pool
    assert state.num_free == state.num_blocks and not state._owned, "state blocks still held"
    if engine.has_draft:
        engine.drafter.kv_cache_manager.pool.assert_all_free()


# ---- the target alone ------------------------------------------------------------------------------

SCENARIOS = {
    "batched": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempted": {"num_kv_blocks": 4, "max_num_batched_tokens": 32},  # 6 requests of up to 3 blocks of 32
    "two_state_blocks": {"num_state_blocks": 2},  # two requests at a time
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_target_alone_equals_transformers_generate(models, expected, scenario):
    engine = engine_for(models.sharp, **SCENARIOS[scenario])
    results, requests = run(engine, PROMPTS)
    assert [r.token_ids for r in results] == expected
    if scenario == "preempted":
        assert sum(r.num_preemptions for r in requests) > 0


def test_openvino_genai_continuous_batching_gives_the_same_tokens(models, expected):
    import openvino as ov
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.num_kv_blocks, scheduler.max_num_batched_tokens, scheduler.enable_prefix_caching = 32, 256, False
    pipeline = ov_genai.ContinuousBatchingPipeline(str(models.sharp), scheduler, "CPU", F32)
    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.do_sample = NEW_TOKENS, True, False
    results = pipeline.generate([ov.Tensor(np.asarray([p], dtype=np.int64)) for p in PROMPTS], [config] * len(PROMPTS))
    assert [list(r.m_generation_ids[0]) for r in results] == expected


# ---- speculative decoding --------------------------------------------------------------------------

class OracleCandidates:
    """Candidates that are the target's own continuation (from transformers) with one planted error
    at a position that cycles through 0..K (K: none), so every checkpoint gets promoted, the first
    (nothing accepted) to the last (all accepted), on a target whose tokens depend on its state.

    A spy around DFlashDrafter._run: the draft's real inference runs, then its candidates are replaced.
    """

    def __init__(self, engine: LLMEngine, expected: list[list[int]]):
        self.continuations = {tuple(p): e for p, e in zip(PROMPTS, expected)}
        self.planted: list[int] = []
        drafter = engine.drafter
        run_draft = drafter._run

        def oracle_run(windows):
            candidates = run_draft(windows)
            for window in windows:
                request = window.request
                proposed = candidates.get(request.req_id)
                if proposed:
                    candidates[request.req_id] = self.propose(request, len(proposed))
            return candidates

        drafter._run = oracle_run

    def propose(self, request, k: int) -> tuple[int, ...]:
        n = request.num_output_tokens
        tokens = list(self.continuations[tuple(request.prompt_token_ids)][n : n + k])
        tokens += [5] * (k - len(tokens))  # beyond max_new_tokens: never verified
        error = (n + len(self.planted)) % (k + 1)
        if error < k:
            tokens[error] = 4 if tokens[error] != 4 else 5
        self.planted.append(error)
        return tuple(tokens)


# (draft, candidates per step, engine settings). The DFlash zero draft's [A, A, A] is never accepted; the
# oracle (the DSpark zero draft's candidates replaced) accepts 0, 1, ..., K candidates in turn, and
# with K=1 one candidate (all of them) every other step.
SPECULATIVE = {
    "zero": ("dflash_zero", 3, {}),
    "full_or_nothing": ("oracle", 1, {}),
    "every_checkpoint": ("oracle", 4, {}),
    "every_checkpoint_chunked": ("oracle", 4, {"max_num_batched_tokens": 16}),
    "every_checkpoint_preempted": ("oracle", 4, {"num_kv_blocks": 4, "max_num_batched_tokens": 32}),
    # 6 committed blocks and 3 to verify with: who verifies, and how many candidates, depends on the step.
    "every_checkpoint_tiny_state_pool": ("oracle", 4, {"num_state_blocks": 9}),
}


@pytest.mark.parametrize("scenario", SPECULATIVE)
def test_speculative_decoding_equals_the_target_alone(models, expected, scenario):
    draft, k, config = SPECULATIVE[scenario]
    engine = engine_for(models.sharp, models.drafts["dspark_zero" if draft == "oracle" else draft], **config)
    oracle = OracleCandidates(engine, expected) if draft == "oracle" else None
    limited = spy_on_checkpoint_limit(engine)
    results, requests = run(engine, PROMPTS, _with_candidates(k))
    assert [r.token_ids for r in results] == expected
    stats = engine.spec_stats
    drafted, accepted = stats.drafted_per_position, stats.accepted_per_position
    accepted = accepted + [0] * (len(drafted) - len(accepted))
    assert stats.num_drafts > 0
    if scenario == "zero":
        assert sum(accepted) == 0 and drafted[0] > 50
    elif scenario == "full_or_nothing":
        assert set(oracle.planted) == {0, 1} and 0 < accepted[0] < drafted[0]
    elif scenario == "every_checkpoint_tiny_state_pool":
        assert any(limited)  # steps verified fewer candidates than proposed, for want of checkpoints
    else:  # every number of accepted candidates, 0 to 4, happened
        assert set(oracle.planted) == {0, 1, 2, 3, 4}
        assert 0 < accepted[3] < accepted[0] < drafted[0]
    if scenario == "every_checkpoint_preempted":
        assert sum(r.num_preemptions for r in requests) > 0
    if not scenario.endswith("tiny_state_pool"):
        assert not any(limited)  # the default pool has checkpoints for every verification


def spy_on_checkpoint_limit(engine: LLMEngine) -> list[bool]:
    """Records, per verification the scheduler plans, whether the state pool cut its candidates."""
    manager, limited = engine.kv_cache_manager, []
    limit = manager.limit_spec_tokens

    def recording_limit(request, num_spec: int) -> int:
        allowed = limit(request, num_spec)
        limited.append(allowed < num_spec)
        return allowed

    manager.limit_spec_tokens = recording_limit
    return limited


def _with_candidates(k: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens=k,
                          num_assistant_tokens_schedule="constant")  # fmt: skip


@pytest.mark.parametrize(
    "draft, regime, acceptance",
    [
        ("dspark_zero", "cycle", [1.0, 0.0, 0.0, 0.0]),  # [succ(seed) ✓, A ✗, ...]: exactly one accepted
        ("dspark_zero", "constant", [1.0, 1.0, 1.0, 1.0]),  # [A, A, A, A] after A: all accepted
        ("dflash_zero", "cycle", [0.0, 0.0, 0.0]),  # [A, A, A] after an ordinary token: none
    ],
)
def test_chain_target_acceptance_is_exact(models, draft, regime, acceptance):
    cycle, constant = chain_prompts(models.succ)
    prompts = cycle if regime == "cycle" else constant
    engine = engine_for(models.chain, models.drafts[draft], max_num_batched_tokens=32)
    results, _ = run(engine, prompts, _with_candidates(len(acceptance)))
    assert [r.token_ids for r in results] == [chain_of(models.succ, p[-1], NEW_TOKENS) for p in prompts]
    assert engine.spec_stats.acceptance_by_position == pytest.approx(acceptance)


def test_abort_and_stops_inside_the_candidates_return_every_state_block(models, expected):
    engine = engine_for(models.sharp, models.drafts["dspark_zero"])
    OracleCandidates(engine, expected)
    params = _with_candidates(4)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    assert engine.kv_cache_manager.state_pool.num_free < engine.kv_cache_manager.state_pool.num_blocks
    assert engine.abort_request(ids[1])
    engine.run_until_done()
    results = [engine.result(i) for i in ids]
    assert results[1].finish_reason == "abort"
    assert [r.token_ids for i, r in enumerate(results) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    assert_pools_full(engine)
    # A stop token that is the 3rd generated token: inside the candidates of a verification.
    stop = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(expected[3][2],), num_assistant_tokens=4,
                          num_assistant_tokens_schedule="constant")  # fmt: skip
    results, _ = run(engine, [PROMPTS[3]], stop)
    assert results[0].token_ids == expected[3][: expected[3].index(expected[3][2]) + 1]


def test_speculative_sampling_returns_every_state_block(models):
    """Sampling at temperature 0.8 on the chain target with the DSpark zero draft: speculative sampling
    keeps a prefix of the candidates and resamples one token; the kept rows' checkpoint is promoted
    as under greedy, every block comes back, and the seeded tokens repeat."""
    cycle, constant = chain_prompts(models.succ)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.8, seed=5, num_assistant_tokens=4,
                            num_assistant_tokens_schedule="constant")  # fmt: skip
    runs = []
    for _ in range(2):
        engine = engine_for(models.chain, models.drafts["dspark_zero"])
        results, _ = run(engine, cycle[:2] + constant[:2], params)
        stats = engine.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert all(len(r.token_ids) == NEW_TOKENS for r in results)
        runs.append([r.token_ids for r in results])
    assert runs[0] == runs[1]


# ---- configuration and the command line -----------------------------------------------------------


def test_prefix_caching_is_refused_in_one_line(models):
    with pytest.raises(InputError, match="prefix caching is not supported for hybrid linear-attention targets") as err:
        engine_for(models.sharp, enable_prefix_caching=True)
    assert "\n" not in err.value.message and err.value.exit_code == 2


def test_validate_generate_and_bench_on_a_hybrid_pair(models, expected, tmp_path):
    import json

    from typer.testing import CliRunner

    from dflash.cli.app import app

    runner = CliRunner()
    target, draft = str(models.sharp), str(models.drafts["dspark_zero"])
    result = runner.invoke(app, ["validate", draft, "--target", target])
    assert result.exit_code == 0, result.output
    f32 = ["--ov-config", "INFERENCE_PRECISION_HINT=f32", "--ov-config", "KV_CACHE_PRECISION=f32"]
    result = runner.invoke(app, ["generate", target, "hello", "--prefix-caching", "-q", *f32])
    assert result.exit_code == 2 and "prefix caching is not supported" in result.output
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, world!\ndef add(a, b):\nThe quick brown fox jumps over the lazy dog.\n")
    report = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", target, "--draft", draft, "--dataset", str(prompts), "--max-new-tokens", "8",
                                 "--concurrency", "1,2", "--warmup", "1", "--json-file", str(report), *f32])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["status"] == "complete" and data["exact"] is True
    spec = [s for s in data["settings"] if s["kind"] == "speculative"]
    assert len(spec) == 2 and all(s["agreement"]["identical"] == s["agreement"]["compared"] == 3 for s in spec)
    assert all(s["errors"] == [] and s["num_generated_tokens"] == 24 for s in data["settings"])
