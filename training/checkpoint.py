"""Trained drafts saved in the formats `dflash export` reads (docs/draft-format.md, "Sources").

- kind "dflash": the z-lab layout. `config.json` is a Qwen3 config with `architectures`
  ["DFlashDraftModel"], a nested `dflash_config` {target_layer_ids, mask_token_id}, top-level
  `block_size` and `num_target_layers`; weights are unprefixed (`fc.weight`, `layers.0...`).
- kind "dspark": the DeepSpec layout. `config.json` is a copy of the target's config overridden with
  the draft backbone and top-level `mask_token_id`, `target_layer_ids`, `block_size`, `markov_rank`,
  `markov_head_type`; backbone weights carry a `model.` prefix, the Markov head sits beside it as
  `markov_head.markov_w1.weight` / `markov_w2.weight`.

Neither carries the target's embedding or lm_head (the exporter ignores them and the engine grafts
the target's own). How the mask token was chosen and what training did go to `training_info.json`,
which the exporter does not read.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash.exporters.draft_checkpoint import save_draft_checkpoint

TRAINING_INFO_FILE = "training_info.json"
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# Target config keys that must not leak into a DeepSpec-style copy: they describe the target's
# files, remote code or quantisation, not the draft.
_TARGET_ONLY_KEYS = (
    "architectures", "auto_map", "quantization_config", "_name_or_path", "torch_dtype", "dtype",
    "transformers_version", "model_type", "rope_scaling", "use_sliding_window", "max_window_layers",
)


def draft_backbone_fields(
    target_config: dict[str, Any],
    *,
    num_layers: int,
    block_size: int,
    intermediate_size: int | None = None,
) -> dict[str, Any]:
    """The Qwen3 backbone of a draft for `target_config` (a target's config.json dict).

    Hidden size, heads, head_dim, vocabulary, norm epsilon and RoPE follow the target, so the draft
    reads the target's embeddings and feeds its lm_head; every layer is full attention.
    """
    heads = int(target_config["num_attention_heads"])
    rope = target_config.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": float(target_config.get("rope_theta", 10000.0)),
    }
    return {
        "hidden_size": int(target_config["hidden_size"]),
        "intermediate_size": int(intermediate_size or target_config["intermediate_size"]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads") or heads),
        "head_dim": int(target_config.get("head_dim") or target_config["hidden_size"] // heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "attention_bias": False,
        "vocab_size": int(target_config["vocab_size"]),
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "rope_parameters": dict(rope),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "block_size": block_size,
        "num_target_layers": int(target_config["num_hidden_layers"]),
    }


def draft_config_dict(
    kind: str,
    target_config: dict[str, Any],
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    markov_rank: int = 0,
    intermediate_size: int | None = None,
    num_anchors: int | None = None,
    dtype: str = "float16",
) -> dict[str, Any]:
    """The draft's `config.json` in the z-lab ("dflash") or DeepSpec ("dspark") layout."""
    if kind not in ("dflash", "dspark"):
        raise ValueError(f"kind must be 'dflash' or 'dspark', got {kind!r}")
    if kind == "dflash" and markov_rank:
        raise ValueError("a z-lab DFlash draft has no Markov head; use kind='dspark' for markov_rank > 0")
    backbone = draft_backbone_fields(
        target_config, num_layers=num_layers, block_size=block_size, intermediate_size=intermediate_size
    )
    if kind == "dflash":
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **backbone,
            "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": int(mask_token_id)},
            "dtype": dtype,
        }
    config = {key: value for key, value in copy.deepcopy(target_config).items() if key not in _TARGET_ONLY_KEYS}
    config.update(backbone)
    config.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": list(target_layer_ids),
            "num_anchors": int(num_anchors or 512),
            "enable_confidence_head": False,
            "markov_rank": int(markov_rank),
            "dtype": dtype,
        }
    )
    if markov_rank > 0:
        config["markov_head_type"] = "vanilla"
    return config


def checkpoint_weights(state_dict: dict[str, torch.Tensor], kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`TrainableDraft.state_dict()` (names `model.*`, `markov_head.*`) renamed for the layout, cast to `dtype`."""
    weights = {}
    for name, tensor in state_dict.items():
        if kind == "dflash":
            name = name.removeprefix("model.")
        weights[name] = tensor.detach().to("cpu", dtype).contiguous()
    return weights


def save_trained_draft(
    path: str | Path,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    *,
    dtype: str = "float16",
    max_shard_mb: float | None = None,
    training_info: dict[str, Any] | None = None,
) -> Path:
    """Write a trained draft checkpoint: config.json, safetensors weights (sharded above `max_shard_mb`).

    `state_dict` is `TrainableDraft.state_dict()`; the layout (prefix, Markov head) follows the
    config's architecture. Returns `path`.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES)}, got {dtype!r}")
    kind = "dspark" if "Qwen3DSparkModel" in config.get("architectures", []) else "dflash"
    weights = checkpoint_weights(state_dict, kind, SAVE_DTYPES[dtype])
    num_shards = _num_shards(weights, max_shard_mb) if max_shard_mb else 1
    path = save_draft_checkpoint(path, dict(config, dtype=dtype), weights, num_shards=num_shards)
    if training_info is not None:
        (Path(path) / TRAINING_INFO_FILE).write_text(json.dumps(training_info, indent=2, default=str) + "\n")
    return Path(path)


def _num_shards(weights: dict[str, torch.Tensor], max_shard_mb: float) -> int:
    """The fewest shards whose largest stays under `max_shard_mb`, for save_draft_checkpoint's round-robin split."""
    sizes = [t.numel() * t.element_size() for t in weights.values()]
    limit = max_shard_mb * 2**20
    start = max(1, math.ceil(sum(sizes) / limit))
    for count in range(start, len(sizes) + 1):
        if max(sum(sizes[shard::count]) for shard in range(count)) <= limit:
            return count
    return len(sizes)  # one tensor per file: a single tensor over the limit cannot be split
