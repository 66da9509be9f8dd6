"""Target export: optimum-intel exports of tiny models, run on OpenVINO CPU, checked against transformers.

Each family is exported once per session, each in a different weight format, so that the four
exports cover every family and every format:
  llama fp32, qwen3 fp16 (optimum-intel annotates qwen3 itself), qwen2 int8, mistral int4.
Exact comparisons compile with INFERENCE_PRECISION_HINT=f32 (this CPU defaults to bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from openvino._offline_transformations import paged_attention_transformation

from dflash.core.errors import ExportError, InputError, ModelFormatError
from dflash.core.hidden_states import (
    RT_INFO_KEY,
    annotate_hidden_states,
    hidden_state_outputs,
    locate_hidden_states,
    num_decoder_layers,
    read_hidden_state_locators,
)
from dflash.exporters.target import detect_role, export_target
from dflash.exporters.tiny import make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

NUM_LAYERS = 4
HIDDEN = 64
FORMATS = {"llama": "fp32", "qwen3": "fp16", "qwen2": "int8", "mistral": "int4"}
F32 = {"INFERENCE_PRECISION_HINT": "f32"}
PROMPT = "def fibonacci(n):\n    return n"

core = ov.Core()


class Exports:
    """Source checkpoints and their exports, made on first use and shared by the whole session."""

    def __init__(self, root: Path):
        self.root = root
        self.steps: dict[str, list[str]] = {}

    def source(self, family: str) -> Path:
        path = self.root / f"hf-{family}"
        if not (path / "config.json").exists():
            make_tiny_target(path, family, seed=7)
        return path

    def exported(self, family: str) -> Path:
        out = self.root / f"ov-{family}-{FORMATS[family]}"
        if not (out / "openvino_model.xml").exists():
            steps = self.steps.setdefault(family, [])
            export_target(self.source(family), out, weight_format=FORMATS[family], on_step=steps.append)
        return out


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> Exports:
    return Exports(tmp_path_factory.mktemp("target-export"))


def _prompt_ids(source: Path) -> np.ndarray:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(source)(PROMPT)["input_ids"]
    return np.array([ids], dtype=np.int64)


def _reference(source: Path, input_ids: np.ndarray, *, round_to_fp16: bool = False):
    """transformers' hidden states and logits; `round_to_fp16` gives it the weights an fp16 IR holds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if round_to_fp16:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.half().float())
    with torch.no_grad():
        out = model(torch.from_numpy(input_ids), output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states], out.logits.numpy()


def _run_stateful(model: ov.Model, input_ids: np.ndarray, config: dict | None = None) -> list[np.ndarray]:
    """One prefill of a stateful export; returns every output (logits first, then added outputs)."""
    compiled = core.compile_model(model, "CPU", config or {})
    request = compiled.create_infer_request()
    seq = input_ids.shape[1]
    result = request.infer(
        {
            "input_ids": input_ids,
            "attention_mask": np.ones_like(input_ids),
            "position_ids": np.arange(seq, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
    )
    return [result[out] for out in compiled.outputs]


def _model_with_hidden_outputs(folder: Path) -> ov.Model:
    model = core.read_model(folder / "openvino_model.xml")
    model.add_outputs(hidden_state_outputs(model, range(num_decoder_layers(model))))
    return model


# --- the export itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FORMATS))
def test_export_is_a_standard_stateful_target(exports, family):
    out = exports.exported(family)
    model = core.read_model(out / "openvino_model.xml")

    inputs = {p.get_any_name() for p in model.inputs}
    assert inputs == {"input_ids", "attention_mask", "position_ids", "beam_idx"}
    assert [o.get_any_name() for o in model.outputs] == ["logits"]
    assert sum(op.get_type_name() == "ReadValue" for op in model.get_ops()) == 2 * NUM_LAYERS
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "openvino_tokenizer.xml", "openvino_detokenizer.xml"):
        assert (out / name).is_file(), name
    # The staging folder is gone: nothing but the exports and sources sits next to them.
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]

    expected_steps = ["Loading model", "Converting to OpenVINO", "Annotating hidden states"]
    if FORMATS[family] in ("int8", "int4"):
        expected_steps.append(f"Compressing weights ({FORMATS[family]})")
    assert exports.steps[family] == expected_steps + ["Converting tokenizer"]


@pytest.mark.parametrize("family", list(FORMATS))
def test_annotation_covers_every_layer_and_resolves(exports, family):
    model = core.read_model(exports.exported(family) / "openvino_model.xml")
    annotation = json.loads(model.get_rt_info(RT_INFO_KEY).astype(str))

    assert list(annotation["layers"]) == [str(layer) for layer in range(NUM_LAYERS)]
    names = [op.get_friendly_name() for op in model.get_ops()]
    for entry in annotation["layers"].values():
        assert names.count(entry["producer"]) == 1, entry
    outputs = hidden_state_outputs(model, range(NUM_LAYERS))
    assert all(out.get_partial_shape()[2] == HIDDEN for out in outputs)
    # The last layer is the value that feeds the lm_head MatMul, after the final norm.
    consumers = {t.get_node().get_type_name() for t in outputs[-1].get_target_inputs()}
    assert consumers == {"MatMul"}
    # dflash's graph-only locator (the engine's fallback) finds exactly what the annotation says.
    # For qwen3 the annotation is optimum-intel's own, for the others optimum's discovery run by dflash.
    assert locate_hidden_states(model) == read_hidden_state_locators(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hidden_states_and_logits_match_transformers(exports, family):
    source, out = exports.source(family), exports.exported(family)
    input_ids = _prompt_ids(source)
    hidden, logits = _reference(source, input_ids, round_to_fp16=FORMATS[family] == "fp16")

    results = _run_stateful(_model_with_hidden_outputs(out), input_ids, F32)

    # fp32 weights agree to ~1e-6; fp16 ones to ~3e-4 (OpenVINO keeps a few constants in f32).
    atol = 1e-4 if FORMATS[family] == "fp32" else 1e-3
    np.testing.assert_allclose(results[0], logits, atol=atol, rtol=0)
    for layer in range(NUM_LAYERS):
        # Layer L is HF hidden_states[L + 1]; hidden_states[0] is the embedding output.
        expected = hidden[layer + 1]
        np.testing.assert_allclose(results[1 + layer], expected, atol=atol, rtol=0, err_msg=str(layer))
    assert np.abs(results[1] - hidden[0]).max() > 1e-2  # the comparison can tell layers apart


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_compressed_exports_run_and_keep_the_annotation(exports, family):
    weight_format = FORMATS[family]
    model = _model_with_hidden_outputs(exports.exported(family))
    element_types = {op.get_element_type() for op in model.get_ops() if op.get_type_name() == "Constant"}
    compressed = {ov.Type.u4, ov.Type.i4} if weight_format == "int4" else {ov.Type.u8, ov.Type.i8}
    assert element_types & compressed, f"no {weight_format} weights in the graph"

    results = _run_stateful(model, _prompt_ids(exports.source(family)))

    assert all(np.isfinite(r).all() for r in results)
    assert results[0].shape[-1] == 512 and all(r.shape[-1] == HIDDEN for r in results[1:])


def test_hidden_state_outputs_survive_paged_attention(exports):
    """After SDPA -> PagedAttention the annotated outputs still give HF's hidden states, a row per token."""
    source, out = exports.source("llama"), exports.exported("llama")
    input_ids = _prompt_ids(source)
    hidden, logits = _reference(source, input_ids)
    model = core.read_model(out / "openvino_model.xml")
    paged_attention_transformation(model)
    model.add_outputs(hidden_state_outputs(model, range(NUM_LAYERS)))
    compiled = core.compile_model(model, "CPU", {**F32, "KV_CACHE_PRECISION": "f32"})

    request = compiled.create_infer_request()
    tokens = input_ids.shape[1]
    for port in compiled.inputs:
        name = port.get_any_name()
        if name.startswith(("key_cache.", "value_cache.")):
            shape = port.get_partial_shape()
            dims = [4] + [shape[i].get_length() for i in range(1, shape.rank.get_length())]
            request.set_tensor(name, ov.Tensor(port.get_element_type(), dims))
    kv_block_size = compiled.input("key_cache.0").get_partial_shape()[2].get_length()
    result = request.infer(
        {
            "input_ids": input_ids[0],
            "position_ids": np.arange(tokens, dtype=np.int64),
            "past_lens": np.array([0], dtype=np.int32),
            "subsequence_begins": np.array([0, tokens], dtype=np.int32),
            "block_indices": np.arange(-(-tokens // kv_block_size), dtype=np.int32),
            "block_indices_begins": np.array([0, -(-tokens // kv_block_size)], dtype=np.int32),
            "max_context_len": np.array(tokens, dtype=np.int32),
        }
    )
    values = [result[port] for port in compiled.outputs]

    np.testing.assert_allclose(values[0][:, 0], logits[0], atol=1e-3, rtol=0)
    for layer in range(NUM_LAYERS):
        np.testing.assert_allclose(values[1 + layer][:, 0], hidden[layer + 1][0], atol=1e-3, rtol=0)


def test_hidden_state_tap_leaves_a_bf16_targets_compute_as_it_was(exports):
    """Under bf16 the runner taps the hidden states in bf16: the target computes exactly what it does without
    the tap (an f32 tap made the plugin keep the whole residual stream in f32), and the rows it returns
    are transformers' hidden states within bf16's precision."""
    from dflash.core.model_runner import StepInputs, TargetRunner
    from dflash.core.paged import SequenceSlice

    source, out = exports.source("llama"), exports.exported("llama")
    input_ids = _prompt_ids(source)
    hidden, _ = _reference(source, input_ids)
    layers = (0, 2, 3)
    bf16 = {"INFERENCE_PRECISION_HINT": "bf16"}
    tapped, plain = TargetRunner(out, hidden_layer_ids=layers, ov_config=bf16), TargetRunner(out, ov_config=bf16)
    assert tapped.hidden_states_type == ov.Type.bf16
    tokens = input_ids.shape[1]
    step = StepInputs([SequenceSlice(0, tokens, list(range(4)))], input_ids[0], np.arange(tokens))
    results = []
    for runner in (tapped, plain):
        runner.allocate_cache(4)
        result = runner.run(step)
        results.append((result.logits.copy(), result.hidden_states))

    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[1][1] is None
    rows = results[0][1]  # [tokens, 3 * HIDDEN] f32
    assert rows.dtype == np.float32 and rows.shape == (tokens, len(layers) * HIDDEN)
    for i, layer in enumerate(layers):
        expected = hidden[layer + 1][0]
        np.testing.assert_allclose(rows[:, i * HIDDEN : (i + 1) * HIDDEN], expected, atol=0.05 * np.abs(expected).max())


def test_annotate_without_source_model_writes_the_same_locators(exports):
    model = core.read_model(exports.exported("llama") / "openvino_model.xml")
    expected = read_hidden_state_locators(model)
    del model.get_rt_info()[RT_INFO_KEY]
    assert not model.has_rt_info(RT_INFO_KEY)
    # Without the rt_info the reader locates the layers itself.
    assert read_hidden_state_locators(model) == expected

    annotate_hidden_states(model, NUM_LAYERS)

    assert read_hidden_state_locators(model) == expected
    for wrong_depth in (NUM_LAYERS - 1, NUM_LAYERS + 1):
        with pytest.raises(ExportError, match="cannot locate"):
            annotate_hidden_states(model, wrong_depth)


def test_unknown_layer_and_broken_annotation_are_format_errors(exports):
    model = core.read_model(exports.exported("llama") / "openvino_model.xml")
    with pytest.raises(ModelFormatError, match="no decoder layer 4"):
        hidden_state_outputs(model, [0, NUM_LAYERS])

    model.set_rt_info('{"layers":{"0":{"producer":"no such node","output_index":0}}}', RT_INFO_KEY)
    with pytest.raises(ModelFormatError, match="resolves to 0 nodes"):
        hidden_state_outputs(model, [0])
    model.set_rt_info('{"layers": 3}', RT_INFO_KEY)
    with pytest.raises(ModelFormatError, match="malformed"):
        read_hidden_state_locators(model)


def test_openvino_tokenizer_matches_hugging_face(exports):
    import openvino_tokenizers  # noqa: F401 - registers the tokenizer operations
    from transformers import AutoTokenizer

    out = exports.exported("mistral")
    tokenizer_core = ov.Core()  # created after the import, so it knows the tokenizer operations
    tokenizer = tokenizer_core.compile_model(out / "openvino_tokenizer.xml", "CPU")
    detokenizer = tokenizer_core.compile_model(out / "openvino_detokenizer.xml", "CPU")

    ids = tokenizer([PROMPT])["input_ids"]

    assert ids.tolist() == [AutoTokenizer.from_pretrained(out)(PROMPT)["input_ids"]]
    assert detokenizer(ids)["string_output"].tolist() == [PROMPT]


# --- wrong input ---------------------------------------------------------------------------------


def test_folder_without_config_is_an_input_error(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(InputError, match="config.json"):
        export_target(tmp_path / "model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture", ["DFlashDraftModel", "Qwen3DSparkModel"])
def test_draft_given_as_target_is_a_format_error(tmp_path, architecture):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": "qwen3"}))
    with pytest.raises(ModelFormatError, match="draft") as raised:
        export_target(draft, tmp_path / "out")
    assert raised.value.hint
    assert not (tmp_path / "out").exists()


def test_unknown_weight_format_is_an_input_error(exports, tmp_path):
    with pytest.raises(InputError, match="weight format"):
        export_target(exports.source("llama"), tmp_path / "out", weight_format="int3")


def test_conversion_failure_is_an_export_error_and_leaves_nothing(exports, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    # A valid llama config.json without any weights next to it.
    (broken / "config.json").write_text((exports.source("llama") / "config.json").read_text())
    with pytest.raises(ExportError, match="optimum-intel could not convert") as raised:
        export_target(broken, tmp_path / "out", weight_format="fp32")
    assert raised.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_detect_role():
    assert detect_role({"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}) == "draft"
    assert detect_role({"architectures": ["Qwen3DSparkModel"]}) == "draft"
    assert detect_role({"architectures": ["Qwen3_5DFlashDraft"]}) == "draft"
    assert detect_role({"architectures": ["LlamaForCausalLM"]}) == "target"
    assert detect_role({"architectures": ["GPT2LMHeadModel"]}) == "target"
    assert detect_role({"model_type": "qwen2"}) == "target"
    with pytest.raises(ModelFormatError):
        detect_role({"architectures": ["BertForMaskedLM"], "model_type": "bert"})


def test_exporting_into_the_source_folder_is_an_input_error(exports):
    source = exports.source("llama")
    with pytest.raises(InputError, match="source model folder"):
        export_target(source, source)


def test_tokenizer_conversion_failure_is_only_a_warning(tmp_path):
    from dflash.exporters.target import _convert_tokenizer

    with pytest.warns(UserWarning, match="openvino_tokenizer.xml was not written"):
        _convert_tokenizer(tmp_path, trust_remote_code=False)  # a folder with no tokenizer files
    assert not (tmp_path / "openvino_tokenizer.xml").exists()
