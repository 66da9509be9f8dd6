"""A draft vocabulary: a draft that proposes only some of the target's tokens (a cut lm_head).

The cut is made on the grafted lm_head's constants (an int8 weight stays int8, its per-row scales are
cut alike), so a kept token's logit is exactly the full head's; candidates are target token ids; the
target still verifies over its whole vocabulary, so greedy output is the target's own even when the
draft cannot propose the token the target wants. Real OpenVINO inference on tiny exported models.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from dflash.core.config import EXACT_OV_CONFIG, EngineConfig, SamplingParams
from dflash.core.draft_runner import DraftInputs, DraftRunner
from dflash.core.engine import LLMEngine
from dflash.core.errors import InputError, ModelFormatError
from dflash.core.graph import find_lm_head, graft_lm_head
from dflash.core.model_runner import read_ov_model
from dflash.core.paged import SequenceSlice
from dflash.exporters.draft import DRAFT_VOCAB_FILE, export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.target import export_target
from dflash.exporters.validate import validate_draft
from dflash.training.vocab import count_tokens, coverage, rank_tokens

pytestmark = pytest.mark.slow  # exports models and runs engines

VOCAB = 512  # the tiny target's (conftest.py)
KEEP = 160


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_target_src) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-vocab")
    checkpoint = make_tiny_draft(root / "draft-src", tiny_target_src, draft_block_size=4, seed=4)
    ranking = np.random.default_rng(0).permutation(VOCAB).tolist()
    (checkpoint / DRAFT_VOCAB_FILE).write_text(json.dumps({"ranking": ranking, "size": KEEP}))
    return {
        "target_int8": export_target(tiny_target_src, root / "target-int8", weight_format="int8"),
        "target_f32": export_target(tiny_target_src, root / "target-f32", weight_format="fp32"),
        "checkpoint": checkpoint,
        "cut": export_draft(checkpoint, root / "draft-cut", weight_format="fp32"),
        "full": export_draft(checkpoint, root / "draft-full", weight_format="fp32", draft_vocab_size=0),
        "ranking": ranking,
        "target_src": tiny_target_src,
    }


def _window(runner: DraftRunner, num_context: int = 3, num_block: int = 4) -> DraftInputs:
    rng = np.random.default_rng(1)
    mask = runner.spec.mask_token_id
    return DraftInputs(
        seqs=[SequenceSlice(0, num_context + num_block, [0])],
        token_ids=np.array([mask] * num_context + [7] + [mask] * (num_block - 1), np.int64),
        token_type_ids=np.array([0] * num_context + [1] * num_block, np.int64),
        hidden_states=rng.standard_normal((num_context + num_block, runner.hidden_states_width)).astype(np.float32),
        candidate_rows=np.arange(num_context + 1, num_context + num_block, dtype=np.int64),
    )


def test_the_export_records_the_ranked_tokens_and_validate_checks_them(models):
    cut = read_ov_model(models["cut"])
    assert cut.get_rt_info(["dflash", "draft_vocab"]).astype(str) == ",".join(map(str, models["ranking"][:KEEP]))
    assert not read_ov_model(models["full"]).has_rt_info(["dflash", "draft_vocab"])
    report = validate_draft(models["cut"], models["target_int8"], check_paged=False)
    check = next(c for c in report.checks if c.name == "draft_vocab")
    assert report.ok and f"{KEEP} tokens" in check.detail


@pytest.mark.parametrize("target", ["target_int8", "target_f32"])
def test_kept_tokens_have_the_full_heads_logits(models, target):
    full = DraftRunner(models["full"], models[target], ov_config=EXACT_OV_CONFIG)
    cut = DraftRunner(models["cut"], models[target], ov_config=EXACT_OV_CONFIG)
    for runner in (full, cut):
        runner.allocate_cache(8)
    window = _window(full)
    full_logits, cut_logits = full.run(window), cut.run(window)
    ids = np.array(models["ranking"][:KEEP])
    assert cut_logits.shape == (3, KEEP) and full_logits.shape == (3, VOCAB)
    np.testing.assert_allclose(cut_logits, full_logits[:, ids], rtol=1e-5, atol=1e-5)
    # Candidates are target ids: the best kept token, which is the full head's best among the kept ones.
    assert cut.token_ids(cut_logits).tolist() == ids[full_logits[:, ids].argmax(axis=1)].tolist()
    expanded = cut.full_logits(cut_logits)
    assert expanded.shape == (3, VOCAB) and np.isneginf(np.delete(expanded, ids, axis=1)).all()


def test_an_int8_head_is_cut_in_its_constants(models):
    """No Gather at inference: the cut lm_head's weight is a smaller uint8 constant, and the tied
    embedding table it came from keeps all its rows."""
    draft, target = read_ov_model(models["cut"]), read_ov_model(models["target_int8"])
    from dflash.core.graph import graft_embedding

    graft_embedding(draft, target)
    graft_lm_head(draft, target, np.array(models["ranking"][:KEEP]))
    matmul, port = find_lm_head(draft)
    chain, stack = [], [matmul.input_value(1 - port).get_node()]
    while stack:
        node = stack.pop()
        chain.append(node)
        stack += [value.get_node() for value in node.input_values()]
    constants = [n for n in chain if n.get_type_name() == "Constant"]
    assert "Gather" not in {n.get_type_name() for n in chain}
    assert any(n.get_element_type() in (ov.Type.u8, ov.Type.i8) and list(n.get_shape())[0] == KEEP for n in constants)
    tables = [op for op in draft.get_ops() if op.get_type_name() == "Constant" and list(op.get_shape())[:1] == [VOCAB]]
    assert tables, "the embedding table keeps the whole vocabulary"


def test_greedy_output_is_the_targets_own_with_a_cut_vocabulary(models):
    """Lossless whatever the draft can propose: a draft whose vocabulary lacks most of what the target
    says is simply rejected more often."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, num_assistant_tokens_schedule="constant")
    prompts = ["def add(a, b):", "Hello, world! The quick brown fox", "import numpy as np\nx = np.arange(16)"]
    config = EngineConfig(ov_config=EXACT_OV_CONFIG, num_kv_blocks=64)
    alone = [r.token_ids for r in LLMEngine(models["target_f32"], config).generate(prompts, params)]
    engine = LLMEngine(models["target_f32"], config, draft_dir=models["cut"])
    with_draft = engine.generate(prompts, params)
    assert [r.token_ids for r in with_draft] == alone
    assert sum(r.spec.num_draft_tokens for r in with_draft) > 0


def test_export_refuses_a_size_it_cannot_rank(models, tmp_path):
    with pytest.raises(InputError, match="outside 0..512"):
        export_draft(models["checkpoint"], tmp_path / "too-big", draft_vocab_size=VOCAB + 1)
    unranked = tmp_path / "unranked"
    unranked.mkdir()
    for file in models["checkpoint"].iterdir():
        if file.name != DRAFT_VOCAB_FILE:
            (unranked / file.name).write_bytes(file.read_bytes())
    with pytest.raises(InputError, match="draft_vocab.json"):
        export_draft(unranked, tmp_path / "no-ranking", draft_vocab_size=64)


def test_the_runner_refuses_a_vocabulary_outside_the_targets(models, tmp_path):
    draft = read_ov_model(models["cut"])
    draft.set_rt_info(",".join(map(str, [1, 2, VOCAB + 3])), ["dflash", "draft_vocab"])
    with pytest.raises(ModelFormatError, match="outside the target"):
        DraftRunner(draft, models["target_f32"])


def test_ranking_and_coverage():
    counts = count_tokens([[5, 5, 3], [5, 1], [3]], vocab_size=8)
    assert counts.tolist() == [0, 1, 0, 2, 0, 3, 0, 0]
    ranking = rank_tokens(counts)
    assert ranking[:3].tolist() == [5, 3, 1] and ranking[3:].tolist() == [0, 2, 4, 6, 7]  # ties by id
    assert coverage(ranking, counts, sizes=(1, 2, 3)) == {1: 0.5, 2: round(5 / 6, 5), 3: 1.0}


def test_a_size_beyond_the_ranked_tokens_adds_unseen_ones_lowest_id_first(tmp_path):
    from dflash.exporters.draft import resolve_draft_vocab

    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps({"ranking": [9, 4, 7], "vocab_size": 12, "size": 2}))
    assert resolve_draft_vocab(tmp_path, None) == [9, 4]  # the file's own size
    assert resolve_draft_vocab(tmp_path, 6) == [9, 4, 7, 0, 1, 2]
    assert resolve_draft_vocab(tmp_path, 0) is None
    with pytest.raises(InputError, match="outside 0..12"):
        resolve_draft_vocab(tmp_path, 13)
    assert resolve_draft_vocab(tmp_path / "elsewhere", None) is None  # no file, no size: the whole vocabulary


@pytest.mark.parametrize("top_k", [0, 4], ids=["dense-walk", "lattice"])
def test_markov_walks_over_a_cut_vocabulary_equal_walks_over_the_widened_logits(models, tmp_path, top_k):
    """The Markov head walks the cut logits directly (no widening to the whole vocabulary): the same
    tokens as walking the whole vocabulary with -inf outside the draft's."""
    from dflash.core.markov import load_markov_head

    checkpoint = make_tiny_draft(tmp_path / "dspark-src", models["target_src"], kind="dspark", markov_rank=8, seed=6)
    exported = export_draft(checkpoint, tmp_path / "dspark", weight_format="fp32")
    head = load_markov_head(exported, read_ov_model(exported))
    rng = np.random.default_rng(2)
    ids = np.array(models["ranking"][:KEEP])
    base = [rng.normal(size=(rows, VOCAB)).astype(np.float32) * 3 for rows in (3, 1, 0)]
    widened = []
    for logits in base:
        w = np.full_like(logits, -np.inf)
        w[:, ids] = logits[:, ids]
        widened.append(w)
    anchors = [int(ids[0]), 5, int(ids[3])]
    cut = head.select_candidates([u[:, ids] for u in base], anchors, top_k, vocab_ids=ids)
    assert cut == head.select_candidates(widened, anchors, top_k)
    assert all(token in set(ids.tolist()) for tokens in cut for token in tokens) and len(cut[0]) > 0


def test_the_ranking_tool_ranks_what_the_target_generates(models):
    """`python -m dflash.training.vocab` on a tiny target: the ranking holds exactly the tokens its
    answers used, most frequent first."""
    from dflash.training.prompts import builtin_prompts
    from dflash.training.vocab import build, generated_answers

    info = build(models["target_f32"], num_prompts=8, max_new_tokens=6, concurrency=4)
    answers = generated_answers(models["target_f32"], builtin_prompts(8), max_new_tokens=6, concurrency=4)
    counts = count_tokens(answers, VOCAB)
    assert info["vocab_size"] == VOCAB and info["tokens"] == 48
    assert sorted(info["ranking"]) == sorted(np.flatnonzero(counts).tolist())
    assert [counts[t] for t in info["ranking"]] == sorted((counts[t] for t in info["ranking"]), reverse=True)


def test_the_ranking_tool_counts_the_targets_own_predictions_over_code(models, tmp_path):
    """With --text-from, the ranking also counts the target's next token at every position of real files
    (teacher-forced), checked against transformers' forward pass of the same checkpoint; those tokens
    join the generated answers' in one ranking, with their counts kept, and coverage is also measured
    on the held-out files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.training.vocab import build, predicted_tokens

    code = tmp_path / "code"
    code.mkdir()
    for index in range(4):
        body = "\n".join(f"def f{index}_{i}(x):\n    return x * {i} + {index}  # step {i}" for i in range(12))
        (code / f"m{index}.py").write_text(body + "\n")
    files = sorted(code.glob("*.py"))
    predictions = predicted_tokens(models["target_f32"], files, max_tokens=10_000, chunk_tokens=64)
    tokenizer = AutoTokenizer.from_pretrained(models["target_src"])
    reference = AutoModelForCausalLM.from_pretrained(models["target_src"], torch_dtype=torch.float32)
    expected = []
    for path in files:
        ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        for first in range(0, len(ids), 64):
            chunk = ids[first : first + 64]
            if len(chunk) >= 32:
                with torch.no_grad():
                    expected.append(reference(torch.tensor([chunk])).logits[0].argmax(-1).tolist())
    assert len(predictions) == len(expected) > 4
    agree = sum(a == b for p, e in zip(predictions, expected, strict=True) for a, b in zip(p, e, strict=True))
    assert agree >= 0.98 * sum(len(e) for e in expected)  # fp32 export against PyTorch: near-ties aside

    info = build(models["target_f32"], num_prompts=8, max_new_tokens=6, concurrency=4, text_from=[code], text_tokens=10_000)
    answers_only = build(models["target_f32"], num_prompts=8, max_new_tokens=6, concurrency=4)
    assert info["tokens"] > answers_only["tokens"] == 48 and "held_out_coverage_text" in info
    assert set(answers_only["ranking"]) <= set(info["ranking"])
    assert len(info["counts"]) == len(info["ranking"]) and info["counts"] == sorted(info["counts"], reverse=True)
    assert sum(info["counts"]) == info["tokens"]
