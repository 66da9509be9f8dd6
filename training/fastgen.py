"""Fast batched decoding of the target for training data: a static KV cache, no per-step allocation.

`generate_responses` (data.py) decodes through transformers' forward with its growing cache and a
new attention mask every step; on a GPU a 135M model then runs at 1.5-3k tokens/s per process,
launch- and allocation-bound. This decoder reads the same modules' weights (embedding, each layer's
norms, q/k/v/o projections, optional q/k norms (Qwen3), MLP, final norm, lm_head) and runs them over
a cache allocated once for the whole batch: keys and values are written in place, attention is two
batched matmuls per layer over the filled part of the cache (grouped-query heads share their key/value
head without copies), and each step launches only the kernels of the layers themselves.

Left-padded prompts keep the positions they would have alone (positions count real tokens); pad keys
are masked. Greedy tokens equal `generate_responses`' up to floating-point ties (tested in f32 on tiny
targets); the training labels never depend on it anyway (the trainer recomputes the target's own
predictions teacher-forced). Families: decoder-only transformers whose layers hold `self_attn` with
q/k/v/o projections and `mlp` (Llama, SmolLM2, Qwen2/3, Mistral without a sliding window);
`supports_static_decoding` says whether a loaded target qualifies.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def _layers(model: Any):
    base = model.base_model
    return getattr(base, "layers", None)


def supports_static_decoding(model: Any) -> bool:
    """Whether `model` (a transformers causal LM) has the layout this decoder reads."""
    layers = _layers(model)
    base = model.base_model
    if layers is None or not all(hasattr(base, name) for name in ("embed_tokens", "norm", "rotary_emb")):
        return False
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and \
            getattr(config, "model_type", "") == "mistral":
        return False
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return False
    return True


class StaticCacheDecoder:
    """Prefill + decode of one batch of left-padded prompts over a preallocated KV cache."""

    def __init__(self, model: Any, batch_size: int, max_len: int):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        self.model = model
        self.base = model.base_model
        self.layers = list(_layers(model))
        self.lm_head = model.get_output_embeddings()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.groups = self.heads // self.kv_heads
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        weight = self.lm_head.weight
        shape = (len(self.layers), batch_size, self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.batch_size, self.max_len = batch_size, max_len

    def _attention(self, q: torch.Tensor, start: int, mask: torch.Tensor, layer: int) -> torch.Tensor:
        """q [B, H, T, D] against cache[:start + T]; mask [B, T, L] bool (True: attend) -> [B, T, H*D]."""
        b, _, t, d = q.shape
        keys = self.keys[layer, :b, :, : start + t]  # [B, KV, L, D]
        values = self.values[layer, :b, :, : start + t]
        q = q.reshape(b, self.kv_heads, self.groups * t, d)  # heads h = kv * groups + g share key/value kv
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [B, KV, G*T, L]
        scores = scores.view(b, self.kv_heads, self.groups, t, -1)
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = scores.softmax(-1).to(values.dtype).view(b, self.kv_heads, self.groups * t, -1)
        out = torch.matmul(probs, values).view(b, self.heads, t, d)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(b, t, self.heads * d)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """ids/positions [B, T] written at cache slots start..start+T-1; mask [B, T, start+T]; -> last logits [B, V]."""
        b, t = ids.shape
        x = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(x, positions)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, t, -1, self.head_dim)
            k = attn.k_proj(h).view(b, t, -1, self.head_dim)
            v = attn.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            self.keys[index, :b, :, start : start + t] = k
            self.values[index, :b, :, start : start + t] = v
            x = x + attn.o_proj(self._attention(q, start, mask, index))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.base.norm(x[:, -1]))


def _sample(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        values, ids = logits.topk(top_k, dim=-1)
        choice = torch.multinomial(values.softmax(-1), 1, generator=generator)
        return ids.gather(-1, choice).squeeze(-1)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def static_generate(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    pad_id: int,
    stop_ids: Sequence[int],
    temperature: float = 0.0,
    top_k: int = 0,
    ignore_eos: bool = False,
    generator: torch.Generator | None = None,
    check_every: int = 16,
    prefill_rows: int = 256,
    decoder: StaticCacheDecoder | None = None,
) -> list[tuple[list[int], bool]]:
    """(response, finished) per prompt, as `data.generate_responses` returns them, decoded over a static cache.

    A response is cut after its first stop token (kept) unless `ignore_eos`. `top_k` > 0 samples among
    the k likeliest tokens only. The prefill runs `prefill_rows` prompts at a time (its attention
    scores are [rows, heads, T, T]). `decoder`: reuse one allocated for at least this batch and length.
    """
    device = model.get_output_embeddings().weight.device
    n = len(prompt_ids)
    width = max(len(ids) for ids in prompt_ids)
    total = width + max_new_tokens
    if decoder is None or decoder.batch_size < n or decoder.max_len < total:
        decoder = StaticCacheDecoder(model, n, total)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    valid = torch.zeros((n, total), dtype=torch.bool)
    for row, prompt in enumerate(prompt_ids):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, width - len(prompt): width] = True
    ids, valid = ids.to(device), valid.to(device)
    positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)  # a pad row attends to itself: no empty softmax

    logits = []
    for first in range(0, n, prefill_rows):
        rows = slice(first, min(n, first + prefill_rows))
        mask = (causal[None] & valid[rows, None, :width]) | eye[None]
        sub = _SubBatch(decoder, first)
        logits.append(sub.forward(ids[rows], positions[rows], 0, mask))
    logits = torch.cat(logits)
    position = positions[:, -1:] + 1
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    tokens = []
    for step in range(max_new_tokens):
        token = _sample(logits, temperature, top_k, generator).masked_fill(finished, pad_id)
        tokens.append(token)
        if not ignore_eos:
            finished |= torch.isin(token, stops)
        if step == max_new_tokens - 1 or ((step + 1) % check_every == 0 and bool(finished.all())):
            break
        valid[:, width + step] = True
        logits = decoder.forward(token[:, None], position, width + step, valid[:, None, : width + step + 1])
        position = position + 1
    return cut_at_stops(tokens, stops, ignore_eos)


def cut_at_stops(tokens: list[torch.Tensor], stops: torch.Tensor, ignore_eos: bool) -> list[tuple[list[int], bool]]:
    """(response ids, whether a stop token came) per row of the generated columns `tokens`: each row
    cut after its first stop token, or kept whole with ignore_eos."""
    stop_set = set(stops.tolist())
    responses = []
    for row in torch.stack(tokens, dim=1).tolist():
        end = next((i for i, token in enumerate(row) if token in stop_set), None)
        if ignore_eos:
            responses.append((row, end is not None))
        else:
            responses.append((row if end is None else row[: end + 1], end is not None))
    return responses


class _SubBatch:
    """The decoder's cache rows first.. as a decoder of their own (the prefill in slices of rows)."""

    def __init__(self, decoder: StaticCacheDecoder, first: int):
        self.decoder, self.first = decoder, first

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        keys, values = d.keys, d.values
        rows = ids.shape[0]
        d.keys, d.values = keys[:, self.first : self.first + rows], values[:, self.first : self.first + rows]
        try:
            return d.forward(ids, positions, start, mask)
        finally:
            d.keys, d.values = keys, values
