"""The DFlash/DSpark draft backbone in PyTorch, in the per-row formulation that the export traces.

The original DFlash forward takes Q block rows as queries and injects the context rows only as keys and
values. The per-row form treats every new row alike, which is what PagedAttention needs: a call gets T
rows [context; block] with `token_type_ids` 0 (context) or 1 (block), and in every layer

    x = hidden_norm(fc(hidden_states))   on context rows (the same projection in every layer)
    x = input_layernorm(h)               on block rows
    q, k, v = projections of x (q_norm/k_norm, RoPE at position_ids), keys/values = past ++ new

followed by attention under a mask built from `token_type_ids` (causal for context rows, bidirectional
among the block rows of the call, sliding window on sliding layers), the residual, MLP and residual.
Block rows get exactly the original DFlash result, and each row's keys/values are those the original
caches.

A context row needs nothing of a layer but its keys and values (its next-layer input is the target
projection again, and its output is zeroed), so only block rows carry a residual stream: after
attention, the block rows are gathered (NonZero of `token_type_ids`) and only they go through o_proj,
the residual and the MLP. A layer's input row r reads the block row before it in the call through a
running count of block rows (CumSum), which the Select then ignores on context rows. Context rows
(the draft's prefill, catch-up after a pause, committed rows each step) cost their projections and
attention only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from dflash.exporters.draft_checkpoint import load_draft_weights
from dflash.exporters.draft_config import DraftConfig, load_draft_config


def build_row_mask(
    token_type_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sliding_window: int | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Additive attention mask [B, 1, T, past+T] of one call's rows over the cached and new keys.

    A row sees every earlier key (causal); a block row also sees every block row of this call, later
    ones included; on a sliding layer a row sees only keys less than `sliding_window` positions
    behind it. Keys are indexed in cache order, so row i of the call sits at index past+i.

    The graph shape matters: SDPAToPagedAttention wires `token_type_ids` into PagedAttention only if
    the mask depends on it, and reads a sliding window only from a mask that matches its pattern for
    transformers' sliding masks: Greater(kv_idx, Add(q_idx, -window)) feeding a chain of four
    BitwiseAnd, then Broadcast, Select and Slice. The ops below are ordered to produce exactly that.
    """
    batch, num_rows = token_type_ids.shape
    kv_len = attention_mask.shape[1]
    past = kv_len - num_rows
    kv_idx = torch.arange(kv_len, device=attention_mask.device)[None, None, None, :]
    q_idx = (torch.arange(num_rows, device=attention_mask.device) + past)[None, None, :, None]

    is_block = token_type_ids == 1
    # Cached keys belong to committed context rows: the previous block is never in the committed past.
    key_is_block = torch.cat([torch.zeros_like(attention_mask[:, :past], dtype=torch.bool), is_block], dim=1)
    causal = kv_idx <= q_idx
    same_block = is_block[:, None, :, None] & key_is_block[:, None, None, :]
    visible = causal | same_block
    padding = attention_mask[:, None, None, :] != 0
    if sliding_window is None:
        allowed = visible & padding
    else:
        in_window = kv_idx > q_idx - sliding_window
        allowed = visible & in_window
        allowed = allowed & padding
        # Two no-op ANDs complete the four-AND chain the PagedAttention pattern expects.
        everywhere = torch.ones((), dtype=torch.bool, device=attention_mask.device)
        allowed = everywhere & allowed
        allowed = allowed & everywhere
    allowed = allowed.expand(batch, 1, num_rows, kv_len)
    mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask[:, :, :, :kv_len]


class DraftAttention(nn.Module):
    """Qwen3 attention (q/k norms, RoPE, GQA) over past ++ new keys, with an explicit mask; o_proj
    only on the rows `rows` selects (flat indices into the call's B * T rows)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past_key, past_value, rows):
        batch, num_rows, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, num_rows, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, num_rows, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, num_rows, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # The Concat of past and new keys must feed SDPA directly (or through the GQA
        # Unsqueeze-Broadcast-Reshape) for SDPAToPagedAttention to find the cache.
        keys = torch.cat([past_key, k], dim=2)
        values = torch.cat([past_value, v], dim=2)
        out = nn.functional.scaled_dot_product_attention(
            q, self._repeat_kv(keys), self._repeat_kv(values), attn_mask=mask, scale=self.head_dim**-0.5
        )
        out = out.transpose(1, 2).reshape(batch * num_rows, self.num_heads * self.head_dim)
        return self.o_proj(out.index_select(0, rows)), keys, values

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        n_rep = self.num_heads // self.num_kv_heads
        if n_rep == 1:
            return t
        batch, kv_heads, length, dim = t.shape
        return t.unsqueeze(2).expand(batch, kv_heads, n_rep, length, dim).reshape(batch, kv_heads * n_rep, length, dim)


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer: int):
        super().__init__()
        self.sliding_window = config.layer_window(layer)
        self.self_attn = DraftAttention(config)
        self.mlp = Qwen3MLP(config.hf_config())
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, ctx, is_block, rows, row_of, cos, sin, mask, past_key, past_value):
        """h: [num_block_rows, H], the residual stream of the block rows; returns it after the layer."""
        batch, num_rows, width = ctx.shape
        # Context rows take the (unnormalised per layer) target projection, block rows their own state.
        own = self.input_layernorm(_row_view(h, row_of)).view(batch, num_rows, width)
        x = torch.where(is_block, own, ctx)
        attn, keys, values = self.self_attn(x, cos, sin, mask, past_key, past_value, rows)
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, keys, values


def _row_view(h: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """[B * T, H]: for each row of the call, the block row at or before it (a zero row before the first).
    Exact on block rows; on context rows a placeholder that the caller's Select discards."""
    padded = torch.cat([torch.zeros_like(h[:1]), h], dim=0)
    return padded.index_select(0, row_of)


class DraftModel(nn.Module):
    """The draft backbone, per-row: [context; block] rows in, post-norm hidden states of block rows out."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config.hf_config())

    def empty_cache(self, batch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (key, value) of length 0: the past of a first call."""
        shape = (batch, self.config.num_key_value_heads, 0, self.config.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.layers]

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run one call: returns `last_hidden_state` [B, T, H] (zero on context rows) and the presents.

        `past_key_values` holds per layer (key, value) of shape [B, kv_heads, past, head_dim];
        `attention_mask` covers past + T keys.
        """
        if past_key_values is None:
            past_key_values = self.empty_cache(inputs_embeds.shape[0])
        batch, num_rows, width = inputs_embeds.shape
        ctx = self.hidden_norm(self.fc(hidden_states))
        is_block = (token_type_ids == 1)[..., None]
        flat_is_block = (token_type_ids == 1).reshape(-1)
        rows = torch.nonzero(flat_is_block).reshape(-1)  # the block rows, flat [num_block_rows]
        row_of = torch.cumsum(flat_is_block.to(torch.int64), dim=0)  # 1 + block rows before, per row
        cos, sin = self.rotary_emb(inputs_embeds, position_ids)
        masks = {
            window: build_row_mask(token_type_ids, attention_mask, window, inputs_embeds.dtype)
            for window in {layer.sliding_window for layer in self.layers}
        }
        h = inputs_embeds.reshape(batch * num_rows, width).index_select(0, rows)
        presents = []
        for layer, (past_key, past_value) in zip(self.layers, past_key_values):
            h, keys, values = layer(h, ctx, is_block, rows, row_of, cos, sin, masks[layer.sliding_window], past_key, past_value)
            presents.append((keys, values))
        out = _row_view(self.norm(h), row_of).view(batch, num_rows, width)
        out = torch.where(is_block, out, torch.zeros((), dtype=out.dtype))
        return out, presents


def draft_model_from_weights(config: DraftConfig, weights: dict[str, torch.Tensor]) -> DraftModel:
    """The per-row draft with the backbone weights of `weights` (as `load_draft_weights` returns them)."""
    model = DraftModel(config)
    backbone = {k: v for k, v in weights.items() if not k.startswith("markov_head.")}
    model.load_state_dict(backbone, strict=True)
    return model.eval()


def load_draft_model(path: str | Path, config: DraftConfig | None = None) -> DraftModel:
    """Build the per-row draft from the checkpoint folder `path` (float32, eval mode)."""
    config = config or load_draft_config(path)
    return draft_model_from_weights(config, load_draft_weights(path, config))
