"""The draft side of `dflash export`: config and checkpoint reading, the per-row PyTorch draft, the
stateful OpenVINO IR, its rt_info and PagedAttention structure, the Markov head, weight compression.

Numerical checks compare against `reference_dflash_forward` below: an independent plain-PyTorch
rendering of the ORIGINAL DFlash forward (queries from block rows only, context K/V injected from
hidden_norm(fc(target_hidden)), a fully bidirectional block, only context K/V kept in the cache),
reading the same checkpoint weights. It shares no code with the exporter.
"""

from __future__ import annotations

import json
import math

import numpy as np
import openvino as ov
import pytest
import torch
from openvino import opset13
from openvino._offline_transformations import paged_attention_transformation

from dflash.core.config import EXACT_OV_CONFIG
from dflash.core.errors import InputError, ModelFormatError
from dflash.exporters.draft import (
    DRAFT_MODEL_FILE,
    export_draft,
    read_draft_metadata,
)
from dflash.exporters.draft_checkpoint import load_draft_weights, make_tiny_draft
from dflash.exporters.draft_config import (
    build_target_layer_ids,
    load_draft_config,
    parse_draft_config,
)
from dflash.exporters.draft_model import load_draft_model
from dflash.exporters.markov_head import (
    MARKOV_HEAD_FILE,
    MarkovHead,
    convert_markov_head,
    markov_head_part,
)
from dflash.exporters.tiny import make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

# The stateful CPU plugin keeps its KV cache in a reduced precision unless told otherwise.
F32 = EXACT_OV_CONFIG
ATOL = 1e-4

# name -> make_tiny_draft arguments. Together they cover both source layouts, GQA and plain MHA,
# sliding-window layers, prefixed/unprefixed weights, safetensors (single and sharded) and .bin.
DRAFTS = {
    "dflash": dict(kind="dflash", num_key_value_heads=2, seed=1),
    "dspark": dict(kind="dspark", markov_rank=8, num_key_value_heads=2, num_shards=2, seed=2),
    "sliding": dict(
        kind="dflash",
        num_key_value_heads=4,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        file_format="bin",
        prefixed=True,
        seed=3,
    ),
}


# --------------------------------------------------------------------------------------------------
# Independent reference: the original DFlash forward, plain PyTorch on the raw checkpoint weights.
# --------------------------------------------------------------------------------------------------


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """Rotate-half RoPE of x [heads, rows, d] at integer `positions` [rows]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_dflash_forward(w, cfg, noise_embedding, target_hidden, ctx_positions, block_positions, cache):
    """One original DFlash draft call for one sequence.

    noise_embedding [Q, H] (embeddings of [seed, mask...]), target_hidden [C, k*H] (new context rows),
    cache: per layer (keys, values, key positions) of the committed context, rotated, [kv, L, d].
    Returns the block's hidden states [Q, H] and the cache extended by the new context rows only.
    """
    eps, heads, kv_heads, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    ctx = _rms(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = noise_embedding
    new_cache = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)

        def heads_of(t, n):
            return t.view(t.shape[0], n, d).transpose(0, 1)

        q = _rms(heads_of(x @ w[p + "self_attn.q_proj.weight"].T, heads), w[p + "self_attn.q_norm.weight"], eps)
        k_ctx = _rms(heads_of(ctx @ w[p + "self_attn.k_proj.weight"].T, kv_heads), w[p + "self_attn.k_norm.weight"], eps)
        k_blk = _rms(heads_of(x @ w[p + "self_attn.k_proj.weight"].T, kv_heads), w[p + "self_attn.k_norm.weight"], eps)
        v_ctx = heads_of(ctx @ w[p + "self_attn.v_proj.weight"].T, kv_heads)
        v_blk = heads_of(x @ w[p + "self_attn.v_proj.weight"].T, kv_heads)
        q = _rope(q, block_positions, theta)
        k_ctx, k_blk = _rope(k_ctx, ctx_positions, theta), _rope(k_blk, block_positions, theta)

        past_k, past_v, past_pos = cache[i]
        keys = torch.cat([past_k, k_ctx, k_blk], 1)
        values = torch.cat([past_v, v_ctx, v_blk], 1)
        key_pos = torch.cat([past_pos, ctx_positions, block_positions])
        new_cache.append((torch.cat([past_k, k_ctx], 1), torch.cat([past_v, v_ctx], 1), torch.cat([past_pos, ctx_positions])))

        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = q @ keys.transpose(1, 2) / math.sqrt(d)
        if layer_types[i] == "sliding_attention":
            # Keys less than `sliding_window` positions behind the query; the block is bidirectional.
            far = key_pos[None, :] <= block_positions[:, None] - cfg["sliding_window"]
            scores = scores.masked_fill(far[None], float("-inf"))
        attn = (scores.softmax(-1) @ values).transpose(0, 1).reshape(h.shape[0], heads * d)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = y @ w[p + "mlp.gate_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps), new_cache


def reference_empty_cache(cfg):
    shape = (cfg["num_key_value_heads"], 0, cfg["head_dim"])
    return [(torch.zeros(shape), torch.zeros(shape), torch.zeros(0, dtype=torch.int64))] * cfg["num_hidden_layers"]


def raw_weights(draft_dir):
    """The checkpoint's tensors, read here without the exporter's loader (prefix stripped)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(draft_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    for file in sorted(draft_dir.glob("*.bin")):
        state.update(torch.load(str(file), weights_only=True))
    return {k.removeprefix("model."): v.float() for k, v in state.items()}


# --------------------------------------------------------------------------------------------------
# Two calls of one sequence: [context 6; block] at past 0, then [context 3; block] at past 6.
# --------------------------------------------------------------------------------------------------

CALLS = [(0, 6), (6, 3)]  # (committed past, new context rows)


def make_call(cfg, seed, past, num_ctx, batch=1):
    """Per-row inputs of one call and the reference's pieces, for `batch` independent sequences."""
    g = torch.Generator().manual_seed(seed)
    hidden, k, block = cfg["hidden_size"], len(target_ids(cfg)), cfg["block_size"]
    rows = num_ctx + block
    target_hidden = torch.randn(batch, num_ctx, k * hidden, generator=g)
    noise = torch.randn(batch, block, hidden, generator=g) * 0.5
    inputs_embeds = torch.cat([torch.randn(batch, num_ctx, hidden, generator=g), noise], 1)  # ctx rows: junk
    hidden_states = torch.cat([target_hidden, torch.randn(batch, block, k * hidden, generator=g)], 1)
    position_ids = torch.arange(past, past + rows)[None].repeat(batch, 1)
    token_type_ids = torch.tensor([[0] * num_ctx + [1] * block] * batch)
    attention_mask = torch.ones(batch, past + rows, dtype=torch.int64)
    return dict(
        inputs=dict(
            inputs_embeds=inputs_embeds,
            hidden_states=hidden_states,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            attention_mask=attention_mask,
        ),
        noise=noise,
        target_hidden=target_hidden,
        ctx_positions=torch.arange(past, past + num_ctx),
        block_positions=torch.arange(past + num_ctx, past + rows),
    )


def target_ids(cfg):
    return cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"]


def reference_calls(weights, cfg, calls, batch=1):
    """Block outputs [B, Q, H] of the original forward for each call, cache carried across calls."""
    caches = [reference_empty_cache(cfg) for _ in range(batch)]
    outs = []
    for call in calls:
        per_seq = []
        for b in range(batch):
            out, caches[b] = reference_dflash_forward(
                weights, cfg, call["noise"][b], call["target_hidden"][b], call["ctx_positions"], call["block_positions"], caches[b]
            )
            per_seq.append(out)
        outs.append(torch.stack(per_seq))
    return outs


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target") / "qwen3")


@pytest.fixture(scope="module")
def drafts(target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {name: make_tiny_draft(root / name, target_dir, **kwargs) for name, kwargs in DRAFTS.items()}


@pytest.fixture(scope="module")
def exported(drafts, tmp_path_factory):
    """Each tiny draft exported with fp32 weights (exact comparisons need them)."""
    root = tmp_path_factory.mktemp("exported")
    return {name: export_draft(path, root / name, weight_format="fp32") for name, path in drafts.items()}


@pytest.fixture(scope="module")
def core():
    return ov.Core()


def draft_cfg(draft_dir):
    return json.loads((draft_dir / "config.json").read_text())


# --------------------------------------------------------------------------------------------------
# Config parsing
# --------------------------------------------------------------------------------------------------


def test_build_target_layer_ids_follows_z_lab_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]


def test_configs_of_both_layouts(drafts):
    dflash = load_draft_config(drafts["dflash"])
    assert (dflash.kind, dflash.candidate_position_offset, dflash.markov_rank) == ("dflash", 1, 0)
    assert dflash.target_layer_ids == (0, 2) and dflash.draft_block_size == 4
    assert (dflash.hidden_size, dflash.num_attention_heads, dflash.num_key_value_heads, dflash.head_dim) == (64, 4, 2, 16)
    assert dflash.mask_token_id == 3  # the tiny target tokenizer's <|mask|>
    assert dflash.markov_head_type is None and dflash.sliding_window is None
    assert dflash.rope_parameters["rope_theta"] == 10000.0

    dspark = load_draft_config(drafts["dspark"])
    assert (dspark.kind, dspark.candidate_position_offset) == ("dspark", 0)
    assert (dspark.markov_rank, dspark.markov_head_type, dspark.vocab_size) == (8, "vanilla", 512)

    sliding = load_draft_config(drafts["sliding"])
    assert sliding.layer_types == ("sliding_attention", "full_attention")
    assert (sliding.layer_window(0), sliding.layer_window(1)) == (4, None)


def _zlab(**changes):
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9]},
    }
    raw.update(changes)
    return raw


def test_candidate_position_offset_resolution():
    assert parse_draft_config(_zlab()).candidate_position_offset == 1
    assert parse_draft_config(_zlab(sample_from_anchor=True)).candidate_position_offset == 0
    assert parse_draft_config(_zlab(sample_from_anchor=True, candidate_position_offset=1)).candidate_position_offset == 1
    dspark = _zlab(architectures=["Qwen3DSparkModel"], mask_token_id=5, target_layer_ids=[1, 2], dflash_config=None)
    assert parse_draft_config(dspark).candidate_position_offset == 0
    assert parse_draft_config({**dspark, "sample_from_anchor": False}).candidate_position_offset == 1


def test_missing_target_layer_ids_use_fallback_rule():
    cfg = parse_draft_config(_zlab(dflash_config={"mask_token_id": 7}))
    assert cfg.target_layer_ids == (1, 33)  # build_target_layer_ids(36, 2)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}, "not a DFlash or DSpark"),
        (_zlab(dflash_config={"target_layer_ids": [1]}), "mask_token_id"),
        (_zlab(block_size=None), "block_size"),
        (_zlab(dflash_config={"mask_token_id": 1}, num_target_layers=None), "target_layer_ids"),
        (_zlab(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (_zlab(dflash_config={"mask_token_id": 1, "target_layer_ids": [1], "selector_rank": 256}), "DFlash2"),
        (_zlab(markov_rank=8, markov_head_type="rnn"), "Markov head type"),
        (_zlab(num_hidden_layers=None), "num_hidden_layers"),
    ],
)
def test_bad_configs_raise_model_format_error(raw, words):
    with pytest.raises(ModelFormatError, match=words) as info:
        parse_draft_config(raw)
    assert info.value.hint  # every error says what to do


def test_missing_config_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        load_draft_config(tmp_path)


# --------------------------------------------------------------------------------------------------
# Checkpoint formats
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        dict(file_format="safetensors", prefixed=False),
        dict(file_format="safetensors", prefixed=True, num_shards=3),
        dict(file_format="bin", prefixed=False),
        dict(file_format="bin", prefixed=True, num_shards=2),
    ],
    ids=["safetensors", "safetensors-sharded-prefixed", "bin", "bin-sharded-prefixed"],
)
def test_checkpoint_formats_load_the_same_weights(target_dir, tmp_path, fmt):
    reference = make_tiny_draft(tmp_path / "ref", target_dir, seed=5)
    variant = make_tiny_draft(tmp_path / "variant", target_dir, seed=5, **fmt)
    names = {p.name for p in variant.iterdir()}
    if fmt.get("num_shards"):
        assert any(n.endswith(".index.json") for n in names)
    config = load_draft_config(reference)
    expected, loaded = load_draft_weights(reference, config), load_draft_weights(variant, config)
    assert expected.keys() == loaded.keys()
    assert all(torch.equal(expected[k], loaded[k]) for k in expected)


def test_dspark_checkpoint_keeps_markov_head_and_drops_unused_heads(drafts):
    raw = raw_weights(drafts["dspark"])
    assert {"embed_tokens.weight", "lm_head.weight", "confidence_head.proj.weight"} <= raw.keys()
    weights = load_draft_weights(drafts["dspark"], load_draft_config(drafts["dspark"]))
    assert weights["markov_head.markov_w1.weight"].shape == (512, 8)
    assert weights["markov_head.markov_w2.weight"].shape == (512, 8)
    assert not any(k.startswith(("embed_tokens", "lm_head", "confidence_head")) for k in weights)


def test_checkpoint_mismatches_raise(target_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    draft = make_tiny_draft(tmp_path / "d", target_dir)
    config = load_draft_config(draft)
    state = load_file(str(draft / "model.safetensors"))
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, str(draft / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="lacks layers.1.mlp.up_proj.weight"):
        load_draft_weights(draft, config)
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    state["layers.1.self_attn.gate_proj.weight"] = torch.zeros(4, 4)
    save_file(state, str(draft / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="does not know"):
        load_draft_weights(draft, config)
    del state["layers.1.self_attn.gate_proj.weight"]
    state["fc.weight"] = torch.zeros(64, 192)
    save_file(state, str(draft / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="fc.weight"):
        load_draft_weights(draft, config)


# --------------------------------------------------------------------------------------------------
# The per-row PyTorch draft equals the original DFlash forward
# --------------------------------------------------------------------------------------------------


def run_torch_calls(model, calls):
    """Per-row module over the calls; between calls the cache is trimmed to the committed context."""
    past = model.empty_cache(calls[0]["inputs"]["inputs_embeds"].shape[0])
    outs = []
    for call, (committed, _) in zip(calls, CALLS):
        past = [(k[:, :, :committed], v[:, :, :committed]) for k, v in past]
        with torch.no_grad():
            out, past = model(**call["inputs"], past_key_values=past)
        outs.append(out)
    return outs


@pytest.mark.parametrize("name", list(DRAFTS))
def test_per_row_module_equals_original_dflash(drafts, name):
    cfg = draft_cfg(drafts[name])
    calls = [make_call(cfg, 10 + i, past, ctx) for i, (past, ctx) in enumerate(CALLS)]
    expected = reference_calls(raw_weights(drafts[name]), cfg, calls)
    got = run_torch_calls(load_draft_model(drafts[name]), calls)
    for call, (_, num_ctx), out, ref in zip(calls, CALLS, got, expected):
        assert torch.count_nonzero(out[:, :num_ctx]) == 0  # context rows are exactly zero
        torch.testing.assert_close(out[:, num_ctx:], ref, atol=ATOL, rtol=0)


def test_reference_is_sensitive_to_the_window(drafts):
    """The sliding draft's window changes the answer, so the checks above would catch a lost window."""
    cfg = draft_cfg(drafts["sliding"])
    calls = [make_call(cfg, 10 + i, past, ctx) for i, (past, ctx) in enumerate(CALLS)]
    weights = raw_weights(drafts["sliding"])
    windowed = reference_calls(weights, cfg, calls)
    full = reference_calls(weights, {**cfg, "layer_types": ["full_attention"] * 2}, calls)
    assert (windowed[1] - full[1]).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------
# The exported stateful IR equals the original DFlash forward
# --------------------------------------------------------------------------------------------------


def run_ir_calls(compiled, calls):
    """Stateful IR over the calls; a rejected block is rolled back by trimming every state to the
    committed context, as the engine's past_lens does on PagedAttention."""
    request = compiled.create_infer_request()
    outs = []
    for call, (committed, _) in zip(calls, CALLS):
        if committed == 0:
            request.reset_state()  # a fresh sequence: the zero initializer sizes the state
        else:
            for state in request.query_state():
                kept = state.state.data[:, :, :committed]
                state.state = ov.Tensor(np.ascontiguousarray(kept))
        batch = call["inputs"]["inputs_embeds"].shape[0]
        feed = {name: t.numpy() for name, t in call["inputs"].items()}
        feed["beam_idx"] = np.arange(batch, dtype=np.int32)
        outs.append(torch.from_numpy(request.infer(feed)["last_hidden_state"].copy()))
    return outs


@pytest.mark.parametrize("name", list(DRAFTS))
def test_exported_ir_equals_original_dflash(drafts, exported, core, name):
    cfg = draft_cfg(drafts[name])
    batch = 2 if name == "dflash" else 1  # batch 2 exercises the state initializer's batch
    calls = [make_call(cfg, 20 + i, past, ctx, batch) for i, (past, ctx) in enumerate(CALLS)]
    expected = reference_calls(raw_weights(drafts[name]), cfg, calls, batch)
    compiled = core.compile_model(exported[name] / DRAFT_MODEL_FILE, "CPU", F32)
    got = run_ir_calls(compiled, calls)
    for (_, num_ctx), out, ref in zip(CALLS, got, expected):
        assert np.count_nonzero(out[:, :num_ctx].numpy()) == 0
        torch.testing.assert_close(out[:, num_ctx:], ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# Ports, states, rt_info, files
# --------------------------------------------------------------------------------------------------


def test_ports_and_states(exported, core):
    model = core.read_model(exported["dflash"] / DRAFT_MODEL_FILE)
    ports = {port.get_any_name(): (str(port.get_partial_shape()), port.get_element_type()) for port in model.inputs}
    assert ports == {
        "inputs_embeds": ("[?,?,64]", ov.Type.f32),
        "hidden_states": ("[?,?,128]", ov.Type.f32),
        "position_ids": ("[?,?]", ov.Type.i64),
        "token_type_ids": ("[?,?]", ov.Type.i64),
        "attention_mask": ("[?,?]", ov.Type.i64),
        "beam_idx": ("[?]", ov.Type.i32),
    }
    assert [p.get_any_name() for p in model.outputs] == ["last_hidden_state"]
    assert str(model.outputs[0].get_partial_shape()) == "[?,?,64]"
    variables = sorted(op.get_variable_id() for op in model.get_ops() if op.get_type_name() == "ReadValue")
    assert variables == sorted(
        f"past_key_values.{i}.{kind}present.{i}.{kind}" for i in range(2) for kind in ("key", "value")
    )
    read_values = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    assert all(str(op.get_output_partial_shape(0)) == "[?,2,?,16]" for op in read_values)


def rt(model, *path):
    return model.get_rt_info(list(path)).astype(str)


@pytest.mark.parametrize(
    "name, offset, markov",
    [("dflash", "1", "0"), ("dspark", "0", "8"), ("sliding", "1", "0")],
)
def test_rt_info_follows_the_contract(exported, core, name, offset, markov):
    model = core.read_model(exported[name] / DRAFT_MODEL_FILE)
    assert rt(model, "dflash_mode") == "True"
    assert rt(model, "dflash", "mask_token_id") == "3"
    assert rt(model, "dflash", "target_layer_ids") == "0,2"
    assert rt(model, "dflash", "block_size") == "4"
    assert rt(model, "dflash", "candidate_position_offset") == offset
    assert rt(model, "dflash", "markov_rank") == markov
    assert model.has_rt_info(["dflash", "markov_head_type"]) == (markov != "0")
    if markov != "0":
        assert rt(model, "dflash", "markov_head_type") == "vanilla"

    meta = read_draft_metadata(model)
    assert meta.target_layer_ids == (0, 2) and meta.draft_block_size == 4 and meta.mask_token_id == 3
    assert meta.candidate_position_offset == int(offset) and meta.markov_rank == int(markov) and meta.per_row
    assert (exported[name] / MARKOV_HEAD_FILE).exists() == (markov != "0")


def test_config_json_is_copied(drafts, exported):
    for name in DRAFTS:
        assert (exported[name] / "config.json").read_text() == (drafts[name] / "config.json").read_text()


def test_read_draft_metadata_rejects_old_and_foreign_models():
    embeds = opset13.parameter([-1, -1, 8], ov.Type.f32, name="inputs_embeds")
    embeds.output(0).get_tensor().set_names({"inputs_embeds"})
    model = ov.Model([opset13.result(opset13.relu(embeds))], [embeds], "old_draft")
    with pytest.raises(ModelFormatError, match="not a DFlash draft"):
        read_draft_metadata(model)
    model.set_rt_info("True", ["dflash_mode"])
    model.set_rt_info("5", ["dflash", "mask_token_id"])
    model.set_rt_info("1,2", ["dflash", "target_layer_ids"])
    with pytest.raises(ModelFormatError, match="old stateful runner") as info:
        read_draft_metadata(model)
    assert "re-export" in info.value.hint
    with pytest.raises(ModelFormatError, match="block_size"):
        read_draft_metadata(model, require_per_row=False)


def test_hidden_size_mismatch_is_rejected(drafts, tmp_path):
    with pytest.raises(ModelFormatError, match="hidden size 64 differs from the target's 96"):
        export_draft(drafts["dflash"], tmp_path / "out", target_hidden_size=96)
    assert not (tmp_path / "out" / DRAFT_MODEL_FILE).exists()


def test_window_narrower_than_block_is_rejected(target_dir, tmp_path):
    draft = make_tiny_draft(
        tmp_path / "d", target_dir, layer_types=["sliding_attention", "full_attention"], sliding_window=2
    )
    with pytest.raises(ModelFormatError, match="sliding_window 2 is smaller than its block_size 4"):
        export_draft(draft, tmp_path / "out")


def test_not_a_draft_is_rejected(target_dir, tmp_path):
    with pytest.raises(ModelFormatError, match="not a DFlash or DSpark draft"):
        export_draft(target_dir, tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# PagedAttention structure: token_type_ids reaches every layer, windows reach sliding layers
# --------------------------------------------------------------------------------------------------


def constant_value(core, output):
    return core.compile_model(ov.Model([opset13.result(output)], []), "CPU")({})[0]


@pytest.mark.parametrize("name", list(DRAFTS))
def test_paged_attention_sees_token_type_ids_and_windows(drafts, exported, core, name):
    model = core.read_model(exported[name] / DRAFT_MODEL_FILE)
    paged_attention_transformation(model)
    pa_ops = [op for op in model.get_ordered_ops() if op.get_type_name() == "PagedAttentionExtension"]
    config = load_draft_config(drafts[name])
    assert len(pa_ops) == config.num_hidden_layers
    # Rows become the batch axis: the transformation found `inputs_embeds` (by its friendly name).
    shapes = {port.get_any_name(): str(port.get_partial_shape()) for port in model.inputs}
    assert shapes["inputs_embeds"] == "[?,?]" and shapes["position_ids"] == "[?]"  # [T, H], [T]
    assert "attention_mask" not in shapes and "beam_idx" not in shapes
    for layer, op in enumerate(pa_ops):
        convert = op.input_value(25).get_node()
        assert convert.get_type_name() == "Convert"
        source = convert.input_value(0).get_node()
        assert source.get_type_name() == "Parameter" and "token_type_ids" in source.output(0).get_names()
        window = int(constant_value(core, op.input_value(10)))
        assert window == (config.layer_window(layer) or 0)


# --------------------------------------------------------------------------------------------------
# Markov head
# --------------------------------------------------------------------------------------------------


def test_markov_head_ir_equals_w1_w2_math(drafts, exported, core):
    weights = raw_weights(drafts["dspark"])
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    model = core.read_model(exported["dspark"] / MARKOV_HEAD_FILE)

    assert rt(model, "markov_head", "type") == "vanilla"
    assert rt(model, "markov_head", "rank") == "8"
    assert rt(model, "markov_head", "vocab_size") == "512"
    assert rt(model, "markov_head", "top_k") == "0"  # the dense walk
    assert [p.get_any_name() for p in model.inputs] == ["prev_token_ids", "prev_candidate_ids", "candidate_ids"]
    assert [p.get_any_name() for p in model.outputs] == ["markov_bias", "edge_scores"]
    float_constants = [
        op for op in model.get_ops() if op.get_type_name() == "Constant" and op.get_output_element_type(0).is_real()
    ]
    assert float_constants and all(op.get_output_element_type(0) == ov.Type.f32 for op in float_constants)

    dense = core.compile_model(markov_head_part(model, "dense"), "CPU", F32)
    prev = np.array([3, 0, 511, 17], dtype=np.int64)
    bias = dense({"prev_token_ids": prev})["markov_bias"]
    assert bias.shape == (4, 512)
    np.testing.assert_allclose(bias, (w1[prev] @ w2.T).numpy(), atol=1e-5, rtol=0)

    topk = core.compile_model(markov_head_part(model, "topk"), "CPU", F32)
    rng = np.random.default_rng(0)
    prev_cands = rng.integers(0, 512, size=(3, 2))
    cands = rng.integers(0, 512, size=(3, 5))
    edges = topk({"prev_candidate_ids": prev_cands, "candidate_ids": cands})["edge_scores"]
    assert edges.shape == (3, 2, 5)
    expected = np.einsum("rpd,rkd->rpk", w1[prev_cands].numpy(), w2[cands].numpy())
    np.testing.assert_allclose(edges, expected, atol=1e-5, rtol=0)
    # The Top-K lattice is the dense bias read at the candidates.
    full = (w1[prev_cands[1, 1]] @ w2.T).numpy()
    np.testing.assert_allclose(edges[1, 1], full[cands[1]], atol=1e-5, rtol=0)


def test_markov_head_top_k_is_capped_by_vocab(core):
    head = MarkovHead(torch.randn(6, 4), torch.randn(6, 4))
    model = convert_markov_head(head, top_k=8)
    assert rt(model, "markov_head", "top_k") == "6"
    assert rt(model, "markov_head", "vocab_size") == "6" and rt(model, "markov_head", "rank") == "4"


# --------------------------------------------------------------------------------------------------
# Weight compression
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight_format, int_types", [("int8", {ov.Type.u8, ov.Type.i8}), ("int4", {ov.Type.u4, ov.Type.i4})]
)
def test_compressed_export_loads_and_runs(drafts, core, tmp_path, weight_format, int_types):
    out = export_draft(drafts["dspark"], tmp_path / weight_format, weight_format=weight_format)
    model = core.read_model(out / DRAFT_MODEL_FILE)
    constant_types = {op.get_output_element_type(0) for op in model.get_ops() if op.get_type_name() == "Constant"}
    assert constant_types & int_types
    assert rt(model, "dflash", "markov_rank") == "8"

    cfg = draft_cfg(drafts["dspark"])
    calls = [make_call(cfg, 30 + i, past, ctx) for i, (past, ctx) in enumerate(CALLS)]
    expected = reference_calls(raw_weights(drafts["dspark"]), cfg, calls)
    got = run_ir_calls(core.compile_model(model, "CPU", F32), calls)
    for (_, num_ctx), out_rows, ref in zip(CALLS, got, expected):
        block = out_rows[:, num_ctx:]
        assert torch.isfinite(block).all()
        # Quantised, not equal; but still the same function: well correlated with the reference.
        cos = torch.nn.functional.cosine_similarity(block.flatten(), ref.flatten(), dim=0)
        assert cos > (0.99 if weight_format == "int8" else 0.9)
    # The Markov head stays f32 whatever the backbone's format.
    head = core.read_model(out / MARKOV_HEAD_FILE)
    assert all(
        op.get_output_element_type(0) == ov.Type.f32
        for op in head.get_ops()
        if op.get_type_name() == "Constant" and op.get_output_element_type(0).is_real()
    )


def test_fp16_export_and_progress(drafts, exported, core, tmp_path):
    lines = []
    out = export_draft(drafts["dspark"], tmp_path / "fp16", on_step=lines.append)  # fp16 is the default
    assert any("converting" in line for line in lines) and any("Markov head" in line for line in lines)
    fp32_size = (exported["dspark"] / "openvino_model.bin").stat().st_size
    assert (out / "openvino_model.bin").stat().st_size < 0.6 * fp32_size
    # fp16 applies to the backbone only: the Markov head keeps f32 weights.
    assert (out / "openvino_markov_head_model.bin").read_bytes() == (
        exported["dspark"] / "openvino_markov_head_model.bin"
    ).read_bytes()
