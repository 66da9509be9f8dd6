"""Tiny checkpoints whose greedy choices are known in advance: for tests and benchmarks of acceptance.

Built from the tiny random checkpoints of `exporters/tiny.py` and `exporters/draft_checkpoint.py`, with
weights edited before export:

* the "chain" target: every layer's o_proj/down_proj (and a hybrid target's linear_attn.out_proj) is zero, so the final hidden state is the token's
  own embedding and the lm_head alone picks the next token: a fixed successor `succ(x)` on a long cycle
  of ordinary tokens, and the constant token A after A and after the mask token;
* "zero" drafts (`scale_residual_writes(w, 0.0)`): block row r outputs the normed embedding of its own
  token, so a DSpark-layout draft (candidate offset 0) proposes [succ(seed), A, A, ...] and a DFlash
  draft (offset 1) proposes [A, A, ...]. On the chain target a DFlash zero draft has every candidate
  accepted once a sequence is in A, and none on the cycle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .draft_checkpoint import make_tiny_draft
from .tiny import make_tiny_target

MASK = 3  # the tiny tokenizer's <|mask|>
A = 300  # the chain target's constant token


def edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply `edit` to a checkpoint folder's model.safetensors in place."""
    file = folder / "model.safetensors"
    weights = load_file(file)
    edit(weights)
    save_file({name: t.contiguous() for name, t in weights.items()}, file, metadata={"format": "pt"})


def scale_residual_writes(weights: dict[str, torch.Tensor], factor: float) -> None:
    """Scale what every layer adds to the residual stream (attention, linear attention and MLP output
    projections)."""
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight", "linear_attn.out_proj.weight")):
            weights[name] = weights[name] * factor


def unit_final_norm(weights: dict[str, torch.Tensor]) -> None:
    """Final norms of ones: the target's and the draft's heads then see the same normed embedding."""
    for name in ("norm.weight", "model.norm.weight", "model.language_model.norm.weight"):
        if name in weights:
            weights[name] = torch.ones_like(weights[name])


def chain_successors(vocab_size: int, seed: int) -> dict[int, int]:
    """succ: one random cycle over the ordinary tokens and EOS; A and the mask to A; 0 and 1 fixed."""
    ordinary = [t for t in range(vocab_size) if t not in (0, 1, MASK, A)]
    order = [ordinary[i] for i in torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(seed))]
    succ = {x: y for x, y in zip(order, order[1:] + order[:1])}
    succ.update({0: 0, 1: 1, MASK: A, A: A})
    return succ


def make_chain(weights: dict[str, torch.Tensor], succ: dict[int, int]) -> None:
    """Embeddings and lm_head such that argmax(lm_head @ norm(embed[x])) == succ[x] with a wide margin.

    Ordinary and fixed tokens get unit embeddings orthogonal to a direction c, A and the mask point
    along c; lm_head[succ[x]] = embed[x] (the cosine of x with itself is 1, with any other < 1) and
    lm_head[A] = c.
    """
    scale_residual_writes(weights, 0.0)
    unit_final_norm(weights)
    embed_name = next(n for n in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight") if n in weights)
    embed = weights[embed_name]
    vocab, hidden = embed.shape
    g = torch.Generator().manual_seed(7)
    c = torch.randn(hidden, generator=g)
    c /= c.norm()
    rows = torch.randn(vocab, hidden, generator=g)
    rows -= (rows @ c)[:, None] * c
    rows /= rows.norm(dim=1, keepdim=True)
    head = torch.zeros(vocab, hidden)
    for x, y in succ.items():
        if y != A:
            head[y] = rows[x]
    head[A] = c
    for x in (A, MASK):
        rows[x] = 3.0 * c + 0.1 * rows[x]
    weights[embed_name] = rows * 0.5
    weights["lm_head.weight"] = head


def make_chain_target(folder: Path, seed: int = 5, succ_seed: int = 1, family: str = "qwen3",
                      **config_overrides) -> tuple[Path, dict[int, int]]:  # fmt: skip
    """The chain target's Hugging Face folder and its successor map (`family` "qwen3_5_text": a hybrid
    chain target, its GatedDeltaNet layers silenced as well; Qwen3.5's final norm scales by 1 + weight,
    a uniform 2 that leaves every argmax alone). `config_overrides` (hidden_size, num_hidden_layers, ...)
    make it larger: its silenced layers still cost their compute, so its steps cost what a real target's do."""
    target = make_tiny_target(folder, family, seed=seed, **config_overrides)
    succ = chain_successors(json.loads((target / "config.json").read_text())["vocab_size"], seed=succ_seed)
    edit_weights(target, lambda w: make_chain(w, succ))
    return target, succ


def make_scaled_draft(folder: Path, target_hf: Path, kind: str, factor: float, *, draft_block_size: int = 4,
                      num_layers: int = 2, seed: int = 11) -> Path:  # fmt: skip
    """A tiny draft (no Markov head) whose layers write `factor` of their output into the residual
    stream (0: a "zero" draft), with unit final norm."""
    hf = make_tiny_draft(folder, target_hf, kind=kind, draft_block_size=draft_block_size, num_layers=num_layers,
                         markov_rank=0, seed=seed)  # fmt: skip
    edit_weights(hf, lambda w: (scale_residual_writes(w, factor), unit_final_norm(w)))
    return hf


def chain_prompts(succ: dict[int, int], specials: tuple[int, ...] = (0, 1, 2, MASK)) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts ending on an ordinary token (the cycle) and prompts ending on A (the constant)."""
    import numpy as np

    ordinary = [t for t in succ if t not in specials and t != A]
    rng = np.random.default_rng(0)
    cycle = [[int(t) for t in rng.choice(ordinary, size=n)] for n in (5, 17, 40, 70)]
    constant = [[int(t) for t in rng.choice(ordinary, size=n)] + [A] for n in (3, 33, 64)]
    return cycle, constant


def chain_of(succ: dict[int, int], last: int, n: int) -> list[int]:
    """The chain target's n greedy tokens after `last`."""
    out = []
    for _ in range(n):
        last = succ[last]
        out.append(last)
    return out
