"""`dflash train`: data generation, the batched block forward, the loss, checkpoints that export and validate.

Everything runs on CPU against the tiny random qwen3 target (4 layers, hidden 64, vocabulary 512).
Its greedy answers are repetitive, which is what lets a tiny draft overfit them in a few dozen steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from typer.testing import CliRunner

from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import load_draft_weights, make_tiny_draft
from dflash.exporters.draft_config import load_draft_config
from dflash.exporters.draft_model import load_draft_model
from dflash.exporters.markov_head import MARKOV_HEAD_FILE
from dflash.exporters.tiny import CHAT_TEMPLATE, EOS_TOKEN
from dflash.exporters.validate import validate_draft
from dflash.training.checkpoint import TRAINING_INFO_FILE
from dflash.training.data import Example, generate_dataset, read_dataset, write_dataset
from dflash.training.model import blocks_forward
from dflash.training.prompts import builtin_prompts
from dflash.training.target import (
    check_target_layer_ids,
    choose_mask_token_id,
    default_target_layer_ids,
)
from dflash.training.trainer import (
    Batch,
    TrainOptions,
    block_labels,
    default_loss_gamma,
    lr_at,
    make_batch,
    train_draft,
)

CPU = torch.device("cpu")
NUM_PROMPTS = 6
MAX_NEW_TOKENS = 24
BLOCK = {"dflash": 4, "dspark": 3}
MARKOV_RANK = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def target_src(tiny_target_src) -> Path:
    return tiny_target_src  # conftest.py: shared with other modules, read only


@pytest.fixture(scope="module")
def target(tiny_target_torch):
    return tiny_target_torch  # conftest.py: shared, read only


@pytest.fixture(scope="module")
def target_ov(tiny_target_fp16) -> Path:
    return tiny_target_fp16


@pytest.fixture(scope="module")
def data_file(root, target) -> Path:
    path = root / "data.jsonl"
    stats = generate_dataset(target, builtin_prompts(NUM_PROMPTS), path, max_new_tokens=MAX_NEW_TOKENS, batch_size=4)
    assert stats.sequences == NUM_PROMPTS
    return path


@pytest.fixture(scope="module")
def examples(data_file) -> list[Example]:
    return read_dataset(data_file)


@pytest.fixture(scope="module")
def trained(root, target, examples):
    """kind -> TrainResult: 40 steps on the fixed tiny data set, evaluated on that same data (overfit)."""
    results = {}
    for kind in ("dflash", "dspark"):
        options = TrainOptions(
            kind=kind,
            block_size=BLOCK[kind],
            num_layers=1,
            markov_rank=MARKOV_RANK if kind == "dspark" else None,
            steps=40,
            batch_size=NUM_PROMPTS,
            num_anchors=12,
            lr=3e-3,
            loss="ce",  # hard labels: the tiny random target's distributions are near flat, argmax is what it overfits
            log_every=10,
            save_dtype="float32" if kind == "dflash" else "float16",
            max_shard_mb=0.05 if kind == "dspark" else None,
        )
        results[kind] = train_draft(target, examples, root / f"{kind}_ckpt", options, eval_examples=examples)
    return results


# --------------------------------------------------------------------------------------------------
# Prompts and data


def test_builtin_prompts_are_many_distinct_and_seeded():
    prompts = builtin_prompts()
    assert len(prompts) >= 3000
    assert len(set(prompts)) == len(prompts)
    assert builtin_prompts(50) == prompts[:50]
    assert builtin_prompts(50, seed=1) != prompts[:50]
    assert any("Python function" in p for p in prompts) and any("poem" in p for p in prompts)
    # No benchmark prompts: HumanEval's are function signatures with docstrings.
    assert not any('"""' in p or ">>>" in p for p in prompts)


def test_generated_data_has_chat_prompt_then_greedy_answer(data_file, target):
    records = [json.loads(line) for line in data_file.read_text().splitlines()]
    assert sorted(r["prompt_index"] for r in records) == list(range(NUM_PROMPTS))
    prompts = builtin_prompts(NUM_PROMPTS)
    tokenizer = target.tokenizer
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    for record in records:
        prompt = prompts[record["prompt_index"]]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>user\n" + prompt) and text.endswith("<|im_start|>assistant\n")
        ids, cut = record["input_ids"], record["prompt_len"]
        assert ids[:cut] == tokenizer(text, add_special_tokens=False)["input_ids"]
        response = ids[cut:]
        assert 1 <= len(response) <= MAX_NEW_TOKENS
        assert record["finished"] == (response[-1] == eos)
        assert eos not in response[:-1]

    # The batched, left-padded answers equal transformers' greedy `generate` on each prompt alone.
    assert len({r["prompt_len"] for r in records}) > 1  # the batches were padded
    for record in records:
        prompt_ids = torch.tensor([record["input_ids"][: record["prompt_len"]]])
        alone = target.model.generate(
            input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        )[0, prompt_ids.shape[1]:].tolist()
        response = record["input_ids"][record["prompt_len"]:]
        assert alone[: len(response)] == response


def test_read_dataset_cuts_and_drops(tmp_path):
    path = write_dataset(tmp_path / "d.jsonl", [Example((1, 2, 3, 4, 5, 6), 2), Example((1, 2, 3), 2)])
    examples = read_dataset(path, max_length=5)
    assert examples == [Example((1, 2, 3, 4, 5), 2)]  # the second has a 1-token response: no anchor


# --------------------------------------------------------------------------------------------------
# Mask token and target layers


def _tokenizer_without_mask():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
    tok.train_from_iterator(["hello world"], trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def test_mask_token_choice(target):
    mask_id, reason = choose_mask_token_id(target.tokenizer, target.vocab_size)
    assert mask_id == target.tokenizer.convert_tokens_to_ids("<|mask|>") and "<|mask|>" in reason

    tokenizer = _tokenizer_without_mask()
    size = len(tokenizer)
    # A padded embedding table: the first row past the tokenizer is never a real token.
    assert choose_mask_token_id(tokenizer, size + 64)[0] == size
    # Otherwise a special token that the chat never uses, and never eos.
    mask_id, reason = choose_mask_token_id(tokenizer, size)
    chat_ids = set(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False))["input_ids"])
    assert mask_id not in chat_ids and mask_id != tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(mask_id) in ("<|endoftext|>", "<repo_name>") and "special" in reason


def test_target_layer_ids():
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 2) == [1, 27]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert all(i <= 2 for i in default_target_layer_ids(4, 3))  # never the post-norm last layer
    assert check_target_layer_ids([1, 15, 27], 30) == [1, 15, 27]
    for bad in ([29], [3, 3], [-1], []):
        with pytest.raises(Exception, match="layer"):
            check_target_layer_ids(bad, 30)


# --------------------------------------------------------------------------------------------------
# Blocks, labels, schedule


def test_anchors_lie_in_the_response():
    examples = [Example(tuple(range(20)), 8), Example(tuple(range(12)), 9)]
    batch = make_batch(examples, num_anchors=5, pad_id=0, rng=random.Random(0))
    assert batch.anchors.shape == (2, 5)
    first = batch.anchors[0][batch.anchor_valid[0]]
    assert len(first) == 5 and len(set(first.tolist())) == 5 and first.min() >= 8 and first.max() <= 18
    second = batch.anchors[1][batch.anchor_valid[1]]
    assert sorted(second.tolist()) == [9, 10]  # only two positions have a next token
    assert batch.input_ids[1, 12:].eq(0).all()


@pytest.mark.parametrize("kind,predictions", [("dflash", 3), ("dspark", 4)])
def test_block_labels(kind, predictions):
    # Block size 4: DFlash predicts from rows 1..3, DSpark from rows 0..3; the i-th prediction is anchor+1+i.
    ids = torch.tensor([[100 + i for i in range(10)]])
    batch = Batch(ids, torch.tensor([10]), torch.tensor([[3, 7]]), torch.tensor([[True, True]]))
    labels, valid, previous = block_labels(batch, predictions)
    assert labels[0, 0].tolist() == [104, 105, 106, 107][:predictions]
    assert previous[0, 0].tolist() == [103, 104, 105, 106][:predictions]  # the anchor, then teacher forcing
    assert valid[0, 0].all()
    assert valid[0, 1].tolist() == [True, True, False, False][:predictions]  # past the end of the sequence
    assert labels[0, 1, :2].tolist() == [108, 109]


def test_loss_gamma_and_schedule():
    assert (default_loss_gamma(16), default_loss_gamma(10), default_loss_gamma(8), default_loss_gamma(7)) == (7, 5, 4, 4)
    assert lr_at(0.02, 1.0, 0.04) == pytest.approx(0.5)
    assert lr_at(0.04, 1.0, 0.04) == pytest.approx(1.0)
    assert lr_at(0.52, 1.0, 0.04) == pytest.approx(0.5)
    assert lr_at(1.0, 1.0, 0.04) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("layers", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}])
def test_batched_blocks_equal_the_per_row_draft(root, target_src, layers):
    """Each block of the batched training forward is DraftModel's per-row call [context < anchor; block]."""
    name = "eq_sliding" if layers else "eq"
    make_tiny_draft(root / name, target_src, draft_block_size=4, num_key_value_heads=2, seed=5, **layers)
    model = load_draft_model(root / name)
    block, hidden, k = 4, model.config.hidden_size, model.config.num_target_features
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 14, k * hidden, generator=generator)
    embeds = torch.randn(2, 3, block, hidden, generator=generator)
    anchors = torch.tensor([[2, 7, 10], [1, 5, 6]])
    with torch.no_grad():
        batched = blocks_forward(model, features, embeds, anchors)
        for n in range(2):
            for i in range(3):
                a = int(anchors[n, i])
                rows = a + block
                inputs_embeds = torch.zeros(1, rows, hidden)
                inputs_embeds[0, a:] = embeds[n, i]
                hidden_states = torch.zeros(1, rows, k * hidden)
                hidden_states[0, :a] = features[n, :a]
                token_type_ids = torch.zeros(1, rows, dtype=torch.long)
                token_type_ids[0, a:] = 1
                reference, _ = model(
                    inputs_embeds, hidden_states, torch.arange(rows)[None], token_type_ids,
                    torch.ones(1, rows, dtype=torch.long),
                )
                torch.testing.assert_close(batched[n, i], reference[0, a:], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Training and checkpoints


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_training_overfits_the_tiny_data(trained, kind):
    result = trained[kind]
    assert result.steps == 40
    losses = [entry.metrics.loss for entry in result.history]
    assert losses[-1] < losses[0] - 0.5
    before, after = result.eval_before, result.eval_after
    assert len(after.accuracy) == BLOCK[kind] - (1 if kind == "dflash" else 0)
    assert after.loss < before.loss - 0.5
    assert min(after.accuracy) > max(before.accuracy) + 0.2  # every position learned
    assert after.tau > before.tau + 0.5


def _tensor_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            names.update(handle.keys())
    return names


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_checkpoint_is_the_source_format(root, trained, target, kind):
    folder = root / f"{kind}_ckpt"
    raw = json.loads((folder / "config.json").read_text())
    config = load_draft_config(folder)
    names = _tensor_names(folder)
    mask_id = target.tokenizer.convert_tokens_to_ids("<|mask|>")
    assert config.kind == kind and config.draft_block_size == BLOCK[kind] and config.mask_token_id == mask_id
    assert config.target_layer_ids == tuple(trained[kind].target_layer_ids)
    if kind == "dflash":
        assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
        assert raw["dflash_config"] == {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": mask_id}
        assert config.candidate_position_offset == 1 and config.markov_rank == 0
        assert "fc.weight" in names and not any(n.startswith(("model.", "markov_head.")) for n in names)
    else:
        assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_head_type"] == "vanilla"
        assert raw["mask_token_id"] == mask_id and raw["target_layer_ids"] == list(config.target_layer_ids)
        assert config.candidate_position_offset == 0 and config.markov_rank == MARKOV_RANK
        assert "model.fc.weight" in names and {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names
        assert (folder / "model.safetensors.index.json").is_file()  # sharded by max_shard_mb
    info = json.loads((folder / TRAINING_INFO_FILE).read_text())
    assert info["mask_token_reason"] and info["result"]["steps"] == 40


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_checkpoint_reloads_as_the_trained_draft(root, trained, kind):
    folder = root / f"{kind}_ckpt"
    config = load_draft_config(folder)
    weights = load_draft_weights(folder, config)
    trained_model = trained[kind].model
    tolerance = 0 if kind == "dflash" else 1e-3  # float32 / float16 saves
    for name, tensor in trained_model.model.state_dict().items():
        torch.testing.assert_close(weights[name], tensor.float(), atol=tolerance * (1 + tensor.abs().max()), rtol=0)
    if kind == "dspark":
        w2 = weights["markov_head.markov_w2.weight"]
        assert w2.shape == (config.vocab_size, MARKOV_RANK) and w2.abs().max() > 0  # trained from zero

    # The reloaded per-row draft (what export traces) reproduces the trained draft's block outputs.
    reloaded = load_draft_model(folder, config)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 9, config.num_target_features * config.hidden_size, generator=generator)
    embeds = torch.randn(1, 2, config.draft_block_size, config.hidden_size, generator=generator)
    anchors = torch.tensor([[3, 6]])
    with torch.no_grad():
        expected = blocks_forward(trained_model.model, features, embeds, anchors)
        got = blocks_forward(reloaded, features, embeds, anchors)
    torch.testing.assert_close(got, expected, atol=5e-5 if kind == "dflash" else 2e-2, rtol=1e-3)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_checkpoint_exports_and_validates(root, trained, target_ov, kind):
    exported = export_draft(root / f"{kind}_ckpt", root / f"{kind}_ov", weight_format="fp16", target_hidden_size=64)
    report = validate_draft(exported, target_ov)
    assert report.ok, [c.to_json() for c in report.failed]
    assert (exported / MARKOV_HEAD_FILE).is_file() == (kind == "dspark")
    assert report.check("block_size").passed and str(BLOCK[kind]) in report.check("block_size").detail


# --------------------------------------------------------------------------------------------------
# The command


def _app() -> typer.Typer:
    from dflash.cli import train as train_cmd

    app = typer.Typer()
    app.command("train", epilog=train_cmd.EXAMPLES)(train_cmd.train)
    app.command("noop")(lambda: None)  # two commands, so "train" is a subcommand as in the real app
    return app


def test_cli_generates_trains_and_saves(root, target_src):
    out = root / "cli_draft"
    result = CliRunner().invoke(
        _app(),
        ["train", str(target_src), str(out), "--kind", "dspark", "--block-size", "3", "--markov-rank", "4",
         "--generate-data", "3", "--max-new-tokens", "12", "--steps", "3", "--num-anchors", "4",
         "--device", "cpu", "--decontaminate", "none", "--json"],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["generation"]["sequences"] == 3 and summary["training"]["steps"] == 3
    assert [Path(p) for p in summary["data"]] == [out / "train_data.jsonl"]
    assert load_draft_config(out).markov_rank == 4
    assert "Loading weights" not in result.stderr  # transformers' progress bar while the target loads: not dflash's


def test_cli_rejects_two_data_sources(root, target_src, data_file):
    result = CliRunner().invoke(
        _app(), ["train", str(target_src), str(root / "x"), "--data", str(data_file), "--generate-data", "3"]
    )
    assert result.exit_code == 2
    assert "--data cannot be combined" in result.output


def test_cli_rejects_markov_head_on_dflash(root, target_src, data_file):
    result = CliRunner().invoke(
        _app(), ["train", str(target_src), str(root / "x"), "--data", str(data_file), "--markov-rank", "8", "--device", "cpu"]
    )
    assert result.exit_code == 2
    assert "no Markov head" in result.output


def test_cli_help_has_examples():
    result = CliRunner().invoke(_app(), ["train", "--help"])
    assert result.exit_code == 0 and "Examples:" in result.output and "dflash train" in result.output


def test_cli_holds_out_the_same_prompts_whatever_the_seed(root, target, target_src):
    """A warm-started run on the same data with another --seed (another batch order, as `device_run.sh again`
    gives each call) must hold out the same prompts, or sequences held out before would be trained on."""
    from dflash.training.trainer import load_state

    data = root / "data30.jsonl"
    generate_dataset(target, builtin_prompts(30), data, max_new_tokens=8, batch_size=10)
    held_out = {}
    for seed in (0, 1):
        out = root / f"seed{seed}"
        result = CliRunner().invoke(
            _app(),
            ["train", str(target_src), str(out), "--data", str(data), "--steps", "1", "--num-anchors", "2",
             "--block-size", "3", "--eval-sequences", "3", "--seed", str(seed), "--device", "cpu",
             "--decontaminate", "none", "--json"],
        )
        assert result.exit_code == 0, result.output
        held_out[seed] = load_state(out)["data"]
    assert held_out[0]["eval_sequences"] == 3
    assert held_out[0] == held_out[1]
