"""Hybrid linear-attention targets (Qwen3.5: GatedDeltaNet layers plus a full-attention layer every few).

What is special about exporting them, measured on openvino 2026.4.1 / optimum-intel 2.2.0
(docs/hybrid-targets.md has the commands and figures):

- optimum-intel 2.2.0 exports `qwen3_5_text` only under transformers 5.2.x: its export config caps the
  version at 5.2.99 (under 5.5.4 `main_export` raises "The current version of Transformers does not
  allow for the export of the model. Maximum required is 5.2.*"). The check here turns that into one
  line before anything is converted.
- Its Qwen3.5 patcher ignores the `position_ids` input: the rotary positions are
  `arange(past, past + seq_len)` with `past` taken from the KV state's length. `paged_attention_transformation`
  rewrites that length as `max_context_len - 1` (the graph's sequence axis is 1 after it), so every row
  of a packed call gets the last row's position: right for a one-token decode, wrong for prefill,
  chunks and speculative verification. `use_position_ids_for_rope` feeds the rotary embedding from
  `position_ids` instead; the stateful model then gives the same logits as before (the caller's
  position_ids are the arange), and the PagedAttention model gives transformers' logits for any packing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import openvino as ov

from dflash.core.errors import ExportError, ModelFormatError
from dflash.core.state_pool import ROPE_FROM_POSITION_IDS

# model_type -> the transformers versions optimum-intel 2.2.0 exports it under (its own caps).
_SUPPORTED_TRANSFORMERS = {"qwen3_5_text": ("5.2.", "5.2.x"), "qwen3_5": ("5.2.", "5.2.x")}
LINEAR_ATTENTION = "linear_attention"


def is_hybrid_config(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a model with linear-attention (recurrent) layers."""
    text_config = config.get("text_config") or config
    return LINEAR_ATTENTION in (text_config.get("layer_types") or []) or config.get("model_type") in (
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_next",
    )


def require_hybrid_export_support(config: dict[str, Any]) -> None:
    """Raise a one-line ModelFormatError when this environment cannot export the hybrid `config`."""
    import transformers

    model_type = str(config.get("model_type"))
    if model_type == "qwen3_5":
        raise ModelFormatError(
            "qwen3_5 checkpoints (Qwen3.5 as published, vision-language) are not supported yet; "
            "dflash exports qwen3_5_text configs",
            "exporting the language model of a qwen3_5 checkpoint as a target is still to do (issue 17)",
        )
    supported = _SUPPORTED_TRANSFORMERS.get(model_type)
    if supported is None:
        raise ModelFormatError(
            f"hybrid linear-attention targets of model_type {model_type!r} are not supported yet",
            "supported: qwen3_5_text (Qwen3.5 text models) under transformers 5.2.x",
        )
    prefix, spelled = supported
    if not transformers.__version__.startswith(prefix):
        raise ModelFormatError(
            f"optimum-intel 2.2.0 exports {model_type} only with transformers {spelled}, "
            f"this environment has {transformers.__version__}",
            f"pip install 'transformers=={spelled.replace('x', '0')}' (see docs/hybrid-targets.md)",
        )


def use_position_ids_for_rope(model: ov.Model) -> None:
    """Feed the rotary embedding of an optimum-intel Qwen3.5 export from its `position_ids` input.

    The export computes the positions as Broadcast(Reshape(Range(past, past + seq)), [3, batch, seq])
    (three identical M-RoPE sections for text). The Broadcast's data input becomes
    Unsqueeze(position_ids, 0), which broadcasts to the same [3, batch, seq]. Raises ExportError when
    the graph does not have exactly one such Broadcast.
    """
    import openvino.opset13 as ops

    position_ids = [p for p in model.get_parameters() if p.get_friendly_name() == "position_ids"]
    candidates = [op for op in model.get_ordered_ops() if _is_range_positions(op)]
    if len(position_ids) != 1 or len(candidates) != 1:
        raise ExportError(
            f"cannot rewire the rotary positions of this hybrid target (position_ids inputs: "
            f"{len(position_ids)}, position Broadcasts: {len(candidates)})",
            "this optimum-intel export layout is not supported; report it with the model id",
        )
    positions = ops.unsqueeze(position_ids[0], ops.constant(np.array([0], dtype=np.int64)))
    candidates[0].input(0).replace_source_output(positions.output(0))
    model.validate_nodes_and_infer_types()
    model.set_rt_info("True", ROPE_FROM_POSITION_IDS)


def _is_range_positions(op: ov.Node) -> bool:
    """Broadcast(Reshape(Range(...)), target) whose output has a leading axis of 3 (the M-RoPE sections)."""
    if op.get_type_name() != "Broadcast":
        return False
    reshape = op.input_value(0).get_node()
    if reshape.get_type_name() != "Reshape" or reshape.input_value(0).get_node().get_type_name() != "Range":
        return False
    shape = op.get_output_partial_shape(0)
    return shape.rank.is_static and shape.rank.get_length() == 3 and shape[0].is_static and shape[0].get_length() == 3
