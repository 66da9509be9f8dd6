"""PagedAttention conversion and packing on a tiny exported target (real OpenVINO CPU inference).

The target has sliding-window layers (window 8) between full ones, so the checks also cover the
window OpenVINO reads from the mask (PA input 10) and its semantics on sequences longer than it.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch
from openvino.op.util import Variable, VariableInfo

from dflash.core.config import EXACT_OV_CONFIG
from dflash.core.errors import ExportError, ModelFormatError
from dflash.core.paged import (
    SequenceSlice,
    allocate_kv_caches,
    describe_paged_model,
    fit_to_input,
    pack_paged_inputs,
    packed_positions,
    read_kv_cache_layout,
    to_paged_attention,
)
from dflash.exporters.target import export_target
from dflash.exporters.tiny import make_tiny_target

F32 = EXACT_OV_CONFIG
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged_target")
    hf_dir = make_tiny_target(
        root / "hf", "qwen3", layer_types=LAYER_TYPES, sliding_window=WINDOW, use_sliding_window=True
    )
    ov_dir = export_target(hf_dir, root / "ov", weight_format="fp32")
    return hf_dir, ov_dir


@pytest.fixture(scope="module")
def paged(target):
    """(info, compiled) of the target converted to PA and compiled with f32 compute and cache."""
    model = ov.Core().read_model(target[1] / "openvino_model.xml")
    info = to_paged_attention(model)
    return info, ov.Core().compile_model(model, "CPU", F32)


@pytest.fixture(scope="module")
def reference(target):
    """transformers' logits of two token sequences, run one at a time: {name: (ids [n], logits [n, V])}."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target[0], dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    out = {}
    for name, length in (("a", 45), ("b", 13)):
        ids = rng.integers(0, hf.config.vocab_size, length)
        with torch.no_grad():
            out[name] = (ids, hf(torch.tensor(ids)[None]).logits[0].numpy())
    return out


class PagedRunner:
    """Drives the compiled PA target: one packed call per `step`, caches owned here."""

    def __init__(self, compiled: ov.CompiledModel, num_blocks: int = 8):
        self.compiled = compiled
        self.layout = read_kv_cache_layout(compiled)
        self.caches = allocate_kv_caches(self.layout, num_blocks)
        self.request = compiled.create_infer_request()
        for name, tensor in self.caches.items():
            self.request.set_tensor(name, tensor)

    def step(self, seqs: list[SequenceSlice], input_ids: np.ndarray) -> np.ndarray:
        feeds = pack_paged_inputs(seqs, self.layout.kv_block_size)
        feeds["input_ids"] = fit_to_input(self.compiled.input("input_ids"), input_ids)  # [T]
        feeds["position_ids"] = fit_to_input(self.compiled.input("position_ids"), packed_positions(seqs))  # [T]
        logits = self.request.infer(feeds)["logits"]  # [T, 1, V]
        return logits[:, 0].copy()


# ---------------------------------------------------------------------------------------------
# Conversion


def test_conversion_describes_every_layer(paged):
    info, _ = paged
    assert info.num_layers == 4
    assert [(layer.key_cache, layer.value_cache) for layer in info.layers] == [
        (f"key_cache.{i}", f"value_cache.{i}") for i in range(4)
    ]
    assert info.sliding_windows == [WINDOW, 0, WINDOW, 0]  # folded from the mask's constant subgraph
    assert info.token_type_ids_wired == [False] * 4  # a plain target has no token_type_ids
    assert sorted(info.other_inputs) == ["input_ids", "position_ids"]
    heads = {(layer.num_kv_heads, layer.key_head_size, layer.value_head_size) for layer in info.layers}
    assert heads == {(2, 16, 16)}


def test_converted_inputs_have_paged_shapes(paged):
    _, compiled = paged
    shapes = {port.get_any_name(): port.get_partial_shape() for port in compiled.inputs}
    assert shapes["input_ids"].rank.get_length() == 1  # batch = tokens
    assert shapes["position_ids"].rank.get_length() == 1
    for name in ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins"):
        assert compiled.input(name).get_element_type() == ov.Type.i32
    assert shapes["max_context_len"].rank.get_length() == 0
    assert "attention_mask" not in shapes and "beam_idx" not in shapes


def test_describe_reads_a_converted_model_again(target, paged):
    model = ov.Core().read_model(target[1] / "openvino_model.xml")
    to_paged_attention(model)
    assert describe_paged_model(model) == paged[0]
    with pytest.raises(ModelFormatError, match="already converted"):
        to_paged_attention(model)


def _sdpa_model(stateful: bool, with_sdpa: bool = True) -> ov.Model:
    x = ops.parameter([-1, -1, 2, 16], ov.Type.f32, name="inputs_embeds")
    out = ops.scaled_dot_product_attention(x, x, x, causal=True) if with_sdpa else ops.relu(x)
    if not stateful:
        return ov.Model([out], [x])
    info = VariableInfo()
    info.data_shape, info.data_type, info.variable_id = ov.PartialShape([-1, -1, 2, 16]), ov.Type.f32, "past"
    variable = Variable(info)
    total = ops.add(ops.read_value(x, variable), out)
    return ov.Model([ops.result(total)], [ops.assign(total, variable)], [x])


def test_conversion_rejects_models_it_cannot_convert():
    with pytest.raises(ModelFormatError, match="not stateful"):
        to_paged_attention(_sdpa_model(stateful=False))
    with pytest.raises(ModelFormatError, match="no ScaledDotProductAttention"):
        to_paged_attention(_sdpa_model(stateful=True, with_sdpa=False))
    # Stateful with SDPA, but the state is not a KV cache feeding it: OpenVINO's pass fails.
    with pytest.raises(ExportError) as err:
        to_paged_attention(_sdpa_model(stateful=True))
    assert err.value.hint and "\n" not in err.value.message


# ---------------------------------------------------------------------------------------------
# Cache layout


def test_layout_of_f32_cache(paged):
    info, compiled = paged
    layout = read_kv_cache_layout(compiled)
    assert len(layout.layers) == info.num_layers
    value_shape = compiled.input("value_cache.0").get_partial_shape()
    assert layout.kv_block_size == value_shape[2].get_length()
    for layer in layout.layers:
        assert layer.key_type == layer.value_type == ov.Type.f32
        assert layer.key_block_shape == layer.value_block_shape == (2, layout.kv_block_size, 16)
        assert (layer.key_head_size, layer.value_head_size, layer.num_kv_heads) == (16, 16, 2)
    assert layout.bytes_per_block == 4 * 2 * (2 * layout.kv_block_size * 16 * 4)


def test_layout_of_u8_cache_reads_block_size_from_values(target):
    model = ov.Core().read_model(target[1] / "openvino_model.xml")
    info = to_paged_attention(model)
    u8_cache = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "u8"}
    compiled = ov.Core().compile_model(model, "CPU", u8_cache)
    layout = read_kv_cache_layout(compiled)
    layer = layout.layers[0]
    assert layer.key_type == layer.value_type == ov.Type.u8
    # Keys carry per-channel scale/zero-point rows on the block axis, values per-token ones per row.
    assert layer.key_block_shape[1] != layout.kv_block_size
    assert layer.value_block_shape[1] == layout.kv_block_size
    assert layer.value_block_shape[2] != layer.value_head_size
    assert layer.key_head_size == info.layers[0].key_head_size
    assert layer.value_head_size == info.layers[0].value_head_size
    caches = allocate_kv_caches(layout, num_blocks=3)
    assert list(caches["key_cache.0"].shape) == [3, *layer.key_block_shape]
    assert caches["key_cache.0"].element_type == ov.Type.u8


def test_allocated_caches_are_zeroed_and_named(paged):
    layout = read_kv_cache_layout(paged[1])
    caches = allocate_kv_caches(layout, num_blocks=5)
    assert set(caches) == {f"{kind}_cache.{i}" for kind in ("key", "value") for i in range(4)}
    for tensor in caches.values():
        assert list(tensor.shape) == [5, 2, layout.kv_block_size, 16]
        assert not tensor.data.any()


# ---------------------------------------------------------------------------------------------
# Packing


def test_pack_paged_inputs_values_and_types():
    seqs = [SequenceSlice(past_len=30, num_new_rows=5, block_table=[7, 2, 9]), SequenceSlice(0, 3, [4, 5])]
    packed = pack_paged_inputs(seqs, kv_block_size=32)
    assert {name: array.dtype for name, array in packed.items()} == dict.fromkeys(packed, np.dtype(np.int32))
    assert packed["past_lens"].tolist() == [30, 0]
    assert packed["subsequence_begins"].tolist() == [0, 5, 8]
    assert packed["block_indices"].tolist() == [7, 2, 4]  # only the blocks that rows up to past+new touch
    assert packed["block_indices_begins"].tolist() == [0, 2, 3]
    assert packed["max_context_len"].shape == () and int(packed["max_context_len"]) == 35
    assert packed_positions(seqs).tolist() == [30, 31, 32, 33, 34, 0, 1, 2]
    assert packed_positions(seqs).dtype == np.int64


def test_pack_paged_inputs_rejects_bad_slices():
    with pytest.raises(ValueError, match="cannot hold"):
        pack_paged_inputs([SequenceSlice(30, 5, [1])], kv_block_size=32)
    with pytest.raises(ValueError, match="num_new_rows"):
        pack_paged_inputs([SequenceSlice(3, 0, [1])], kv_block_size=32)
    with pytest.raises(ValueError, match="at least one"):
        pack_paged_inputs([], kv_block_size=32)


def test_fit_to_input_matches_each_input_rank(paged):
    _, compiled = paged
    rows = np.arange(6)
    fitted = fit_to_input(compiled.input("input_ids"), rows[:, None])  # [T, 1] -> [T]
    assert fitted.shape == (6,) and fitted.dtype == np.int64
    probe = ov.PartialShape([-1, 1, 128])
    param = ops.parameter(probe, ov.Type.f32, name="hidden_states")
    fitted = fit_to_input(param.output(0), np.zeros((6, 128), dtype=np.float64))  # [T, k*H] -> [T, 1, k*H]
    assert fitted.shape == (6, 1, 128) and fitted.dtype == np.float32
    with pytest.raises(ValueError, match="cannot fit"):
        fit_to_input(compiled.input("input_ids"), np.zeros((6, 2)))


# ---------------------------------------------------------------------------------------------
# Inference


def test_two_packed_sequences_match_transformers(paged, reference):
    """Prefill chunks then decode steps of two sequences in shared calls, on scattered blocks."""
    runner = PagedRunner(paged[1])
    ids_a, ref_a = reference["a"]  # 45 tokens: crosses a block boundary and the window many times
    ids_b, ref_b = reference["b"]
    table_a, table_b = [6, 1], [3]  # non-contiguous, interleaved physical blocks
    plan = [(0, 20, 0, 9), (20, 22, 9, 1), (42, 1, 10, 1), (43, 1, 11, 1), (44, 1, 12, 1)]
    for past_a, new_a, past_b, new_b in plan:
        seqs = [SequenceSlice(past_a, new_a, table_a), SequenceSlice(past_b, new_b, table_b)]
        ids = np.concatenate([ids_a[past_a : past_a + new_a], ids_b[past_b : past_b + new_b]])
        logits = runner.step(seqs, ids)
        np.testing.assert_allclose(logits[:new_a], ref_a[past_a : past_a + new_a], atol=2e-5, rtol=0)
        np.testing.assert_allclose(logits[new_a:], ref_b[past_b : past_b + new_b], atol=2e-5, rtol=0)

    # The plugin wrote keys in place into exactly the blocks the tables name.
    used = {6, 1, 3}
    key_cache = runner.caches["key_cache.0"].data
    for block in range(key_cache.shape[0]):
        assert key_cache[block].any() == (block in used), block


def test_chunked_prefill_equals_one_shot(paged, reference):
    ids, _ = reference["a"]
    one_shot = PagedRunner(paged[1]).step([SequenceSlice(0, len(ids), [2, 5])], ids)
    chunked_runner = PagedRunner(paged[1])
    chunks = []
    for past, new in ((0, 13), (13, 19), (32, 13)):  # the last chunk starts exactly on a block boundary
        chunks.append(chunked_runner.step([SequenceSlice(past, new, [2, 5])], ids[past : past + new]))
    np.testing.assert_allclose(np.concatenate(chunks), one_shot, atol=1e-5, rtol=0)


def test_past_lens_rolls_back_rejected_rows(paged, reference):
    """Rows written beyond past_len are ignored and overwritten: rollback needs no cache edit."""
    ids, ref = reference["a"]
    runner = PagedRunner(paged[1])
    runner.step([SequenceSlice(0, 30, [0, 4])], ids[:30])
    runner.step([SequenceSlice(30, 4, [0, 4])], np.array([1, 2, 3, 4]))  # a "rejected" guess, rows 30..33
    logits = runner.step([SequenceSlice(30, 15, [0, 4])], ids[30:])
    np.testing.assert_allclose(logits, ref[30:], atol=2e-5, rtol=0)
