"""Export parity of the draft on PagedAttention: the exported per-row draft, converted with
`to_paged_attention` and driven with packed [context; block] windows of two sequences, equals a plain
PyTorch implementation of the original DFlash forward.

The reference below is written from the DFlash math, not from the exporter's module: queries come from
the block rows only, the context enters each layer only as keys/values projected from
hidden_norm(fc(target_hidden)), the block attends bidirectionally to itself and to every context key
(within the window on sliding layers), and each sequence keeps a cache of its committed context rows
only. The PA side instead stores the block rows too and rolls them back by `past_lens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import openvino as ov
import pytest
import torch

from dflash.core.config import EXACT_OV_CONFIG
from dflash.core.paged import (
    SequenceSlice,
    allocate_kv_caches,
    fit_to_input,
    pack_paged_inputs,
    packed_positions,
    read_kv_cache_layout,
    to_paged_attention,
)
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import load_draft_weights, make_tiny_draft
from dflash.exporters.draft_config import DraftConfig, load_draft_config
from dflash.exporters.tiny import make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

F32 = EXACT_OV_CONFIG

DRAFTS = {
    # name: make_tiny_draft arguments. The tiny target has 4 query / 2 KV heads, so all drafts are GQA.
    "dflash": dict(kind="dflash", draft_block_size=4),
    "dspark": dict(kind="dspark", draft_block_size=5, markov_rank=4),
    # Window 6 is shorter than the 30-row context and the block, and one KV head for 4 query heads.
    "sliding": dict(kind="dflash", draft_block_size=4, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=6, num_key_value_heads=1),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("draft_paged") / "target", "qwen3")


@dataclass
class ExportedDraft:
    source: object  # checkpoint folder
    config: DraftConfig
    info: object  # PagedModelInfo
    compiled: ov.CompiledModel


@pytest.fixture(scope="module", params=list(DRAFTS))
def draft(request, target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"draft_{request.param}")
    source = make_tiny_draft(root / "hf", target_dir, seed=3, **DRAFTS[request.param])
    out = export_draft(source, root / "ov", weight_format="fp32")
    model = ov.Core().read_model(out / "openvino_model.xml")
    info = to_paged_attention(model)
    compiled = ov.Core().compile_model(model, "CPU", F32)
    return ExportedDraft(source, load_draft_config(source), info, compiled)


# ---------------------------------------------------------------------------------------------
# The reference: the original DFlash forward, one sequence at a time


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split convention. x: [heads, rows, head_dim]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq[None, :]  # [rows, dim/2]
    cos, sin = torch.cat([angles, angles], -1).cos().float(), torch.cat([angles, angles], -1).sin().float()
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


@dataclass
class ContextCache:
    """Committed context rows of one sequence: per layer keys (after norm and RoPE) and values."""

    keys: list[torch.Tensor] = field(default_factory=list)  # [kv_heads, rows, head_dim] per layer
    values: list[torch.Tensor] = field(default_factory=list)
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


class DFlashReference:
    """DFlash draft forward: block queries over [cached context; new context; block] keys."""

    def __init__(self, config: DraftConfig, weights: dict[str, torch.Tensor]):
        assert config.rope_parameters.get("rope_type", "default") == "default"
        self.c, self.w = config, weights
        self.theta = float(config.rope_parameters["rope_theta"])

    def step(self, cache: ContextCache, target_hidden: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
        """One draft call: new context rows [C, k*H] and block rows [Q, H] -> block output [Q, H].

        The new context rows are appended to `cache` (committed); the block rows are not kept.
        """
        c, w = self.c, self.w
        start = int(cache.positions[-1]) + 1 if len(cache.positions) else 0
        num_ctx, num_block = len(target_hidden), len(block_embeds)
        ctx_pos = torch.arange(start, start + num_ctx)
        block_pos = torch.arange(start + num_ctx, start + num_ctx + num_block)
        ctx = rms_norm(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], c.rms_norm_eps)  # [C, H]
        key_pos = torch.cat([cache.positions, ctx_pos, block_pos])
        h = block_embeds
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = self._heads(x, i, "q", c.num_attention_heads, block_pos)
            k_ctx = self._heads(ctx, i, "k", c.num_key_value_heads, ctx_pos)
            k_blk = self._heads(x, i, "k", c.num_key_value_heads, block_pos)
            v_ctx = self._heads(ctx, i, "v", c.num_key_value_heads)
            v_blk = self._heads(x, i, "v", c.num_key_value_heads)
            if len(cache.keys) <= i:
                cache.keys.append(k_ctx[:, :0])
                cache.values.append(v_ctx[:, :0])
            keys = torch.cat([cache.keys[i], k_ctx, k_blk], 1)  # [kv_heads, S, d]
            values = torch.cat([cache.values[i], v_ctx, v_blk], 1)
            cache.keys[i] = torch.cat([cache.keys[i], k_ctx], 1)
            cache.values[i] = torch.cat([cache.values[i], v_ctx], 1)

            # Bidirectional: every block query sees every key, except those out of a sliding window.
            allowed = torch.ones(num_block, len(key_pos), dtype=torch.bool)
            window = c.layer_window(i)
            if window is not None:
                allowed = key_pos[None, :] > block_pos[:, None] - window
            group = c.num_attention_heads // c.num_key_value_heads
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            scores = q @ keys.transpose(1, 2) / math.sqrt(c.head_dim)  # [heads, Q, S]
            scores = scores.masked_fill(~allowed, float("-inf"))
            attn = (scores.softmax(-1) @ values).transpose(0, 1).reshape(num_block, -1)  # [Q, heads*d]
            h = h + attn @ w[p + "self_attn.o_proj.weight"].T
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        cache.positions = torch.cat([cache.positions, ctx_pos])
        return rms_norm(h, w["norm.weight"], c.rms_norm_eps)

    def _heads(self, x, layer: int, which: str, num_heads: int, positions=None) -> torch.Tensor:
        """x [rows, H] -> q/k/v of `layer` as [heads, rows, head_dim]; q and k get their norm and RoPE."""
        attn = f"layers.{layer}.self_attn."
        out = (x @ self.w[f"{attn}{which}_proj.weight"].T).view(len(x), num_heads, -1).transpose(0, 1)
        if which == "v":
            return out
        out = rms_norm(out, self.w[f"{attn}{which}_norm.weight"], self.c.rms_norm_eps)
        return rope(out, positions, self.theta)


# ---------------------------------------------------------------------------------------------
# The PA side


class PagedDraft:
    """The converted draft on its own block caches; one packed inference per `step`."""

    def __init__(self, compiled: ov.CompiledModel, num_blocks: int = 6):
        self.compiled = compiled
        self.layout = read_kv_cache_layout(compiled)
        self.caches = allocate_kv_caches(self.layout, num_blocks)
        self.request = compiled.create_infer_request()
        for name, tensor in self.caches.items():
            self.request.set_tensor(name, tensor)

    def step(self, seqs, embeds, hidden, token_types) -> np.ndarray:
        """Rows packed over `seqs`: embeds [T, H], hidden [T, k*H], token_types [T] -> [T, H]."""
        feeds = pack_paged_inputs(seqs, self.layout.kv_block_size)
        rows = {"inputs_embeds": embeds, "hidden_states": hidden, "position_ids": packed_positions(seqs),
                "token_type_ids": token_types}
        for name, array in rows.items():
            feeds[name] = fit_to_input(self.compiled.input(name), array)
        out = self.request.infer(feeds)["last_hidden_state"]  # [T, 1, H]
        return out.reshape(len(token_types), -1).copy()


def test_token_type_ids_and_windows_reach_every_layer(draft):
    info, config = draft.info, draft.config
    assert info.num_layers == config.num_hidden_layers
    assert info.token_type_ids_wired == [True] * info.num_layers  # else PA would run a causal block
    expected = [config.layer_window(i) or 0 for i in range(config.num_hidden_layers)]
    assert info.sliding_windows == expected
    assert sorted(info.other_inputs) == ["hidden_states", "inputs_embeds", "position_ids", "token_type_ids"]
    assert {layer.num_kv_heads for layer in info.layers} == {config.num_key_value_heads}
    assert read_kv_cache_layout(draft.compiled).layers[0].key_type == ov.Type.f32


def test_packed_windows_match_the_dflash_forward(draft):
    """Two sequences per call, three calls; every call after the first starts at the committed
    context, so it overwrites the previous block's cache slots (the rollback)."""
    config = draft.config
    reference = DFlashReference(config, load_draft_weights(draft.source, config))
    h, kh, q = config.hidden_size, config.num_target_features * config.hidden_size, config.draft_block_size
    paged = PagedDraft(draft.compiled)
    block_tables = [[4, 1], [2, 5]]  # scattered physical blocks; sequence 1 crosses a block boundary
    # New context rows per call: sequence 0 stays short, sequence 1's block straddles the boundary
    # in call 1 and its context crosses it in call 2.
    context_rows = [(5, 30), (3, 4), (1, 2)]
    caches = [ContextCache(), ContextCache()]
    committed = [0, 0]
    gen = torch.Generator().manual_seed(11)

    for call, rows in enumerate(context_rows):
        seqs, embeds, hidden, types, expected = [], [], [], [], []
        for s, num_ctx in enumerate(rows):
            target_hidden = torch.randn(num_ctx, kh, generator=gen)
            block_embeds = torch.randn(q, h, generator=gen)
            expected.append(reference.step(caches[s], target_hidden, block_embeds).numpy())
            seqs.append(SequenceSlice(committed[s], num_ctx + q, block_tables[s]))
            # Rows a row type ignores get noise: context rows must not read their embedding, nor
            # block rows the target hidden state.
            embeds.append(torch.cat([torch.randn(num_ctx, h, generator=gen), block_embeds]))
            hidden.append(torch.cat([target_hidden, torch.randn(q, kh, generator=gen)]))
            types.append(np.array([0] * num_ctx + [1] * q, dtype=np.int64))
            committed[s] += num_ctx
        out = paged.step(seqs, torch.cat(embeds).numpy(), torch.cat(hidden).numpy(), np.concatenate(types))

        begin = 0
        for s, num_ctx in enumerate(rows):
            assert not out[begin : begin + num_ctx].any(), f"call {call}: context rows of sequence {s} are not 0"
            block = out[begin + num_ctx : begin + num_ctx + q]
            np.testing.assert_allclose(block, expected[s], atol=1e-5, rtol=0, err_msg=f"call {call}, sequence {s}")
            begin += num_ctx + q


def test_reference_is_sensitive_to_the_mask(draft):
    """Guard for the parity test: a causal block (what PA does without token_type_ids) differs."""
    config = draft.config
    reference = DFlashReference(config, load_draft_weights(draft.source, config))
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, config.num_target_features * config.hidden_size, generator=gen)
    block = torch.randn(config.draft_block_size, config.hidden_size, generator=gen)
    full = reference.step(ContextCache(), hidden, block)
    changed = block.clone()
    changed[-1] += 1.0  # the last block row: under a causal mask no other row would see it
    assert not torch.allclose(reference.step(ContextCache(), hidden, changed)[0], full[0], atol=1e-3)
