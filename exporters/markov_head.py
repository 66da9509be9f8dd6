"""The DSpark vanilla Markov head: a low-rank bias on a row's logits from the token drafted before it.

With W1 [V, r] (embedding of the previous token) and W2 [V, r]:
- dense step:       markov_bias[n, v]        = <W1[prev_token_ids[n]], W2[v]>           -> [N, V]
- Top-K scorer:     edge_scores[r, p, k]     = <W1[prev_candidate_ids[r, p]], W2[candidate_ids[r, k]]>
                                                                                        -> [R, Kp, K]
Both parts live in one IR with independent inputs; the engine compiles each part on its own
(`markov_head_part`). The weights stay uncompressed: the bias is added to logits, where int4/int8
error would shift which candidate wins.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash.core.draft_format import (  # noqa: F401 - re-exported: the head's contract names
    DENSE_INPUTS,
    DENSE_OUTPUT,
    MARKOV_HEAD_FILE,
    TOPK_INPUTS,
    TOPK_OUTPUT,
    markov_head_part,
    write_rt_info,
)
from dflash.exporters.tracing import name_ports, trace_and_convert

# The walk an export asks for (rt_info markov_head/top_k): 0, the dense walk, which is exact; K > 0 a Top-K
# lattice over each row's K best tokens, which accepted 15% less with K 8 (the default DSpark draft on HumanEval,
# docs/benchmarks.md, twenty-first session).
DEFAULT_TOP_K = 0


class MarkovHead(nn.Module):
    """W1/W2 of a vanilla Markov head; `forward` computes both parts of the exported contract."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        if w1.shape != w2.shape or w1.dim() != 2:
            raise ValueError(f"W1 and W2 must both be [V, r], got {list(w1.shape)} and {list(w2.shape)}")
        self.w1 = nn.Parameter(w1.float(), requires_grad=False)
        self.w2 = nn.Parameter(w2.float(), requires_grad=False)

    @property
    def vocab_size(self) -> int:
        return self.w1.shape[0]

    @property
    def rank(self) -> int:
        return self.w1.shape[1]

    def markov_bias(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """[N] previous tokens -> [N, V] bias over the vocabulary."""
        return self.w1[prev_token_ids] @ self.w2.T

    def edge_scores(self, prev_candidate_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """[R, Kp] candidates of the row before and [R, K] candidates of each row -> [R, Kp, K] scores."""
        return self.w1[prev_candidate_ids] @ self.w2[candidate_ids].transpose(1, 2)

    def forward(self, prev_token_ids, prev_candidate_ids, candidate_ids):
        return self.markov_bias(prev_token_ids), self.edge_scores(prev_candidate_ids, candidate_ids)


def markov_head_from_weights(weights: dict[str, torch.Tensor]) -> MarkovHead:
    """The head of a loaded draft checkpoint (names as `load_draft_weights` returns them)."""
    return MarkovHead(weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"])


def convert_markov_head(head: MarkovHead, top_k: int = DEFAULT_TOP_K):
    """Convert `head` to an OpenVINO model with the contract's names and rt_info."""
    import openvino as ov

    example = (
        torch.tensor([0, 1], dtype=torch.int64),
        torch.zeros((2, 3), dtype=torch.int64),
        torch.zeros((2, 4), dtype=torch.int64),
    )
    inputs = [
        ([-1], ov.Type.i64),
        ([-1, -1], ov.Type.i64),
        ([-1, -1], ov.Type.i64),
    ]
    # Imported here: draft.py imports this module for the export.

    model = trace_and_convert(head, example, inputs)
    name_ports(model, [*DENSE_INPUTS, *TOPK_INPUTS], [DENSE_OUTPUT, TOPK_OUTPUT])
    write_rt_info(model, "vanilla", "markov_head", "type")
    write_rt_info(model, head.rank, "markov_head", "rank")
    write_rt_info(model, head.vocab_size, "markov_head", "vocab_size")
    write_rt_info(model, min(top_k, head.vocab_size), "markov_head", "top_k")
    return model


def save_markov_head(head: MarkovHead, output_dir: str | Path, top_k: int = DEFAULT_TOP_K) -> Path:
    """Write `openvino_markov_head_model.xml/.bin` into `output_dir`, weights kept in f32."""
    import openvino as ov

    path = Path(output_dir) / MARKOV_HEAD_FILE
    ov.save_model(convert_markov_head(head, top_k), path, compress_to_fp16=False)
    return path
