"""The configuration of a DFlash or DSpark draft, read from its Hugging Face `config.json`.

Two source layouts exist (see docs/draft-format.md):
- z-lab DFlash: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`, a nested `dflash_config`
  holding `target_layer_ids` and `mask_token_id`, and a top-level `block_size`.
- DeepSpec DSpark: `architectures: ["Qwen3DSparkModel"]`, a copy of the target's config with top-level
  `mask_token_id`, `target_layer_ids`, `block_size`, `markov_rank` and `markov_head_type`.

Both describe the same Qwen3-style backbone, so one `DraftConfig` covers them; `kind` records which
layout it came from, and `candidate_position_offset` the one behavioural difference the runtime needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.core.errors import InputError, ModelFormatError

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
LAYER_TYPES = ("full_attention", "sliding_attention")
MARKOV_HEAD_TYPES = ("vanilla",)

_DRAFT_HINT = (
    "pass a draft checkpoint: a z-lab DFlash draft (architectures DFlashDraftModel) or a DeepSpec DSpark "
    "draft (architectures Qwen3DSparkModel)"
)


@dataclass(frozen=True)
class DraftConfig:
    """Everything the exporter and the engine need to know about a draft, resolved once."""

    kind: str  # "dflash" (z-lab layout) or "dspark" (DeepSpec layout)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None  # set when some layer is "sliding_attention"
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    draft_block_size: int  # rows per draft block, seed/anchor included (config.json `block_size`)
    candidate_position_offset: int  # 1: row 0 is the seed (z-lab); 0: the anchor row predicts (DSpark)
    markov_rank: int  # 0 = no Markov head
    markov_head_type: str | None  # "vanilla" when markov_rank > 0
    vocab_size: int
    num_target_layers: int | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def block_size(self) -> int:
        """Deprecated alias of `draft_block_size` (training/ still reads this name)."""
        return self.draft_block_size

    @property
    def num_target_features(self) -> int:
        """k: how many target layers feed the draft (the `fc` input is k times the hidden size)."""
        return len(self.target_layer_ids)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def hf_config(self):
        """A transformers `Qwen3Config` of the backbone, for library pieces such as the rotary embedding."""
        from transformers import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            rope_parameters=dict(self.rope_parameters),
            layer_types=list(self.layer_types),
        )


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's fallback when a DFlash config names no target layers: evenly spaced from 1 to N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def load_draft_config(path: str | Path) -> DraftConfig:
    """Read `config.json` of a draft folder (or the file itself) into a `DraftConfig`.

    Raises ModelFormatError when the config is not a DFlash/DSpark draft or lacks a required field.
    """
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise InputError(f"no config.json in {path}", hint="pass a local draft folder or a hub id of a draft")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(
            f"cannot read {config_file}: {exc}", hint="the draft's config.json must be valid JSON"
        ) from exc
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{config_file} is not a JSON object", hint=_DRAFT_HINT)
    return parse_draft_config(raw, source=str(config_file))


def parse_draft_config(raw: dict[str, Any], source: str = "config.json") -> DraftConfig:
    """Resolve a draft config dict (either layout) into a `DraftConfig`."""
    kind = _detect_kind(raw, source)
    # DFlash keeps its draft fields in `dflash_config`, DSpark at the top level; each falls back to the
    # other place, since third-party configs mix them.
    nested = raw.get("dflash_config") or {}
    places = (nested, raw) if kind == "dflash" else (raw, nested)

    def draft_field(name: str) -> Any:
        for place in places:
            if place.get(name) is not None:
                return place[name]
        return None

    _check_supported(raw, nested, source)

    hf = _qwen3_config(raw)
    num_layers = hf.num_hidden_layers
    num_target_layers = draft_field("num_target_layers")
    target_layer_ids = _target_layer_ids(draft_field("target_layer_ids"), num_target_layers, num_layers, source)
    mask_token_id = _required_int(draft_field("mask_token_id"), "mask_token_id", source)
    # `block_size` is the source config.json's own key (z-lab and DeepSpec): kept as it is.
    draft_block_size = _required_int(draft_field("block_size"), "block_size", source)
    offset = _candidate_position_offset(kind, draft_field, source)
    if draft_block_size < 1 + offset:
        raise ModelFormatError(
            f"{source}: block_size {draft_block_size} leaves no candidate row (candidate_position_offset {offset})",
            hint="block_size counts the seed/anchor row; it must be at least 2 for a DFlash draft",
        )
    markov_rank, markov_head_type = _markov_head(draft_field, source)
    layer_types, sliding_window = _layer_types(raw, num_layers, source)

    return DraftConfig(
        kind=kind,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        hidden_act=hf.hidden_act,
        attention_bias=bool(hf.attention_bias),
        rope_parameters=dict(hf.rope_parameters),
        max_position_embeddings=hf.max_position_embeddings,
        layer_types=layer_types,
        sliding_window=sliding_window,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        draft_block_size=draft_block_size,
        candidate_position_offset=offset,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        vocab_size=hf.vocab_size,
        num_target_layers=num_target_layers,
        raw=raw,
    )


def _check_supported(raw: dict[str, Any], nested: dict[str, Any], source: str) -> None:
    """Refuse a DFlash2 draft and a config without the backbone's sizes."""
    if nested.get("selector_rank") is not None or nested.get("conv_kernel_size") is not None:
        raise ModelFormatError(
            f"{source} is a DFlash2 draft (pair selector, in-block convolutions), which is not supported",
            hint="use a DFlash (z-lab) or DSpark (DeepSpec) draft",
        )
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(raw.get(name), int):
            raise ModelFormatError(
                f"{source} lacks the backbone field {name!r}", hint="the draft's config.json is incomplete"
            )


def _markov_head(draft_field: Callable[[str], Any], source: str) -> tuple[int, str | None]:
    """The Markov head's rank (0: none) and type ("vanilla", the only one supported)."""
    markov_rank = int(draft_field("markov_rank") or 0)
    markov_head_type = draft_field("markov_head_type") if markov_rank > 0 else None
    if markov_rank > 0:
        markov_head_type = markov_head_type or "vanilla"
        if markov_head_type not in MARKOV_HEAD_TYPES:
            raise ModelFormatError(
                f"{source}: Markov head type {markov_head_type!r} is not supported",
                hint="only the vanilla Markov head (markov_head_type 'vanilla') can be exported",
            )
    return markov_rank, markov_head_type


def _detect_kind(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    if any(arch in DSPARK_ARCHITECTURES for arch in architectures):
        return "dspark"
    if any(arch in DFLASH_ARCHITECTURES for arch in architectures) or isinstance(raw.get("dflash_config"), dict):
        return "dflash"
    if raw.get("mask_token_id") is not None and raw.get("target_layer_ids") is not None:
        # An unnamed architecture with top-level draft fields: DeepSpec's layout when it has a Markov
        # rank, else a third-party DFlash config that flattened `dflash_config`.
        return "dspark" if "markov_rank" in raw else "dflash"
    shown = ", ".join(architectures) if architectures else "none"
    raise ModelFormatError(f"{source} is not a DFlash or DSpark draft (architectures: {shown})", hint=_DRAFT_HINT)


def _qwen3_config(raw: dict[str, Any]):
    """transformers' Qwen3Config of the raw dict: it resolves defaults and the rope parameters."""
    from transformers import Qwen3Config

    ignored = {"model_type", "architectures", "auto_map", "transformers_version", "dflash_config"}
    return Qwen3Config(**{k: v for k, v in raw.items() if k not in ignored})


def _required_int(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(
            f"{source} lacks an integer {name!r}",
            hint=f"add {name} to the draft's config.json (in dflash_config for a z-lab draft)",
        )
    return value


def _target_layer_ids(
    ids: Any, num_target_layers: Any, num_layers: int, source: str
) -> tuple[int, ...]:
    if ids is None:
        if not isinstance(num_target_layers, int):
            raise ModelFormatError(
                f"{source} has neither target_layer_ids nor num_target_layers",
                hint="add dflash_config.target_layer_ids (the target layers the draft reads) to config.json",
            )
        ids = build_target_layer_ids(num_target_layers, num_layers)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ModelFormatError(
            f"{source}: target_layer_ids must be a non-empty list of layer indices, got {ids!r}",
            hint="fix target_layer_ids in the draft's config.json",
        )
    if isinstance(num_target_layers, int) and max(ids) >= num_target_layers:
        raise ModelFormatError(
            f"{source}: target layer {max(ids)} does not exist in a {num_target_layers}-layer target",
            hint="fix target_layer_ids or num_target_layers in the draft's config.json",
        )
    return tuple(ids)


def _candidate_position_offset(kind: str, draft_field, source: str) -> int:
    explicit = draft_field("candidate_position_offset")
    if explicit is not None:
        offset = explicit
    elif draft_field("sample_from_anchor") is not None:
        offset = 0 if draft_field("sample_from_anchor") else 1
    else:
        offset = 1 if kind == "dflash" else 0
    if offset not in (0, 1):
        raise ModelFormatError(
            f"{source}: candidate_position_offset must be 0 or 1, got {offset!r}",
            hint="1 = the seed row yields no candidate (z-lab DFlash); 0 = the anchor row predicts (DSpark)",
        )
    return int(offset)


def _layer_types(raw: dict[str, Any], num_layers: int, source: str) -> tuple[tuple[str, ...], int | None]:
    # Read from the raw dict: transformers' Qwen3Config drops `sliding_window` unless
    # `use_sliding_window` is set, but drafts mark their sliding layers in `layer_types` alone.
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ModelFormatError(
            f"{source}: layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}, got {layer_types!r}",
            hint="fix layer_types in the draft's config.json",
        )
    if "sliding_attention" not in layer_types:
        return tuple(layer_types), None
    window = raw.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelFormatError(
            f"{source} has sliding_attention layers but no positive sliding_window",
            hint="set sliding_window in the draft's config.json",
        )
    return tuple(layer_types), window
