"""The static-cache decoder of training data (training/fastgen.py) and self-instructed prompts.

Real parts: tiny llama (GQA) and qwen3 (q/k norms) targets built from configs, f32 on the CPU, against
the transformers-cache loop of `generate_responses`.
"""

from __future__ import annotations

import pytest
import torch

from dflash.exporters.tiny import make_tiny_target
from dflash.training.data import encode_prompt, generate_responses
from dflash.training.fastgen import static_generate, supports_static_decoding
from dflash.training.prompts import builtin_prompts, chat_user_prefix, self_instruct_prompts
from dflash.training.target import load_target


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory):
    folder = make_tiny_target(tmp_path_factory.mktemp(request.param) / "hf", request.param, seed=3, initializer_range=0.2)
    return load_target(folder, torch.device("cpu"))


def _prompts(target, count=6):
    ids = [encode_prompt(target.tokenizer, p) for p in builtin_prompts(count)]
    assert len({len(i) for i in ids}) > 1  # lengths differ: left padding is exercised
    return ids


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_static_decoding_equals_the_transformers_loop(target, ignore_eos):
    assert supports_static_decoding(target.model)
    ids = _prompts(target)
    hf = generate_responses(target, ids, 24, impl="hf", ignore_eos=ignore_eos)
    static = generate_responses(target, ids, 24, impl="static", ignore_eos=ignore_eos)
    assert static == hf
    assert len({tuple(r) for r, _ in hf}) > 1  # not one answer for all: the comparison is not vacuous


def test_prefill_in_slices_and_a_larger_cache_change_nothing(target):
    from dflash.training.data import pad_token_id, stop_token_ids
    from dflash.training.fastgen import StaticCacheDecoder

    ids = _prompts(target, 5)
    kwargs = dict(pad_id=pad_token_id(target), stop_ids=sorted(stop_token_ids(target)), ignore_eos=True)
    whole = static_generate(target.model, ids, 12, **kwargs)
    sliced = static_generate(target.model, ids, 12, prefill_rows=2, decoder=StaticCacheDecoder(target.model, 9, 400), **kwargs)
    assert sliced == whole


def test_sampling_is_seeded(target):
    ids = _prompts(target)
    def run(seed):
        return generate_responses(target, ids, 16, temperature=0.8, generator=torch.Generator().manual_seed(seed),
                                  impl="static", ignore_eos=True)
    assert run(1) == run(1) and run(1) != run(2)


def test_self_instruct_writes_distinct_requests_after_the_user_turn(target):
    prefix = chat_user_prefix(target.tokenizer)
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered.startswith(prefix) and rendered[len(prefix):].startswith("hello")
    prompts = self_instruct_prompts(target, 12, batch_size=16, max_query_tokens=48, lead_ins=("", "How"), seed=0)
    assert prompts and len(prompts) <= 12
    assert len({p.lower() for p in prompts}) == len(prompts)
    assert all(len(p.split()) >= 3 and "<|" not in p for p in prompts)


def test_cli_self_instruct_writes_its_requests_and_answers_them(tmp_path, target):
    import json

    import typer
    from typer.testing import CliRunner

    from dflash.cli import train as train_cmd
    from dflash.training.data import read_dataset

    def _app():
        app = typer.Typer()
        app.command("train")(train_cmd.train)
        app.command("noop")(lambda: None)  # two commands, so "train" is a subcommand as in the real app
        return app

    out = tmp_path / "si"
    result = CliRunner().invoke(_app(), ["train", str(target.path), str(out), "--data-only", "--self-instruct", "6",
                                         "--generate-data", "100", "--max-new-tokens", "6", "--gen-batch-size", "16",
                                         "--ignore-eos", "--device", "cpu", "--decontaminate", "none", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    requests = (out / "self_instruct_prompts.txt").read_text().splitlines()
    assert summary["self_instruct"]["requests"] == len(requests) > 0
    assert summary["generation"]["sequences"] == len(read_dataset(out / "train_data.jsonl")) == len(requests)

    refused = CliRunner().invoke(_app(), ["train", str(target.path), str(tmp_path / "x"), "--self-instruct", "6",
                                          "--prompts", str(out / "self_instruct_prompts.txt")])
    assert refused.exit_code == 2 and "--self-instruct and --prompts" in refused.output
