"""The exported draft's contract (docs/draft-format.md) in code: file names, port names, rt_info.

Torch-free on purpose: the engine, `dflash validate` and the exporters all read these, and only the
exporters need torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.core.errors import ModelFormatError

DRAFT_MODEL_FILE = "openvino_model.xml"
MARKOV_HEAD_FILE = "openvino_markov_head_model.xml"
SUPPORTED_MARKOV_HEAD_TYPES = ("vanilla",)

# Input and output names of the Markov head's two parts, in the order the exported IR declares them.
DENSE_INPUTS = ("prev_token_ids",)
DENSE_OUTPUT = "markov_bias"
TOPK_INPUTS = ("prev_candidate_ids", "candidate_ids")
TOPK_OUTPUT = "edge_scores"


@dataclass(frozen=True)
class DraftMetadata:
    """The rt_info of an exported draft backbone, parsed."""

    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    draft_block_size: int  # rows per draft block, seed/anchor included (rt_info dflash/block_size)
    candidate_position_offset: int
    markov_rank: int
    markov_head_type: str | None
    per_row: bool  # the model has a `token_type_ids` input (the layout PagedAttention drafting needs)
    # The target token ids the draft may propose (rt_info dflash/draft_vocab, comma-separated): its logits
    # cover these only, in this order. None: the whole vocabulary.
    draft_vocab: tuple[int, ...] | None = None

    @property
    def max_candidates(self) -> int:
        """Candidates one block can yield: its rows after the offset."""
        return self.draft_block_size - self.candidate_position_offset


def read_rt_info(model, *path: str) -> str | None:
    """An rt_info value of an `ov.Model` as a string (keys nest: "dflash", "mask_token_id"); None if absent."""
    key = list(path)
    return str(model.get_rt_info(key).astype(str)) if model.has_rt_info(key) else None


def write_rt_info(model, value: str, *path: str) -> None:
    """Set an rt_info value (the contract stores every value as a string)."""
    model.set_rt_info(str(value), list(path))


def read_draft_metadata(model, *, require_per_row: bool = True) -> DraftMetadata:
    """Parse the DFlash rt_info of an `ov.Model` (read_model of `openvino_model.xml`).

    Raises ModelFormatError for a model that is not a DFlash draft, has malformed keys or, with
    `require_per_row`, was exported for the old stateful runner (no `token_type_ids` input).
    """
    def get(*path: str) -> str | None:
        return read_rt_info(model, *path)

    if get("dflash_mode") != "True":
        raise ModelFormatError(
            "the model is not a DFlash draft (no rt_info dflash_mode)",
            hint="export the draft with `dflash export`",
        )
    per_row = any("token_type_ids" in port.get_names() for port in model.inputs)
    if require_per_row and not per_row:
        raise ModelFormatError(
            "the draft was exported for the old stateful runner (no token_type_ids input)",
            hint="re-export it with `dflash export` to get the per-row layout",
        )
    try:
        mask_token_id = int(_required(get("dflash", "mask_token_id"), "mask_token_id"))
        layer_text = _required(get("dflash", "target_layer_ids"), "target_layer_ids")
        target_layer_ids = tuple(int(part) for part in layer_text.split(","))
        # "block_size" is the rt_info key the exporters write (named after z-lab's config.json field).
        draft_block_size = int(_required(get("dflash", "block_size"), "block_size"))
        offset = int(get("dflash", "candidate_position_offset") or 1)
        markov_rank = int(get("dflash", "markov_rank") or 0)
        vocab_text = get("dflash", "draft_vocab")
        draft_vocab = tuple(int(part) for part in vocab_text.split(",")) if vocab_text else None
    except ValueError as exc:
        raise ModelFormatError(
            f"malformed DFlash rt_info: {exc}", hint="re-export the draft with `dflash export`"
        ) from exc
    if offset not in (0, 1):
        raise ModelFormatError(
            f"rt_info dflash/candidate_position_offset is {offset}, expected 0 or 1",
            hint="re-export the draft with `dflash export`",
        )
    return DraftMetadata(
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids,
        draft_block_size=draft_block_size,
        candidate_position_offset=offset,
        markov_rank=markov_rank,
        markov_head_type=get("dflash", "markov_head_type") if markov_rank > 0 else None,
        per_row=per_row,
        draft_vocab=draft_vocab,
    )


def draft_vocab_problem(ids, vocab_size: int | None) -> str | None:
    """What is wrong with a draft vocabulary (rt_info dflash/draft_vocab), None if nothing: it must hold
    distinct ids of the target's vocabulary (of `vocab_size` tokens, when known)."""
    if len(ids) == 0 or len(set(ids)) != len(ids):
        return "the draft vocabulary (rt_info dflash/draft_vocab) is empty or repeats ids"
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        return f"the draft vocabulary holds ids outside the target's 0..{vocab_size}"
    return None


def _required(value: str | None, key: str) -> str:
    if value is None:
        raise ModelFormatError(
            f"the draft's rt_info lacks dflash/{key}", hint="re-export the draft with `dflash export`"
        )
    return value


def markov_head_part(model, part: str):
    """The sub-model of one part: `part="dense"` (prev_token_ids -> markov_bias) or `"topk"`
    (prev_candidate_ids, candidate_ids -> edge_scores), ready to compile on its own."""
    import openvino as ov

    if part == "dense":
        names, output = DENSE_INPUTS, DENSE_OUTPUT
    elif part == "topk":
        names, output = TOPK_INPUTS, TOPK_OUTPUT
    else:
        raise ValueError(f"part must be 'dense' or 'topk', got {part!r}")
    params = [model.input(name).get_node() for name in names]
    result = model.output(output).get_node()
    return ov.Model([result], params, f"markov_head_{part}")
