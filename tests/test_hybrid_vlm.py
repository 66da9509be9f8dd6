"""Qwen3.5 as published: a vision-language checkpoint (`qwen3_5`) exported as a text target.

`dflash export` stages the language model of a `qwen3_5` checkpoint as a `qwen3_5_text` one (config from
`text_config`, weights linked; transformers renames `model.language_model.*` and drops the vision tower)
and exports that (exporters/hybrid.py, `text_target_source`). The tiny VLM here (exporters/tiny.py,
`make_tiny_vlm_target`) has tied embeddings set only where the VLM reads them (the top level, so the
checkpoint has no `lm_head.weight`) and the published interleaved M-RoPE layout. Checked: the export
of the pair through the CLI (one note on stderr, validation of a DFlash draft made for it), and the
engine's greedy tokens on the exported target against transformers' `generate` of the VLM itself on
text-only input (f32).

optimum-intel 2.2.0 exports Qwen3.5 only with transformers 5.2.x: the slow tests skip elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import transformers

from dflash.exporters.hybrid import text_target_config
from dflash.exporters.roles import detect_role

needs_52 = pytest.mark.skipif(
    not transformers.__version__.startswith("5.2."),
    reason=f"optimum-intel 2.2.0 exports qwen3_5 only with transformers 5.2.x (have {transformers.__version__})",
)
NEW_TOKENS = 16
_rng = np.random.default_rng(5)
PROMPTS = [[int(t) for t in _rng.integers(4, 500, n)] for n in (6, 19, 40)]


# ---- fast: the staged config ---------------------------------------------------------------------


def test_a_qwen3_5_checkpoint_is_a_target_whose_text_config_is_staged():
    vlm = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "eos_token_id": 7,
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "tie_word_embeddings": False, "eos_token_id": 3},
        "vision_config": {"depth": 1},
    }
    assert detect_role(vlm) == "target"
    text = text_target_config(vlm)
    assert text["model_type"] == "qwen3_5_text" and text["architectures"] == ["Qwen3_5ForCausalLM"]
    # The VLM ties by its top-level flag (default False), whatever text_config says.
    assert text["tie_word_embeddings"] is True
    assert text["dtype"] == "bfloat16" and text["eos_token_id"] == 3 and "vision_config" not in text
    assert text_target_config({k: v for k, v in vlm.items() if k != "tie_word_embeddings"})["tie_word_embeddings"] is False


# ---- slow: export through the CLI, then the engine against transformers -----------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, object]:
    """(the VLM checkpoint, the exported pair's folder, the CLI result of `dflash export VLM --draft`)."""
    from typer.testing import CliRunner

    from dflash.cli.app import app
    from dflash.exporters.draft_checkpoint import make_tiny_draft
    from dflash.exporters.tiny import make_tiny_vlm_target

    root = tmp_path_factory.mktemp("hybrid-vlm")
    vlm = make_tiny_vlm_target(root / "hf-vlm", seed=3, initializer_range=0.2, tie_word_embeddings=True)
    draft = make_tiny_draft(root / "hf-draft", vlm, "dflash", draft_block_size=4)
    args = ["export", str(vlm), str(root / "ov"), "--draft", str(draft), "--weight-format", "fp32"]
    return vlm, root / "ov", CliRunner().invoke(app, args)


@pytest.mark.slow
@needs_52
def test_export_of_a_vlm_checkpoint_with_a_draft(pair):
    import json

    import openvino as ov
    from safetensors import safe_open

    from dflash.core.hidden_states import read_hidden_state_locators
    from dflash.exporters.hybrid import ROPE_FROM_POSITION_IDS

    vlm, out, result = pair
    assert result.exit_code == 0, result.output
    assert re.search(r"all \d+ checks passed", result.output)  # the DFlash draft validates against the text target
    notes = [line for line in result.stderr.splitlines() if "vision tower is left out" in line]
    assert len(notes) == 1 and "qwen3_5" in notes[0]
    with safe_open(str(vlm / "model.safetensors"), "pt") as weights:  # the layout exported from
        names = list(weights.keys())
    assert "lm_head.weight" not in names and any(n.startswith("model.visual.") for n in names)
    assert all(n.startswith(("model.language_model.", "model.visual.")) for n in names)
    config = json.loads((out / "target" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["tie_word_embeddings"] is True
    assert "vision_config" not in config
    model = ov.Core().read_model(out / "target" / "openvino_model.xml")
    assert sorted(read_hidden_state_locators(model)) == [0, 1, 2, 3]
    assert model.get_rt_info(ROPE_FROM_POSITION_IDS).astype(str) == "True"
    assert (out / "target" / "openvino_tokenizer.xml").is_file()


@pytest.mark.slow
@needs_52
def test_exported_text_target_equals_the_vlm_generate(pair):
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
    from dflash.core.engine import EngineConfig, LLMEngine

    vlm, out, result = pair
    assert result.exit_code == 0, result.output
    hf = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5ForConditionalGeneration"
    assert hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist() for p in PROMPTS]

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens_schedule="constant")
    settings = EngineConfig(ov_config=EXACT_OV_CONFIG, num_kv_blocks=32, num_draft_kv_blocks=32, max_num_batched_tokens=256)
    for draft in (None, out / "draft"):  # the target alone, then with its (random) DFlash draft: lossless
        engine = LLMEngine(out / "target", settings, draft_dir=draft)
        ids = [engine.add_request(p, params) for p in PROMPTS]
        engine.run_until_done()
        assert [engine.result(i).token_ids for i in ids] == expected, f"draft: {draft}"
