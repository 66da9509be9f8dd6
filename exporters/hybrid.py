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
- Qwen3.5 is published as a vision-language checkpoint (`qwen3_5`: `Qwen3_5ForConditionalGeneration`, a
  `text_config`, the language model's weights under `model.language_model.*`). `text_target_source`
  stages its language model as a `qwen3_5_text` checkpoint (a config.json made from `text_config`, the
  weight and tokenizer files linked, not copied): transformers 5.2's `Qwen3_5ForCausalLM` renames
  `model.language_model.*` to `model.*` itself and drops `model.visual.*` and `mtp.*`, so the export is
  exactly that of a `qwen3_5_text` checkpoint, minus the vision tower.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from dflash.core.errors import ExportError, InputError, ModelFormatError
from dflash.core.state_pool import ROPE_FROM_POSITION_IDS

# model_type -> the transformers versions optimum-intel 2.2.0 exports it under (its own caps).
_SUPPORTED_TRANSFORMERS = {"qwen3_5_text": ("5.2.", "5.2.x"), "qwen3_5": ("5.2.", "5.2.x")}
LINEAR_ATTENTION = "linear_attention"

# Vision-language model_type -> the model_type and architecture of its language model, exported as the target.
VLM_TEXT_TARGETS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM")}
# Files of a VLM checkpoint the text target does not take: its own config, the image/video processors' configs.
_VISION_ONLY_FILES = ("config.json", "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
# What a hub VLM checkpoint's language model needs: config, weights (and their index), tokenizer files.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


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
    supported = _SUPPORTED_TRANSFORMERS.get(model_type)
    if supported is None:
        raise ModelFormatError(
            f"hybrid linear-attention targets of model_type {model_type!r} are not supported yet",
            "supported: qwen3_5 and qwen3_5_text (Qwen3.5, its language model) under transformers 5.2.x",
        )
    prefix, spelled = supported
    if not transformers.__version__.startswith(prefix):
        raise ModelFormatError(
            f"optimum-intel 2.2.0 exports {model_type} only with transformers {spelled}, "
            f"this environment has {transformers.__version__}",
            f"pip install 'transformers=={spelled.replace('x', '0')}' (see docs/hybrid-targets.md)",
        )


def text_target_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a VLM checkpoint's language model as a causal LM of its own (`qwen3_5_text`).

    `text_config` as it is, plus the architecture, and what the VLM keeps at the top level: whether the
    embeddings are tied (the VLM ties them by its top-level `tie_word_embeddings`, default False,
    whatever `text_config` says), the dtype and the special token ids `text_config` lacks.
    """
    text_type, architecture = VLM_TEXT_TARGETS[str(config.get("model_type"))]
    text = dict(config.get("text_config") or {})
    if not text:
        raise ModelFormatError(
            f"this {config.get('model_type')} config.json has no text_config", "fix or re-download config.json"
        )
    text.update(model_type=text_type, architectures=[architecture])
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    for key in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"):
        if key in config and text.get(key) is None:
            text[key] = config[key]
    return text


@contextlib.contextmanager
def text_target_source(
    model: str | Path, config: dict[str, Any], note: Callable[[str], None] | None = None
) -> Iterator[tuple[str | Path, dict[str, Any]]]:
    """(checkpoint, config) to export as the target: `model` itself, or a VLM's language model staged.

    For a vision-language checkpoint (VLM_TEXT_TARGETS) a temporary folder holds the text config
    (`text_target_config`) and links to every other file but the processors' configs; it is removed
    on exit. Says in one line that the vision tower is left out: through `note` (the export's progress
    callback, which the CLI keeps while it silences other libraries), else on stderr.
    """
    if config.get("model_type") not in VLM_TEXT_TARGETS:
        yield model, config
        return
    text = text_target_config(config)
    source = _local_checkpoint(model)
    with tempfile.TemporaryDirectory(prefix="dflash-text-target-") as folder:
        staged = Path(folder)
        (staged / "config.json").write_text(json.dumps(text, indent=2) + "\n")
        for item in source.iterdir():
            if item.name not in _VISION_ONLY_FILES and not item.name.startswith("."):
                os.symlink(item.resolve(), staged / item.name)
        message = (f"note: {model} is a vision-language {config['model_type']} checkpoint: exporting its language "
                   f"model as a {text['model_type']} target; the vision tower is left out")
        if note is not None:
            note(message)
        else:
            print(message, file=sys.stderr)
        yield staged, text


def _local_checkpoint(model: str | Path) -> Path:
    """A local folder as it is; a hub id's snapshot of the files a text target needs."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - any hub failure means the same thing to the user
        first = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"cannot download {model} ({first})",
            "check the hub id and your network / HF_TOKEN, or pass a local folder",
        ) from exc


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
