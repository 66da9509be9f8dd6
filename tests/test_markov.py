"""The DSpark Markov head at runtime (core/markov.py) and DSpark drafting in the engine.

Three layers of checks, all with real OpenVINO inference on tiny exported models:

- the compiled head parts equal the PyTorch math on the checkpoint's W1/W2; the dense walk equals a
  per-position argmax of base logits + bias; the Top-K walk equals an independent rendering of the
  lattice walk, and the dense walk whenever the dense winner is among the candidates;
- the engine with a DSpark draft (random backbone, a head that knows some of the target's bigrams,
  so candidates are both accepted and rejected) gives the target's own greedy tokens with both
  selection modes, for concurrent and staggered requests, prefix-cache hits and preemption, and
  gives every KV block back in both pools;
- on a pair built so that the Markov bias decides the candidate (a target whose next token depends
  only on the current token, a draft whose mask rows know nothing, a head that knows the successor),
  both modes draft the target's chain and accept every candidate, while the same draft with its head
  ignored (plain DFlash) accepts little.

Inference runs in f32 with f32 KV caches so that token comparisons are exact.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as opset
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.draft_format import markov_head_part
from dflash.core.engine import EngineConfig, GenerationResult, LLMEngine
from dflash.core.errors import InputError, ModelFormatError
from dflash.core.markov import (
    MARKOV_HEAD_FILE,
    Lattice,
    MarkovHeadRunner,
    build_lattice,
    build_lattices,
    greedy_lattice_walk,
    head_tables,
    load_markov_head,
    top_k_candidates,
    top_k_with_values,
)
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.markov_head import MarkovHead, convert_markov_head
from dflash.exporters.target import export_target
from dflash.exporters.tiny import _CORPUS, make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

F32 = EXACT_OV_CONFIG
VOCAB = 512
BLOCK_SIZE = 5
RANK = 16
BIGRAM_SCALE = 12.0  # against base logits of std ~1.6: the head decides most rows
NEW_TOKENS = 24
MAX_STEPS = 2000

PROMPTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. OpenVINO runs models on Intel CPUs.",
    " ".join(_CORPUS[:4]),
]
GREEDY = SamplingParams(num_assistant_tokens_schedule="constant", max_new_tokens=NEW_TOKENS, ignore_eos=True)


# ---- fixtures ------------------------------------------------------------------------------------


@dataclass
class Pair:
    target_dir: Path  # exported target
    draft_src: Path  # DSpark checkpoint
    draft_dir: Path  # exported draft (with openvino_markov_head_model.xml)
    w1: np.ndarray  # [V, r]
    w2: np.ndarray  # [V, r]
    reference: list[list[int]]  # the target alone, greedy, NEW_TOKENS per prompt


def _head_weights(draft_src: Path) -> tuple[np.ndarray, np.ndarray]:
    weights = load_file(str(draft_src / "model.safetensors"))
    return weights["markov_head.markov_w1.weight"].numpy(), weights["markov_head.markov_w2.weight"].numpy()


def _target_alone(target_dir: Path, prompts: Sequence[str]) -> list[list[int]]:
    engine = LLMEngine(target_dir, EngineConfig(ov_config=F32, num_kv_blocks=64))
    return [r.token_ids for r in engine.generate(prompts, GREEDY)]


def _bigram_head(src: Path, bigrams: dict[int, int], scale: float, seed: int = 0) -> None:
    """Point the draft's Markov head at `bigrams` (token -> the token that follows it): unit W2
    rows, W1[x] = scale · W2[next(x)], W1 = 0 for tokens without a bigram."""
    path = src / "model.safetensors"
    weights = load_file(str(path))
    vocab = weights["markov_head.markov_w2.weight"].shape[0]
    g = torch.Generator().manual_seed(seed)
    w2 = torch.randn(vocab, RANK, generator=g)
    w2 = w2 / w2.norm(dim=-1, keepdim=True)  # <w2[a], w2[b]> < 1 = <w2[a], w2[a]> for a != b
    w1 = torch.zeros(vocab, RANK)
    for token, following in bigrams.items():
        w1[token] = scale * w2[following]
    weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"] = w1, w2
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory, sharp_qwen3) -> Pair:
    """A random tiny qwen3 target and a random DSpark draft (the anchor row predicts) whose Markov
    head knows the bigrams of the target's own greedy outputs: the head then decides many
    candidates and some are accepted, so the lossless tests see accepted and rejected candidates."""
    root = tmp_path_factory.mktemp("markov-random")
    hf, target_dir = sharp_qwen3
    reference = _target_alone(target_dir, PROMPTS)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    bigrams = {}
    for prompt, tokens in zip(PROMPTS, reference):
        chain = tokenizer(prompt).input_ids[-1:] + tokens
        bigrams.update(zip(chain, chain[1:]))
    src = make_tiny_draft(root / "draft-src", hf, kind="dspark", markov_rank=RANK, draft_block_size=BLOCK_SIZE, seed=1)
    _bigram_head(src, bigrams, scale=BIGRAM_SCALE)
    draft_dir = export_draft(src, root / "draft", weight_format="fp32")
    return Pair(target_dir, src, draft_dir, *_head_weights(src), reference)


@pytest.fixture(scope="module")
def head(random_pair) -> MarkovHeadRunner:
    return MarkovHeadRunner(random_pair.draft_dir / MARKOV_HEAD_FILE, ov_config=F32)


# ---- the head's two parts --------------------------------------------------------------------------


def test_head_parts_equal_the_w1_w2_math(random_pair, head):
    w1, w2 = torch.from_numpy(random_pair.w1), torch.from_numpy(random_pair.w2)
    assert (head.vocab_size, head.rank, head.default_top_k) == (VOCAB, RANK, 0)  # the export asks for the dense walk
    prev = np.array([0, 7, 511, 7, 300], dtype=np.int64)
    expected = (w1[torch.from_numpy(prev)] @ w2.T).numpy()
    np.testing.assert_allclose(head.markov_bias(prev), expected, rtol=1e-5, atol=1e-5)

    rng = np.random.default_rng(0)
    prev_candidates = rng.integers(0, VOCAB, size=(6, 3))
    candidates = rng.integers(0, VOCAB, size=(6, 4))
    expected = torch.einsum(
        "rpj,rkj->rpk", w1[torch.from_numpy(prev_candidates)], w2[torch.from_numpy(candidates)]
    ).numpy()
    edges = head.edge_scores(prev_candidates, candidates)
    assert edges.shape == (6, 3, 4)
    np.testing.assert_allclose(edges, expected, rtol=1e-5, atol=1e-5)


def test_the_exported_head_runs_in_numpy_and_a_head_built_otherwise_compiled(random_pair, head):
    # The export's parts are the plain gathers and products: the runner reads W1/W2 from them and
    # computes both in numpy (no inference call), equal to the compiled parts on the same inputs.
    model = ov.Core().read_model(random_pair.draft_dir / MARKOV_HEAD_FILE)
    tables = head_tables(model)
    assert tables is not None and head._dense is None and head._topk is None
    np.testing.assert_array_equal(tables[0], random_pair.w1)
    np.testing.assert_array_equal(tables[1], random_pair.w2)
    rng = np.random.default_rng(3)
    prev = np.array([0, 7, 511], dtype=np.int64)
    prev_candidates, candidates = rng.integers(0, VOCAB, size=(5, 4)), rng.integers(0, VOCAB, size=(5, 4))
    core = ov.Core()
    dense = core.compile_model(markov_head_part(model, "dense"), "CPU", F32).create_infer_request()
    topk = core.compile_model(markov_head_part(model, "topk"), "CPU", F32).create_infer_request()
    want_bias = dense.infer({"prev_token_ids": prev})["markov_bias"]
    want_edges = topk.infer({"prev_candidate_ids": prev_candidates, "candidate_ids": candidates})["edge_scores"]
    np.testing.assert_allclose(head.markov_bias(prev), want_bias, rtol=1e-6, atol=1e-6)
    columns = np.array([3, 500, 17])  # a draft vocabulary: those columns only
    np.testing.assert_allclose(head.markov_bias(prev, columns), want_bias[:, columns], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(head.edge_scores(prev_candidates, candidates), want_edges, rtol=1e-6, atol=1e-6)
    # A head whose Top-K part holds more than that (here its edges doubled): compiled, as the graph says.
    result = model.output("edge_scores").get_node()
    scores = result.input_value(0)
    doubled = opset.multiply(scores, opset.constant(np.float32(2.0)))
    scores.get_tensor().set_names(set())
    doubled.output(0).get_tensor().set_names({"edge_scores"})
    result.input(0).replace_source_output(doubled.output(0))
    assert head_tables(model) is None
    other = MarkovHeadRunner(model, ov_config=F32)
    assert other._dense is not None and other._topk is not None
    np.testing.assert_allclose(other.edge_scores(prev_candidates, candidates), 2 * want_edges, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(other.markov_bias(prev, columns), want_bias[:, columns], rtol=1e-6, atol=1e-6)


def test_kept_bias_rows_equal_the_product_and_stay_within_their_budget(random_pair, monkeypatch):
    # The dense walk's bias rows of recent tokens are kept (`markov.BIAS_CACHE_BYTES`): every call returns
    # W2 . W1[prev] as if computed afresh, a caller that adds into it leaves the kept rows alone, and at
    # most the budget's rows stay kept, even where one call needs more rows than that.
    from dflash.core import markov

    monkeypatch.setattr(markov, "BIAS_CACHE_BYTES", 4 * 4 * 3)  # 4 rows of 3 columns
    head = MarkovHeadRunner(random_pair.draft_dir / MARKOV_HEAD_FILE, ov_config=F32)
    w1, w2 = random_pair.w1, random_pair.w2
    t = np.flatnonzero(np.abs(w1).sum(axis=1) > 0)[:8]  # tokens whose bias is not all zero
    assert len(t) == 8
    columns = np.array([3, 500, 17])

    def want(prev, cols=columns):
        return w1[prev] @ w2[cols].T

    for prev in ([t[0], t[0], t[1]], [t[1], t[2]], t[2:8], [t[0], t[1]]):  # repeats, 6 rows > 4, evictions
        prev = np.array(prev, dtype=np.int64)
        bias = head.markov_bias(prev, columns)
        np.testing.assert_allclose(bias, want(prev), rtol=1e-6, atol=1e-6)
        bias += 100.0  # as the walk adds the base logits
        assert len(head._bias_rows) <= 4
    assert list(head._bias_rows) == [t[6], t[7], t[0], t[1]]  # least recently used first
    for _ in range(2):  # a one-row call too hands out a copy
        bias = head.markov_bias(t[:1], columns)
        np.testing.assert_allclose(bias, want(t[:1]), rtol=1e-6, atol=1e-6)
        bias += 100.0
    other = np.array([1, 2, 3])  # another draft vocabulary: none of the kept rows is reused
    np.testing.assert_allclose(head.markov_bias(t[:1], other), want(t[:1], other), rtol=1e-6, atol=1e-6)
    assert head.markov_bias(np.zeros(0, dtype=np.int64), other).shape == (0, 3)


# ---- the walks -----------------------------------------------------------------------------------------


def _dense_reference(base: np.ndarray, anchor: int, w1: np.ndarray, w2: np.ndarray) -> list[int]:
    """x_{-1} = anchor, x_k = argmax(U_k + W2 · W1[x_{k-1}])."""
    drafted, prev = [], anchor
    for row in base:
        prev = int(np.argmax(row + w2 @ w1[prev]))
        drafted.append(prev)
    return drafted


def _topk_reference(base: np.ndarray, anchor: int, k: int, w1, w2) -> list[int]:
    """Among each row's k best base logits, the best base logit + <W1[token before], W2[candidate]>."""
    drafted, prev = [], anchor
    for row in base:
        candidates = np.argsort(-row, kind="stable")[:k]
        prev = int(candidates[np.argmax(row[candidates] + w2[candidates] @ w1[prev])])
        drafted.append(prev)
    return drafted


def _requests(pair: Pair, seed: int, rows: Sequence[int], boost: float = 0.0, k: int = 8):
    """Random base logits per request, and anchors the head has a bigram for; with `boost`, k random
    ids per row are raised by it."""
    rng = np.random.default_rng(seed)
    base = []
    for n in rows:
        logits = rng.normal(size=(n, VOCAB)).astype(np.float32)
        for row in logits:
            row[rng.choice(VOCAB, size=k, replace=False)] += boost
        base.append(logits)
    known = np.flatnonzero(np.abs(pair.w1).sum(axis=1))
    anchors = [int(a) for a in rng.choice(known, size=len(rows))]
    return base, anchors


def test_dense_walk_is_a_per_position_argmax_of_base_plus_bias(random_pair, head):
    base, anchors = _requests(random_pair, 1, rows=[5, 3, 0, 1, 5])
    calls = head.num_calls
    drafted = head.select_candidates(base, anchors, top_k=0)
    assert head.num_calls - calls == 5  # one head call per position, shared by every request
    expected = [_dense_reference(u, a, random_pair.w1, random_pair.w2) for u, a in zip(base, anchors)]
    assert drafted == expected
    # The bias matters: the plain argmax of the base logits drafts something else.
    assert drafted != [[int(t) for t in u.argmax(-1)] for u in base]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_walk_scores_the_candidates_after_the_token_before(random_pair, head, k):
    base, anchors = _requests(random_pair, 2, rows=[5, 2, 0, 4])
    calls = head.num_calls
    drafted = head.select_candidates(base, anchors, top_k=k)
    assert head.num_calls - calls == 1  # one call for every block row of every request
    assert drafted == [_topk_reference(u, a, k, random_pair.w1, random_pair.w2) for u, a in zip(base, anchors)]
    if k == 1:
        assert drafted == [[int(t) for t in u.argmax(-1)] for u in base]


def test_topk_walk_equals_the_dense_walk_when_the_dense_winner_is_a_candidate(random_pair, head):
    # Base logits with 8 ids per row far above the rest: the dense winner is always among them.
    base, anchors = _requests(random_pair, 3, rows=[5, 5, 1, 3], boost=50.0, k=8)
    dense = head.select_candidates(base, anchors, top_k=0)
    assert head.select_candidates(base, anchors, top_k=8) == dense
    for u, a, tokens in zip(base, anchors, dense):
        winners_are_candidates = all(t in top_k_candidates(row[None], 8)[0] for row, t in zip(u, tokens))
        assert winners_are_candidates
    # Top-K with K = V is the dense walk on any logits; a small K on plain random logits is not.
    base, anchors = _requests(random_pair, 4, rows=[5, 4, 5])
    dense = head.select_candidates(base, anchors, top_k=0)
    assert head.select_candidates(base, anchors, top_k=10_000) == dense
    assert head.select_candidates(base, anchors, top_k=2) != dense


def test_top_k_candidates_are_sorted_best_first():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, -1.0, 2.0]], dtype=np.float32)
    assert top_k_candidates(logits, 3).tolist() == [[1, 3, 5]]  # tie: lower id first
    assert top_k_candidates(logits, 6).tolist() == [[1, 3, 5, 2, 0, 4]]


@pytest.mark.parametrize("k", [1, 3, 8, 16, 17, 40])  # argmax passes up to 16, a stable sort above
def test_top_k_candidates_equal_a_stable_sort_with_ties_and_infinities(k):
    rng = np.random.default_rng(k)
    ties = rng.integers(-3, 3, size=(6, 64)).astype(np.float32)  # many ties, at the K-th place too
    ties[1, :40] = -np.inf  # a row with few entries above -inf
    ties[2, 5] = np.inf
    ties[3, 7] = np.nan  # a stable sort puts it last
    ties[4, 1:] = -np.inf  # one entry above -inf: the argmax passes take entry 0 twice, then undo
    for logits in (ties, rng.standard_normal((7, 300)).astype(np.float32)):
        expected = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        assert top_k_candidates(logits, k).tolist() == expected.tolist()
        ids, values = top_k_with_values(np.array(logits), k)
        assert ids.tolist() == expected.tolist()
        np.testing.assert_array_equal(values, np.take_along_axis(logits, expected, axis=1))


def test_lattices_of_several_requests_are_each_request_s_own():
    rng = np.random.default_rng(3)
    base = [rng.standard_normal((n, 50)).astype(np.float32) for n in (3, 0, 1, 2)]
    anchors = [11, 12, 13, 14]
    vocab_ids = np.arange(100, 150)  # the draft's vocabulary as target ids
    for lattice, logits, anchor in zip(build_lattices(base, anchors, 4, vocab_ids), base, anchors):
        columns = np.argsort(-logits, axis=1, kind="stable")[:, :4]
        assert lattice.candidate_ids.tolist() == (100 + columns).tolist()
        assert np.array_equal(lattice.candidate_logits, np.take_along_axis(logits, columns, axis=1))
        assert lattice.prev_candidate_ids.tolist() == [[anchor] * 4, *(100 + columns[:-1]).tolist()][: len(logits)]


def test_a_position_whose_previous_token_has_no_edge_ends_the_block():
    base = np.zeros((4, 10), dtype=np.float32)
    base[:, 5] = 1.0  # every row's best candidate is token 5
    lattice = build_lattice(base, anchor=2, k=3)
    edges = np.zeros((4, 3, 3), dtype=np.float32)
    assert greedy_lattice_walk(lattice, edges, anchor=2) == [5, 5, 5, 5]
    # Row 2 was scored after other tokens only: the walk stops before it.
    prev = lattice.prev_candidate_ids.copy()
    prev[2] = [7, 8, 9]
    cut = Lattice(lattice.candidate_ids, lattice.candidate_logits, prev)
    assert greedy_lattice_walk(cut, edges, anchor=2) == [5, 5]
    # The first row hangs off the anchor: another anchor has no edge at all.
    assert greedy_lattice_walk(lattice, edges, anchor=3) == []


def test_top_k_option_resolution(head):
    assert head.resolve_top_k(None) == 0  # the export's rt_info markov_head/top_k: the dense walk
    assert head.resolve_top_k(0) == 0
    assert head.resolve_top_k(3) == 3
    assert head.resolve_top_k(100_000) == VOCAB
    with pytest.raises(InputError):
        head.resolve_top_k(-1)
    # An export that asks for a lattice (rt_info K 8) gets it unless told otherwise.
    lattice_head = MarkovHeadRunner(convert_markov_head(MarkovHead(torch.randn(VOCAB, 4), torch.randn(VOCAB, 4)), top_k=8))
    assert (lattice_head.resolve_top_k(None), lattice_head.resolve_top_k(0)) == (8, 0)


# ---- loading and refusals ------------------------------------------------------------------------------


def _copy_draft(src: Path, dst: Path, *, with_head: bool = True, **rt_info: str) -> Path:
    shutil.copytree(src, dst)
    if not with_head:
        (dst / MARKOV_HEAD_FILE).unlink()
        (dst / MARKOV_HEAD_FILE).with_suffix(".bin").unlink()
    if rt_info:
        model = ov.Core().read_model(src / "openvino_model.xml")
        for key, value in rt_info.items():
            model.set_rt_info(value, ["dflash", key])
        ov.save_model(model, dst / "openvino_model.xml", compress_to_fp16=False)
    return dst


def test_missing_head_file_is_refused_with_a_reexport_hint(random_pair, tmp_path):
    draft = _copy_draft(random_pair.draft_dir, tmp_path / "draft", with_head=False)
    with pytest.raises(ModelFormatError) as err:
        LLMEngine(random_pair.target_dir, EngineConfig(ov_config=F32, num_kv_blocks=8), draft_dir=draft)
    assert MARKOV_HEAD_FILE in err.value.message and "re-export" in err.value.hint


def test_non_vanilla_head_is_refused(random_pair, tmp_path):
    draft = _copy_draft(random_pair.draft_dir, tmp_path / "draft", markov_head_type="rnn")
    with pytest.raises(ModelFormatError, match="only the vanilla head"):
        LLMEngine(random_pair.target_dir, EngineConfig(ov_config=F32, num_kv_blocks=8), draft_dir=draft)


def test_a_draft_without_markov_rank_needs_no_head(random_pair):
    model = ov.Core().read_model(random_pair.draft_dir / "openvino_model.xml")
    model.set_rt_info("0", ["dflash", "markov_rank"])
    assert load_markov_head(random_pair.draft_dir.parent / "nowhere", model) is None
    model.set_rt_info(str(RANK), ["dflash", "markov_rank"])
    with pytest.raises(ModelFormatError, match="vocabulary"):
        load_markov_head(random_pair.draft_dir, model, ov_config=F32, vocab_size=VOCAB + 1)


# ---- the engine: lossless with both modes ------------------------------------------------------------------


def make_engine(pair: Pair, **overrides) -> LLMEngine:
    config = dict(ov_config=F32, num_kv_blocks=64, num_draft_kv_blocks=64, max_num_batched_tokens=256)
    config.update(overrides)
    return LLMEngine(pair.target_dir, EngineConfig(**config), draft_dir=pair.draft_dir)


def assert_pools_full(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    for pool in (engine.block_pool, engine.drafter.kv_cache_manager.pool):
        assert pool.num_used_blocks == 0
        pool.assert_all_free()


def run(
    engine: LLMEngine, prompts: Sequence, arrivals: Sequence[int] | None = None, requests: list | None = None
) -> list[GenerationResult]:
    """Add each prompt at its arrival step (all at once by default) and run to the end; the
    scheduler's Request objects go into `requests` when given."""
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompts)
    req_ids: list[str | None] = [None] * len(prompts)
    for step in range(MAX_STEPS):
        for i, at in enumerate(arrivals):
            if at == step:
                req_ids[i] = engine.add_request(prompts[i], GREEDY)
                if requests is not None:
                    requests.append(engine.scheduler.get_request(req_ids[i]))
        if step >= max(arrivals) and not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), f"still unfinished after {MAX_STEPS} steps"
    results = [engine.result(req_id) for req_id in req_ids]
    assert_pools_full(engine)
    return results


MODES = {"topk-8": 8, "topk-64": 64, "dense (the default)": None}


@pytest.fixture(scope="module", params=list(MODES))
def mode_engine(request, random_pair) -> LLMEngine:
    return make_engine(random_pair, markov_head_top_k=MODES[request.param])


def test_greedy_output_is_the_targets_with_every_mode(random_pair, mode_engine):
    assert mode_engine.drafter.markov is not None
    head_seconds = mode_engine.drafter.markov.seconds
    draft_seconds = mode_engine.times.draft_s
    results = run(mode_engine, PROMPTS)
    assert [r.token_ids for r in results] == random_pair.reference
    assert not mode_engine.warnings
    drafted = sum(r.spec.num_draft_tokens for r in results)
    accepted = sum(r.spec.num_accepted_tokens for r in results)
    assert drafted > 0
    if mode_engine.drafter.markov_top_k == 0:
        assert 0 < accepted < drafted  # the bigram head's walk: some candidates accepted, some not
    # The head ran inside the draft step, so the draft's time includes it.
    head_delta = mode_engine.drafter.markov.seconds - head_seconds
    assert 0 < head_delta <= mode_engine.times.draft_s - draft_seconds


def test_staggered_arrivals_and_prefix_hits_keep_the_targets_tokens(random_pair, mode_engine):
    # Staggered: requests join while others are mid-generation. Then the same prompts again, which
    # now start from prefix-cached blocks (both pools publish prompt blocks).
    prompts = PROMPTS + [PROMPTS[3] + " and again", PROMPTS[3]]
    expected = random_pair.reference + [None, random_pair.reference[3]]
    results = run(mode_engine, prompts, arrivals=[0, 2, 3, 5, 7, 9])
    requests: list = []
    again = run(mode_engine, prompts, requests=requests)
    assert requests[3].num_prefix_cached_tokens > 0 and requests[5].num_prefix_cached_tokens > 0
    for want, first, second in zip(expected, results, again):
        assert first.token_ids == second.token_ids
        if want is not None:
            assert first.token_ids == want


@pytest.mark.parametrize("top_k", [8, None])
def test_preemption_keeps_the_targets_tokens(random_pair, top_k):
    engine = make_engine(random_pair, num_kv_blocks=3, markov_head_top_k=top_k)  # 96 positions
    preempted = []
    schedule = engine.scheduler.schedule

    def schedule_and_record():
        out = schedule()
        preempted.extend(out.preempted_req_ids)
        return out

    engine.scheduler.schedule = schedule_and_record
    results = run(engine, PROMPTS * 2)
    assert preempted, "the scenario must preempt"
    assert [r.token_ids for r in results] == random_pair.reference * 2


def test_head_can_be_ignored(random_pair):
    engine = make_engine(random_pair, use_markov_head=False)
    assert engine.drafter.markov is None
    assert [r.token_ids for r in run(engine, PROMPTS)] == random_pair.reference


# ---- a pair whose Markov bias decides the candidate -------------------------------------------------------------

CYCLE = [300, 301, 302, 303, 304, 305]  # the target's greedy chain, once it has started
DECIDED_RANK = 32


def _shape_target(hf_dir: Path, seed: int = 0) -> None:
    """Make the target's greedy next token a function of the current token alone.

    Every layer's o_proj and down_proj are zero, so the last hidden state of a position is its
    token's embedding; the final norm weight is 1. Embeddings and lm_head make the cycle tokens
    follow each other (c_i -> c_{i+1}), send every other token to c_0, and make the draft's mask
    token see all cycle tokens as equally likely: the draft's mask rows, which know nothing of
    the token before, cannot tell which cycle token comes next; the Markov head can.
    """
    path = hf_dir / "model.safetensors"
    weights = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    m = len(CYCLE)
    mask_id = _mask_token_id(hf_dir)
    embed = torch.zeros(vocab, hidden)
    embed[:, m + 1 :] = torch.randn(vocab, hidden - m - 1, generator=g)
    embed[:, m] = 8.0  # the "not a cycle token" feature
    lm_head = torch.zeros(vocab, hidden)
    lm_head[:, m + 1 :] = 0.2 * torch.randn(vocab, hidden - m - 1, generator=g)
    for i, token in enumerate(CYCLE):
        embed[token] = 0.0
        embed[token, i] = 1.0
        lm_head[token] = 0.0
    for i, token in enumerate(CYCLE):
        lm_head[CYCLE[(i + 1) % m], i] = 2.0
    lm_head[CYCLE[0], m] = 3.0
    embed[mask_id] = 0.0
    embed[mask_id, :m] = 1.0
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, lm_head
    weights["model.norm.weight"] = torch.ones(hidden)
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})


def _mask_token_id(hf_dir: Path) -> int:
    return AutoTokenizer.from_pretrained(hf_dir).convert_tokens_to_ids("<|mask|>")


def _successor(hf_dir: Path) -> np.ndarray:
    """The shaped target's greedy next token after each token: argmax(lm_head · norm(embedding))."""
    weights = load_file(str(hf_dir / "model.safetensors"))
    embed, lm_head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed @ lm_head.T).argmax(-1).numpy()


def _shape_draft(src: Path, successor: np.ndarray, seed: int = 0) -> None:
    """Block rows output the norm of their token's embedding (o_proj/down_proj zero, final norm 1),
    and W2 · W1[x] peaks at successor[x] by a wide margin."""
    path = src / "model.safetensors"
    weights = load_file(str(path))
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    g = torch.Generator().manual_seed(seed)
    w2 = torch.randn(len(successor), DECIDED_RANK, generator=g)
    w2 = w2 / w2.norm(dim=-1, keepdim=True)  # unit rows: <w2[a], w2[b]> < 1 = <w2[a], w2[a]> for a != b
    weights["markov_head.markov_w2.weight"] = w2
    weights["markov_head.markov_w1.weight"] = 60.0 * w2[torch.from_numpy(successor)]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def decided_pair(tmp_path_factory) -> Pair:
    root = tmp_path_factory.mktemp("markov-decided")
    hf = make_tiny_target(root / "hf", "qwen3", seed=5)
    _shape_target(hf)
    successor = _successor(hf)
    assert [int(successor[t]) for t in CYCLE] == CYCLE[1:] + CYCLE[:1]
    target_dir = export_target(hf, root / "target", weight_format="fp32")
    src = make_tiny_draft(root / "draft-src", hf, kind="dspark", markov_rank=DECIDED_RANK, draft_block_size=BLOCK_SIZE)
    _shape_draft(src, successor)
    draft_dir = export_draft(src, root / "draft", weight_format="fp32")
    return Pair(target_dir, src, draft_dir, *_head_weights(src), _target_alone(target_dir, PROMPTS))


def test_the_markov_bias_decides_what_is_drafted(decided_pair):
    # The target's own output: c_0 after any non-cycle token, then around the cycle.
    for tokens in decided_pair.reference:
        assert tokens == [CYCLE[i % len(CYCLE)] for i in range(NEW_TOKENS)]
    acceptance = {}
    for name, overrides in {
        "topk": {"markov_head_top_k": 8},
        "dense": {},
        "plain-dflash": {"use_markov_head": False},
    }.items():
        engine = make_engine(decided_pair, **overrides)
        results = run(engine, PROMPTS)
        assert [r.token_ids for r in results] == decided_pair.reference, name
        acceptance[name] = engine.spec_stats
    for name in ("topk", "dense"):
        stats = acceptance[name]
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, name  # every candidate accepted
        assert stats.mean_accepted_length > BLOCK_SIZE  # full blocks: 5 candidates + the bonus
    plain = acceptance["plain-dflash"]
    # Without the head only the anchor row knows what comes next (and a mask row by chance).
    assert plain.acceptance_rate < 0.5
    assert plain.mean_accepted_length < acceptance["topk"].mean_accepted_length - 2


# ---- the command line -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", ["0", "64"])
def test_generate_cli_takes_markov_top_k(random_pair, top_k):
    import json

    from typer.testing import CliRunner

    from dflash.cli.app import app

    args = [
        "generate", str(random_pair.target_dir), PROMPTS[1], "--draft", str(random_pair.draft_dir),
        "--markov-top-k", top_k, "--no-chat", "--json", "--ignore-eos", "--max-new-tokens", str(NEW_TOKENS),
        "--ov-config", "INFERENCE_PRECISION_HINT=f32", "--ov-config", "KV_CACHE_PRECISION=f32",
        "--kv-cache-size", "0.01",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["token_ids"] == random_pair.reference[1]
    assert lines[-1]["spec_decoding"]["num_drafts"] > 0


def test_generate_cli_refuses_a_negative_markov_top_k(random_pair):
    from typer.testing import CliRunner

    from dflash.cli.app import app

    args = ["generate", str(random_pair.target_dir), "x", "--draft", str(random_pair.draft_dir), "--markov-top-k", "-1"]
    assert CliRunner().invoke(app, args).exit_code == 2
