"""Speculative sampling is lossless: with a draft, sampled tokens are distributed as the target alone's.

The target is the "chain" target of exporters/constructed.py: every layer writes nothing into the
residual stream, so its next-token distribution depends on the last token only (a bigram model) and
the exact distribution of the first tokens of a request is known: P(x_1 .. x_n) = prod_t p(x_t | x_{t-1}),
with p the request's filtered distribution (temperature, top-k, top-p) of the target's logits row for
x_{t-1}, taken from the Hugging Face model. After an ordinary token the target favours its successor on
a long cycle (0.78 at temperature 1); after the constant token A, A again (0.84); the rest is a tail
over the whole vocabulary.

Drafts (tiny, f32):
* dflash_zero: a DFlash draft whose layers write nothing: every block row proposes what follows the
  mask token, about A. After A it agrees with the target (q ~ p); after an ordinary token it disagrees
  everywhere (the target wants the successor, the draft A).
* dspark_markov: a DSpark draft whose layers write nothing, with a Markov head that points each token
  at its successor: the anchor row predicts the target's successor, and with the dense walk
  ("dspark_dense") the later rows mix A (from the mask row) with the successor of the token drawn
  before (the Markov bias), so q depends on the walk. With the Top-K lattice ("dspark_lattice", K 8) a row's candidates are its K best base logits, which rarely hold the successor: its q is
  nearly a point mass on A.

Every run batches thousands of seeded requests (the first NEW_TOKENS tokens of each) for each
combination of parameters and prompt; a chi-square test of each token given the one before against the
exact target distribution, at significance ALPHA, must pass with the real code and fail with each
classic bug planted: a rejection that draws from p instead of the residual, a draft distribution taken
before top-p (the candidate drawn after it), and the bonus drawn from the last candidate's row.
Seeds (f32): with argmax proposals a seeded request's tokens are the target alone's own draws, whatever
the draft, schedule or batch; with sampled proposals they are the same alone or in a batch under the
constant schedule (the number of candidates each step verifies depends only on the request's history).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.core import engine as engine_module
from dflash.core import speculative, verification
from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.drafter import Proposal
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.core.sampler import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    draw,
    draw_rows,
    filtered_probs,
    filtered_probs_rows,
    request_key,
    uniform,
)
from dflash.exporters.constructed import (
    A,
    chain_of,
    edit_weights,
    make_chain_target,
    make_scaled_draft,
    scale_residual_writes,
    unit_final_norm,
)
from dflash.exporters.draft import DRAFT_VOCAB_FILE, export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.target import export_target

pytestmark = pytest.mark.slow  # exports three models and samples ~10^5 requests (about two minutes)

NEW_TOKENS = 5  # the first token comes from the prompt step, then up to 3 candidates + the bonus
BLOCK_SIZE = 4
NUM_SAMPLES = 1500  # per (parameters, prompt)
ALPHA = 1e-3
PARAMS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1.0": SamplingParams(temperature=1.0),
    "top_p0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_k5": SamplingParams(temperature=1.0, top_k=5),
}
ORDINARY_PROMPT = [40, 41, 42]  # ends on an ordinary token: the successor cycle
A_PROMPT = [40, 41, A]  # ends on A
PROMPTS = {"cycle": ORDINARY_PROMPT, "constant": A_PROMPT}
MARKOV_RANK = 32
MARKOV_SCALE = 9.0


# ---- the pair -------------------------------------------------------------------------------------


@dataclass
class Pair:
    target: Path
    drafts: dict[str, Path]
    logits: np.ndarray  # [V, V] f64: the target's next-token logits after each token
    succ: dict[int, int]

    def probs(self, prev: int, params: SamplingParams) -> np.ndarray:
        return filtered_probs(self.logits[prev], params)


def _markov_toward_successors(src: Path, succ: dict[int, int]) -> None:
    """The Markov head's bias after token x peaks at succ(x): W1[x] = scale * W2[succ(x)], unit W2 rows."""
    weights = load_file(str(src / "model.safetensors"))
    vocab = weights["markov_head.markov_w2.weight"].shape[0]
    g = torch.Generator().manual_seed(3)
    w2 = torch.randn(vocab, MARKOV_RANK, generator=g)
    w2 = w2 / w2.norm(dim=-1, keepdim=True)
    following = torch.tensor([succ.get(x, A) for x in range(vocab)])
    weights["markov_head.markov_w2.weight"] = w2
    weights["markov_head.markov_w1.weight"] = MARKOV_SCALE * w2[following]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})


def _target_logits(hf: Path) -> np.ndarray:
    """The chain target's logits after each token, from the Hugging Face model (one-token sequences)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=torch.arange(vocab)[:, None]).logits[:, -1]
    return logits.double().numpy()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    root = tmp_path_factory.mktemp("sampling")
    chain_hf, succ = make_chain_target(root / "hf-chain")
    dflash = make_scaled_draft(root / "hf-dflash-zero", chain_hf, "dflash", 0.0, draft_block_size=BLOCK_SIZE, num_layers=1)
    dspark = make_tiny_draft(root / "hf-dspark", chain_hf, kind="dspark", markov_rank=MARKOV_RANK,
                             draft_block_size=BLOCK_SIZE, num_layers=1, seed=2)  # fmt: skip
    edit_weights(dspark, lambda w: (scale_residual_writes(w, 0.0), unit_final_norm(w)))
    _markov_toward_successors(dspark, succ)
    vocab = json.loads((chain_hf / "config.json").read_text())["vocab_size"]
    # A draft vocabulary of the even token ids: the draft cannot propose half of what the target says.
    (dspark / DRAFT_VOCAB_FILE).write_text(json.dumps({"ranking": list(range(0, vocab, 2)) + list(range(1, vocab, 2))}))
    return Pair(
        target=export_target(chain_hf, root / "ov-chain", weight_format="fp32"),
        drafts={
            "dflash_zero": export_draft(dflash, root / "ov-dflash-zero", weight_format="fp32"),
            "dspark_markov": export_draft(dspark, root / "ov-dspark", weight_format="fp32"),
            "dspark_cut": export_draft(dspark, root / "ov-dspark-cut", weight_format="fp32", draft_vocab_size=vocab // 2),
        },
        logits=_target_logits(chain_hf),
        succ=succ,
    )


# ---- running many requests ------------------------------------------------------------------------


DRAFTS = {  # engine draft name -> (exported draft, engine config)
    "dflash_zero": ("dflash_zero", {}),
    "dspark_dense": ("dspark_markov", {}),  # the default walk
    "dspark_lattice": ("dspark_markov", {"markov_head_top_k": 8}),
    "dspark_cut_vocab": ("dspark_cut", {"markov_head_top_k": 0}),  # proposes even token ids only
    "dspark_cut_lattice": ("dspark_cut", {"markov_head_top_k": 8}),
}


def make_engine(pair: Pair, draft: str | None, proposals: str = "argmax", **overrides) -> LLMEngine:
    config = dict(ov_config=EXACT_OV_CONFIG, num_kv_blocks=1024, num_draft_kv_blocks=1024, max_num_seqs=256,
                  max_num_batched_tokens=2048, draft_proposals=proposals)  # fmt: skip
    draft_dir = None
    if draft is not None:
        name, draft_config = DRAFTS[draft]
        config.update(draft_config)
        draft_dir = pair.drafts[name]
    config.update(overrides)
    return LLMEngine(pair.target, EngineConfig(**config), draft_dir=draft_dir)


def request_params(params: SamplingParams, seed: int, **overrides) -> SamplingParams:
    fields = dict(seed=seed, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens_schedule="constant")
    return replace(params, **{**fields, **overrides})


@dataclass
class Samples:
    tokens: dict[tuple[str, str], np.ndarray]  # (params name, prompt name) -> [NUM_SAMPLES, NEW_TOKENS]
    acceptance: dict[tuple[str, str], float | None]  # accepted / drafted candidates


def sample_all(engine: LLMEngine, params_names: Sequence[str] = tuple(PARAMS), prompt_names: Sequence[str] = tuple(PROMPTS),
               num_samples: int = NUM_SAMPLES) -> Samples:  # fmt: skip
    """Every (params, prompt) num_samples times with seeds 0.., each group in one batched run."""
    tokens, acceptance = {}, {}
    for group in [(p, q) for p in params_names for q in prompt_names]:
        params = [request_params(PARAMS[group[0]], seed) for seed in range(num_samples)]
        chunk = engine.generate([PROMPTS[group[1]]] * num_samples, params)
        tokens[group] = np.array([r.token_ids for r in chunk], dtype=np.int64)
        drafted = sum(r.spec.num_draft_tokens for r in chunk if r.spec is not None)
        accepted = sum(r.spec.num_accepted_tokens for r in chunk if r.spec is not None)
        acceptance[group] = accepted / drafted if drafted else None
    return Samples(tokens, acceptance)


# ---- the test of a distribution ------------------------------------------------------------------------


@dataclass
class ChiSquare:
    statistic: float
    df: int
    impossible: int  # sampled tokens the target gives probability 0

    @property
    def critical(self) -> float:
        return chi_square_critical(self.df, ALPHA)

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.statistic <= self.critical

    def __str__(self) -> str:
        return f"chi2 {self.statistic:.1f} on {self.df} df (critical {self.critical:.1f}), {self.impossible} impossible tokens"


def chi_square_critical(df: int, alpha: float) -> float:
    """The chi-square quantile 1 - alpha (Wilson-Hilferty: within 1% at these df)."""
    z = {1e-3: 3.0902, 1e-2: 2.3263}[alpha]
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(pair: Pair, tokens: np.ndarray, first_prev: int, params: SamplingParams) -> ChiSquare:
    """Each position's token given the token before it (the target is a bigram model, so that is the
    whole condition) against the target's exact distribution: one chi-square over every (position,
    previous token) group; cells expecting fewer than 5 are pooled."""
    statistic, df, impossible = 0.0, 0, 0
    prev_column = np.full(len(tokens), first_prev)
    for position in range(tokens.shape[1]):
        column = tokens[:, position]
        for prev in np.unique(prev_column):
            observed = np.bincount(column[prev_column == prev], minlength=pair.logits.shape[1]).astype(np.float64)
            p = pair.probs(int(prev), params)
            impossible += int(observed[p == 0].sum())
            expected = observed.sum() * p
            big = expected >= 5
            if big.sum() < 1:
                continue
            cells_o, cells_e = list(observed[big]), list(expected[big])
            rest_o, rest_e = observed[~big & (p > 0)].sum(), expected[~big].sum()
            if rest_e >= 5:
                cells_o.append(rest_o)
                cells_e.append(rest_e)
            elif rest_e > 0:  # too small a cell of its own: pooled with the smallest one
                smallest = int(np.argmin(cells_e))
                cells_o[smallest] += rest_o
                cells_e[smallest] += rest_e
            if len(cells_e) < 2:
                continue
            o, e = np.array(cells_o), np.array(cells_e)
            statistic += float(((o - e) ** 2 / e).sum())
            df += len(cells_e) - 1
        prev_column = column
    return ChiSquare(statistic, max(df, 1), impossible)


def check_all(pair: Pair, samples: Samples) -> dict[tuple[str, str], ChiSquare]:
    return {group: chi_square(pair, tokens, PROMPTS[group[1]][-1], PARAMS[group[0]]) for group, tokens in samples.tokens.items()}


def assert_lossless(pair: Pair, samples: Samples) -> None:
    results = check_all(pair, samples)
    failed = {group: str(result) for group, result in results.items() if not result.passed}
    assert not failed, failed


# ---- the verification rule alone (no engine) ---------------------------------------------------------


def _random_logits(rng: np.random.Generator, rows: int, vocab: int, scale: float = 2.0) -> np.ndarray:
    return rng.normal(size=(rows, vocab)) * scale


def _cells_chi_square(observed: np.ndarray, p: np.ndarray) -> ChiSquare:
    """One group's chi-square against p (cells expecting fewer than 5 pooled)."""
    impossible = int(observed[p == 0].sum())
    expected = observed.sum() * p
    big = expected >= 5
    o = np.append(observed[big], observed[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    o, e = o[keep], e[keep]
    return ChiSquare(float(((o - e) ** 2 / e).sum()), max(len(e) - 1, 1), impossible)


def simulate_verification(sampled: bool, accept=None, num: int = 20000) -> list[ChiSquare]:
    """Two candidates of a random draft over a 6-token vocabulary, verified `num` times against a
    random bigram target (row i's logits are a fixed table of the token before, so an off-by-one
    between rows and candidates shows). Chi-squares of each committed token given the one before it,
    per position, where a step committed that far (the rule is exact given any past, acceptance included)."""
    accept = accept or verification.accept_sampled
    rng = np.random.default_rng(0)
    vocab, params = 6, SamplingParams(temperature=1.0, top_p=0.95)
    seed_token = vocab  # the row after the seed (not a token of the small vocabulary)
    table = _random_logits(rng, vocab + 1, vocab, scale=0.7)
    q_table = filtered_probs_rows(_random_logits(rng, vocab + 1, vocab, scale=0.7), params)  # the draft's q after each token
    key = request_key(1)
    transitions = np.zeros((3, vocab + 1, vocab))  # [position, previous token, token]
    for trial in range(num):
        position = 4 * trial  # each trial draws at positions of its own
        if sampled:
            x0 = draw(uniform(key, position, DRAFT_STREAM), q_table[seed_token])
            x1 = draw(uniform(key, position + 1, DRAFT_STREAM), q_table[x0])
            probs = q_table[[seed_token, x0]]
        else:
            x0 = int(np.argmax(q_table[seed_token]))
            x1 = int(np.argmax(q_table[x0]))
            probs = None
        tokens = accept([x0, x1], probs, table[[seed_token, x0, x1]], params, key, position)
        for position, (prev, token) in enumerate(zip([seed_token] + tokens, tokens)):
            transitions[position, prev, token] += 1
    return [_cells_chi_square(transitions[j, prev], filtered_probs(table[prev], params))
            for j in range(3) for prev in range(vocab + 1) if transitions[j, prev].sum() >= 200]  # fmt: skip


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "argmax-q"])
def test_accept_sampled_gives_the_target_distribution(sampled, monkeypatch):
    checks = simulate_verification(sampled)
    assert len(checks) > 2 and all(c.passed for c in checks), [str(c) for c in checks]
    if sampled:  # a rejection draws from p instead of the residual
        monkeypatch.setattr(verification, "residual", _residual_from_p)
        assert not all(c.passed for c in simulate_verification(sampled))
        monkeypatch.undo()
    else:
        assert not all(c.passed for c in simulate_verification(sampled, _accept_argmax_rejection_from_p))
    assert not all(c.passed for c in simulate_verification(sampled, _accept_sampled_bonus_off_by_one))


def test_filtered_probs_of_rows_is_filtered_probs_of_each_row():
    rng = np.random.default_rng(3)
    logits = _random_logits(rng, 5, 300).astype(np.float32)
    for params in PARAMS.values():
        expected = np.stack([filtered_probs(row, params) for row in logits])
        np.testing.assert_allclose(filtered_probs_rows(logits, params), expected, rtol=1e-12, atol=1e-15)
    draws = draw_rows(np.random.default_rng(0).random(20000), np.tile(filtered_probs(logits[0], PARAMS["top_k5"]), (20000, 1)))
    assert set(np.unique(draws)) <= set(np.flatnonzero(filtered_probs(logits[0], PARAMS["top_k5"])))


def test_a_proposal_is_its_tokens():
    proposal = Proposal([4, 5], np.zeros((2, 8)))
    assert proposal == (4, 5) and list(proposal) == [4, 5] and proposal[:1] == (4,)
    with pytest.raises(ValueError):
        Proposal([4, 5], np.zeros((1, 8)))


# ---- the engine: lossless with every draft and both proposal modes ---------------------------------------


def test_the_reference_is_the_target_alone(pair):
    """The exact reference agrees with the engine's own sampling, without a draft."""
    samples = sample_all(make_engine(pair, None), num_samples=1000)
    assert_lossless(pair, samples)


@pytest.fixture(scope="module")
def runs(pair) -> dict[tuple[str, str], Samples]:
    """Every draft with both proposal modes, every params and prompt: (draft, mode) -> samples. (The
    lattice's argmax walk is the dense walk's wherever the lattice holds the winner: sampled only.)"""
    return {(draft, mode): sample_all(make_engine(pair, draft, mode)) for draft, mode in RUNS}


RUNS = [("dflash_zero", "argmax"), ("dflash_zero", "sampled"), ("dspark_dense", "argmax"), ("dspark_dense", "sampled"),
        ("dspark_lattice", "sampled"), ("dspark_cut_vocab", "sampled"),
        ("dspark_cut_lattice", "sampled")]  # fmt: skip


@pytest.mark.parametrize("draft, mode", RUNS)
def test_speculative_sampling_is_lossless(pair, runs, draft, mode):
    samples = runs[(draft, mode)]
    assert_lossless(pair, samples)
    acceptance = samples.acceptance
    if draft.startswith("dspark_cut"):  # drafts, and is rejected where the target says an odd token
        assert 0 < acceptance[("t1.0", "cycle")] < 0.9, acceptance
    elif draft == "dflash_zero":
        # It agrees after A and disagrees everywhere on the cycle: both are really exercised.
        assert acceptance[("t1.0", "constant")] > 0.4, acceptance
        assert acceptance[("t1.0", "cycle")] < 0.15, acceptance
    else:  # the anchor row agrees, the Markov bias makes later rows agree part of the time
        assert acceptance[("t1.0", "cycle")] > 0.3, acceptance


def test_sampled_proposals_carry_the_distributions_they_were_drawn_from(pair):
    engine = make_engine(pair, "dspark_dense", "sampled")
    seen = []
    select = engine.drafter._select

    def spy(drafting):
        candidates = select(drafting)
        seen.extend(candidates.values())
        return candidates

    engine.drafter._select = spy
    params = [request_params(PARAMS["top_k5"], seed) for seed in range(50)]
    engine.generate([ORDINARY_PROMPT] * 50, params)
    assert seen and all(isinstance(c, Proposal) for c in seen)
    assert any((proposal.probs.max(axis=1) < 0.9).any() for proposal in seen)  # the walk's q is spread: it draws
    for proposal in seen:
        assert np.allclose(proposal.probs.sum(axis=1), 1.0)
        assert ((proposal.probs > 0).sum(axis=1) <= 5).all()  # top-k 5 on the draft's side too
        assert all(proposal.probs[i, t] > 0 for i, t in enumerate(proposal))


# ---- planted bugs: the same test fails on each ------------------------------------------------------------


def _residual_from_p(p, q, token):
    return p  # the bug: a rejection draws from the target's distribution, not from max(0, p - q)


_real_sample_rows = speculative.sample_rows
_real_accept_sampled = verification.accept_sampled


def _sample_rows_q_before_top_p(logits, params, key, position):
    drawn = _real_sample_rows(logits, params, key, position)
    unfiltered = filtered_probs_rows(logits, replace(params, top_p=1.0))  # the bug: q before top-p
    return Proposal(drawn, unfiltered)


def _accept_sampled_bonus_off_by_one(candidates, draft_probs, target_logits, params, key, position):
    tokens = _real_accept_sampled(candidates, draft_probs, target_logits, params, key, position)
    if len(tokens) == len(candidates) + 1:  # every candidate accepted: redraw the bonus from the wrong row
        bonus = filtered_probs(target_logits[len(candidates) - 1], params)
        tokens[-1] = draw(uniform(key, position + len(candidates)), bonus)
    return tokens


def _accept_argmax_rejection_from_p(candidates, draft_probs, target_logits, params, key, position):
    tokens = _real_accept_sampled(candidates, draft_probs, target_logits, params, key, position)
    rejected = len(tokens) - 1
    if draft_probs is None and rejected < len(candidates):  # the bug: the rejection draws again from all of p
        tokens[-1] = draw(uniform(key, position + rejected, ACCEPT_STREAM), filtered_probs(target_logits[rejected], params))
    return tokens


PLANTED = {
    # name: (what to patch, replacement, draft, proposals, params)
    "residual-from-p": ((verification, "residual"), _residual_from_p, "dflash_zero", "sampled", "t1.0"),
    "residual-from-p-argmax": ((engine_module, "accept_sampled"), _accept_argmax_rejection_from_p, "dflash_zero", "argmax", "t1.0"),
    "q-before-top-p": ((speculative, "sample_rows"), _sample_rows_q_before_top_p, "dflash_zero", "sampled", "top_p0.9"),
    "bonus-off-by-one": ((engine_module, "accept_sampled"), _accept_sampled_bonus_off_by_one, "dspark_lattice", "sampled", "t1.0"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_each_planted_bug_fails_the_test(pair, runs, monkeypatch, bug):
    (module, name), replacement, draft, mode, params = PLANTED[bug]
    real = runs[(draft, mode)]
    assert all(r.passed for g, r in check_all(pair, real).items() if g[0] == params)
    monkeypatch.setattr(module, name, replacement)
    planted = sample_all(make_engine(pair, draft, mode), params_names=[params])
    results = check_all(pair, planted)
    assert any(not r.passed for r in results.values()), {g: str(r) for g, r in results.items()}


# ---- seeds ------------------------------------------------------------------------------------------------


def test_seeded_argmax_proposals_give_the_target_alones_own_tokens(pair):
    """Argmax proposals are verified by the target's own draw at each position: with a seed, the tokens
    are the target alone's, whatever the draft, the schedule (adaptive included) or the batch (f32)."""
    schedules = ["adaptive", "heuristic", "constant"]
    prompts = [ORDINARY_PROMPT, A_PROMPT, [9, 10, 11, 12], [5, A]] * 6
    params = [request_params(PARAMS[name], 100 + i, max_new_tokens=24, num_assistant_tokens_schedule=schedules[i % 3])
              for i, name in enumerate(list(PARAMS) * 6)]  # fmt: skip
    alone = [r.token_ids for r in make_engine(pair, None).generate(prompts, params)]
    for draft in ("dflash_zero", "dspark_dense", "dspark_lattice"):
        engine = make_engine(pair, draft, "argmax")
        assert [r.token_ids for r in engine.generate(prompts, params)] == alone, draft
        assert engine.spec_stats.num_accepted_tokens > 0
        one = engine.generate(prompts[:1], params[:1])[0].token_ids  # alone in the engine too
        assert one == alone[0]


def test_a_seeded_request_gives_the_same_tokens_alone_or_in_a_batch(pair):
    engine = make_engine(pair, "dspark_dense", "sampled")
    params = request_params(PARAMS["t1.0"], 1234, max_new_tokens=24)
    alone = engine.generate([ORDINARY_PROMPT], params)[0].token_ids
    others = [request_params(PARAMS[name], seed, max_new_tokens=8 + seed % 20)
              for seed, name in enumerate(list(PARAMS) * 8)]  # fmt: skip
    batch = engine.generate([ORDINARY_PROMPT] + [A_PROMPT, ORDINARY_PROMPT[:2]] * 16, [params] + others)
    assert batch[0].token_ids == alone
    assert engine.generate([ORDINARY_PROMPT], replace(params, seed=4321))[0].token_ids != alone
    greedy = request_params(SamplingParams(), 0)  # greedy requests still draft as before: the chain
    assert engine.generate([ORDINARY_PROMPT], greedy)[0].token_ids == chain_of(pair.succ, ORDINARY_PROMPT[-1], NEW_TOKENS)


# ---- the benchmark sweep ----------------------------------------------------------------------------------


def test_bench_reports_acceptance_under_sampling_next_to_greedy(pair):
    from dflash.bench.sweep import BenchOptions, run_bench

    options = BenchOptions(
        target_dir=pair.target, draft_dir=pair.drafts["dflash_zero"], prompts=[A_PROMPT, [7, 8, A]], chat=False,
        engine_config=EngineConfig(ov_config=EXACT_OV_CONFIG, num_kv_blocks=64, num_draft_kv_blocks=64),
        max_new_tokens=16, warmup=0, schedules=("constant",), sampling=SamplingParams(temperature=0.7, seed=0),
        draft_proposals=("argmax", "sampled"),
    )  # fmt: skip
    report = run_bench(options)
    assert report.status == "complete" and not report.errors
    names = [s.name for s in report.settings]
    assert names == ["baseline c=1", "spec c=1 k=auto constant", "baseline c=1 sampled",
                     "spec c=1 k=auto constant sampled q=argmax", "spec c=1 k=auto constant sampled q=sampled"]  # fmt: skip
    for setting in report.speculative:  # after A the draft agrees, until a draw leaves A
        assert setting.spec["num_draft_tokens"] > 0 and setting.spec["mean_accepted_length"] > 1.5, setting.name
    greedy, argmax, sampled = report.speculative
    assert [s.draft_proposals for s in report.speculative] == [None, "argmax", "sampled"]
    # Seeded, argmax proposals: the target alone's own draws, compared token for token like greedy.
    assert greedy.agreement.identical == argmax.agreement.identical == 2 and sampled.agreement is None
    assert report.to_json()["options"]["sampling"]["temperature"] == 0.7
