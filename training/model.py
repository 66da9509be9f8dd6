"""The draft as it trains: many blocks in one forward, through the SAME modules the export traces.

`DraftModel` (exporters/draft_model.py) runs one call's rows [context; block] for inference. Training
wants K blocks per sequence at once, each block seeing only the context before its anchor. Rather than
a second model, `blocks_forward` drives DraftModel's own submodules (fc, hidden_norm, layers' norms,
projections, q/k norms, MLP, norm, rotary embedding) with a block-structured mask:

- the context rows are every position t of the sequence, x = hidden_norm(fc(target features)), as keys
  and values only (the original DFlash forward: context rows are never queries);
- block i's rows sit at positions a_i .. a_i+B-1 and see context key t only when t < a_i (the context
  the target had processed when it produced the anchor), and every row of their own block.

The attention is computed in two parts that share one softmax: [rows x context] under that mask and
[rows x own block] with no mask, instead of one [K*B x (T + K*B)] mask whose cross-block part is
all masked out. tests/test_train.py checks that one block equals DraftModel's per-row forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from dflash.exporters.draft_config import DraftConfig
from dflash.exporters.draft_model import DraftModel


class MarkovBias(nn.Module):
    """The vanilla Markov head as DeepSpec stores it: bias(prev) = W2 · W1[prev].

    `markov_w1` is an Embedding (weight [V, r]) and `markov_w2` a Linear r -> V without bias (weight
    [V, r]), so the state dict names are exactly the checkpoint's `markov_w1.weight`/`markov_w2.weight`.
    """

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_token_ids))


class TrainableDraft(nn.Module):
    """The draft backbone (`model`, a DraftModel) plus, for DSpark, its Markov head (`markov_head`).

    The attribute names make `state_dict()` the DeepSpec layout: `model.fc.weight`, ...,
    `markov_head.markov_w1.weight`.
    """

    def __init__(self, config: DraftConfig, init_std: float = 0.02):
        super().__init__()
        self.config = config
        self.model = DraftModel(config)
        self.markov_head = MarkovBias(config.vocab_size, config.markov_rank) if config.markov_rank > 0 else None
        self.reset_parameters(init_std)

    def reset_parameters(self, init_std: float) -> None:
        """Projections ~ N(0, init_std²), norms 1; the Markov head starts as a zero bias (W2 = 0)."""
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for name, param in self.model.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
        if self.markov_head is not None:
            nn.init.normal_(self.markov_head.markov_w1.weight, std=init_std)
            nn.init.zeros_(self.markov_head.markov_w2.weight)

    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        return blocks_forward(self.model, features, block_embeds, anchors)


def blocks_forward(
    model: DraftModel, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Post-norm hidden states [N, K, B, H] of K blocks per sequence.

    features      [N, T, k*H]  target hidden states at target_layer_ids of every position
    block_embeds  [N, K, B, H] target embeddings of each block's [anchor, mask, ..., mask]
    anchors       [N, K]       the anchor's position a (block row j sits at position a + j)
    """
    n, k, b, h = block_embeds.shape
    t = features.shape[1]
    device = features.device
    ctx = model.hidden_norm(model.fc(features))
    ctx_positions = torch.arange(t, device=device).expand(n, t)
    block_positions = (anchors[..., None] + torch.arange(b, device=device)).reshape(n, k * b)
    ctx_cos, ctx_sin = model.rotary_emb(ctx, ctx_positions)
    blk_cos, blk_sin = model.rotary_emb(block_embeds, block_positions)
    masks = {
        window: context_mask(anchors, t, b, window) for window in {layer.sliding_window for layer in model.layers}
    }

    hidden = block_embeds.reshape(n, k * b, h)
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(n, k * b, attn.num_heads, attn.head_dim)).transpose(1, 2)
        kb = attn.k_norm(attn.k_proj(x).view(n, k * b, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
        vb = attn.v_proj(x).view(n, k * b, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, kb = apply_rotary_pos_emb(q, kb, blk_cos, blk_sin)
        # Context keys/values come from the (not per-layer normalised) projection of the target features.
        kc = attn.k_norm(attn.k_proj(ctx).view(n, t, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
        vc = attn.v_proj(ctx).view(n, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        _, kc = apply_rotary_pos_emb(kc, kc, ctx_cos, ctx_sin)
        out = block_attention(q, kc, vc, kb, vb, masks[layer.sliding_window], k, b)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.norm(hidden).view(n, k, b, h)


def context_mask(anchors: torch.Tensor, num_ctx: int, block_size: int, window: int | None) -> torch.Tensor:
    """Which context key each block row sees: [N, K, B or 1, T] booleans.

    Key t is visible to row j of the block anchored at a when t < a, and on a sliding layer also when
    t > a + j - window (the same window rule as the per-row mask). Own-block keys are always visible.
    """
    t = torch.arange(num_ctx, device=anchors.device)
    visible = t[None, None, None, :] < anchors[..., None, None]  # [N, K, 1, T]
    if window is None:
        return visible
    rows = anchors[..., None] + torch.arange(block_size, device=anchors.device)  # [N, K, B]
    return visible & (t[None, None, None, :] > rows[..., None] - window)


def block_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    ctx_mask: torch.Tensor,
    num_blocks: int,
    block_size: int,
) -> torch.Tensor:
    """Softmax attention of block rows over [visible context keys ; own block keys]: [N, K*B, heads*d].

    q [N, heads, K*B, d]; kc/vc [N, kv_heads, T, d]; kb/vb [N, kv_heads, K*B, d]. Grouped-query heads
    are handled by viewing query head g*rep + r under kv head g (the per-row model's repeat order).
    """
    n, heads, _, d = q.shape
    kv_heads, t = kc.shape[1], kc.shape[2]
    rep = heads // kv_heads
    q = q.reshape(n, kv_heads, rep, num_blocks, block_size, d)
    kb = kb.reshape(n, kv_heads, num_blocks, block_size, d)
    vb = vb.reshape(n, kv_heads, num_blocks, block_size, d)
    scale = 1.0 / math.sqrt(d)
    scores_ctx = torch.einsum("ngrkbd,ngtd->ngrkbt", q, kc) * scale
    scores_ctx = scores_ctx.masked_fill(~ctx_mask[:, None, None], float("-inf"))
    scores_blk = torch.einsum("ngrkbd,ngkcd->ngrkbc", q, kb) * scale
    # One softmax over both parts, in float32; a row always sees its own block, so never all -inf.
    probs = torch.cat([scores_ctx, scores_blk], dim=-1).float().softmax(dim=-1).to(q.dtype)
    out = torch.einsum("ngrkbt,ngtd->ngrkbd", probs[..., :t], vc)
    out = out + torch.einsum("ngrkbc,ngkcd->ngrkbd", probs[..., t:], vb)
    # [N, g, r, K, B, d] -> [N, K*B, heads*d] with head index g*rep + r.
    return out.permute(0, 3, 4, 1, 2, 5).reshape(n, num_blocks * block_size, heads * d)
