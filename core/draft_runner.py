"""The DFlash/DSpark draft on PagedAttention: the second model of a speculative engine.

At load the target's embedding and lm_head weights are grafted onto the draft, the draft is converted
to PagedAttention (its masks use `token_type_ids`, so every PagedAttention op rebuilds the DFlash
mask: causal context rows, a bidirectional block), and a Gather before the grafted lm_head keeps
logits to the candidate rows. Each step runs one packed inference over every request's window:

    [ new committed target hidden rows (type 0) ; seed/anchor + mask rows (type 1) ]

and, after the windows, padding rows that bring the call to a multiple of `ROW_BUCKET` rows: a context
sequence of its own that writes into scratch blocks no request holds. The windows' rows change with
every step's acceptance, and OpenVINO's CPU plugin prepares every node again when an input's shape
differs from the previous call's (about a millisecond of a 3-layer draft's 3-6 ms step); padding
context rows cost less than that (they only write keys and values).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from dflash.core.draft_format import draft_vocab_problem, read_draft_metadata

from .errors import ModelFormatError
from .graph import graft_embedding, graft_lm_head, insert_logits_gather, logits_output
from .model_runner import BINDINGS_LOCK, PagedModel, read_ov_model
from .paged import SequenceSlice, to_paged_attention

CONTEXT_ROW = 0
BLOCK_ROW = 1
# A draft call's rows are padded up to a multiple of this (`DraftRunner.padding`): steady shapes.
ROW_BUCKET = 16


@dataclass
class DraftInputs:
    """One packed draft inference."""

    seqs: list[SequenceSlice]
    token_ids: np.ndarray  # [num_tokens] i64: mask ids on context rows (unused), seed + masks on block rows
    token_type_ids: np.ndarray  # [num_tokens] i64: 0 context row, 1 block row
    hidden_states: np.ndarray  # [num_tokens, k * H_target] f32: zeros on block rows (unused)
    candidate_rows: np.ndarray  # [num_candidates] i64


class DraftRunner(PagedModel):
    """The draft with the target's embedding and lm_head grafted on: logits of the candidate rows."""

    def __init__(
        self,
        draft: ov.Model | str | Path,
        target_dir: str | Path,
        *,
        device: str = "CPU",
        ov_config: dict[str, str] | None = None,
    ):
        with BINDINGS_LOCK:  # one thread in OpenVINO's bindings at a time (model_runner.BINDINGS_LOCK)
            model = draft if isinstance(draft, ov.Model) else read_ov_model(draft)
            self.spec = read_draft_metadata(model)  # the draft's contract: mask token, layers, block, offset
            target = read_ov_model(target_dir)  # a throwaway copy: its weight subgraphs move to the draft
            _check_widths(model, target)
            self.vocab_size = _vocab_size(target)
            self.vocab_ids = _draft_vocab(self.spec.draft_vocab, self.vocab_size)
            graft_embedding(model, target)
            graft_lm_head(model, target, self.vocab_ids)
            del target
            to_paged_attention(model)
            insert_logits_gather(model)
        super().__init__(model, device=device, ov_config=ov_config)
        # 1: no padding; never more than at allocate_cache, whose scratch blocks hold row_bucket - 1 rows
        self.row_bucket = ROW_BUCKET
        self.scratch_blocks: list[int] = []  # allocate_cache

    def allocate_cache(self, num_blocks: int) -> None:
        """`num_blocks` blocks for the requests, and after them the scratch blocks the padding rows write
        into (`padding`): never in a request's block table, since the pool hands out only the first
        `num_blocks`."""
        num_scratch = -(-(self.row_bucket - 1) // self.kv_block_size)
        super().allocate_cache(num_blocks + num_scratch)
        self.num_blocks = num_blocks
        self.scratch_blocks = list(range(num_blocks, num_blocks + num_scratch))

    def padded_rows(self, num_rows: int) -> int:
        """The rows of a call of `num_rows` rows as OpenVINO runs it (`padding` included): its shape."""
        return num_rows + -num_rows % self.row_bucket

    def padding(self, num_rows: int) -> SequenceSlice | None:
        """The padding sequence that brings a call of `num_rows` rows to a multiple of `row_bucket`
        (None where it is one already): context rows at positions 0.. of the scratch blocks."""
        pad = self.padded_rows(num_rows) - num_rows
        return SequenceSlice(0, pad, self.scratch_blocks) if pad else None

    @functools.cached_property
    def hidden_states_width(self) -> int:
        """k * H_target: the width of the target hidden rows the draft reads (a port lookup: read once)."""
        return self.compiled.input("hidden_states").get_partial_shape()[-1].get_length()

    def run(self, step: DraftInputs) -> np.ndarray:
        """Logits of the candidate rows over the draft's vocabulary (`vocab_ids`, or the whole target
        vocabulary when that is None). # [num_candidates, len(vocab_ids) or vocab_size] f32"""
        rows = {"input_ids": step.token_ids, "token_type_ids": step.token_type_ids, "hidden_states": step.hidden_states}
        self._infer(step.seqs, rows, step.candidate_rows)
        return self._output("logits")

    def token_ids(self, logits: np.ndarray) -> np.ndarray:
        """Each row's argmax as a target token id. # [rows] i64"""
        best = logits.argmax(axis=-1)
        return best if self.vocab_ids is None else self.vocab_ids[best]

    def full_logits(self, logits: np.ndarray) -> np.ndarray:
        """Logits over the target's whole vocabulary: -inf for the tokens the draft never proposes, so
        its distributions (sampling, the Markov head) put no mass there. # [rows, vocab_size] f32"""
        if self.vocab_ids is None:
            return logits
        full = np.full((len(logits), self.vocab_size), -np.inf, dtype=np.float32)
        full[:, self.vocab_ids] = logits
        return full


def _vocab_size(target: ov.Model) -> int | None:
    width = logits_output(target).get_partial_shape()[-1]
    return width.get_length() if width.is_static else None


def _draft_vocab(ids: tuple[int, ...] | None, vocab_size: int | None) -> np.ndarray | None:
    """The draft's vocabulary as an index array, checked against the target's."""
    if ids is None:
        return None
    problem = draft_vocab_problem(ids, vocab_size)
    if problem is not None:
        raise ModelFormatError(problem, "re-export the draft with `dflash export` for this target")
    return np.asarray(ids, dtype=np.int64)


def _check_widths(draft: ov.Model, target: ov.Model) -> None:
    embeds = next(p for p in draft.inputs if "inputs_embeds" in p.get_names())
    width = embeds.get_partial_shape()[-1]
    target_logits_in = None
    try:
        from .graph import find_lm_head

        matmul, port = find_lm_head(target)
        target_logits_in = matmul.input_value(port).get_partial_shape()[-1]
    except ModelFormatError:
        return
    if width.is_static and target_logits_in.is_static and width.get_length() != target_logits_in.get_length():
        raise ModelFormatError(
            f"the draft's hidden size {width.get_length()} differs from the target's {target_logits_in.get_length()}",
            "use a draft trained for this target (`dflash validate DRAFT --target TARGET` shows every mismatch)",
        )
