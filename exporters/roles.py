"""Tell a draft from a target by its config.json alone, before any weights are loaded.

`dflash export` takes one model argument and picks the exporter from this answer, so the rule has
to be cheap and unambiguous: a DFlash/DSpark draft names itself in `architectures`; anything else
that transformers knows as a causal language model is a target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from dflash.core.errors import InputError, ModelFormatError

Role = Literal["draft", "target"]

# The published draft architectures; any other architecture naming DFlash or DSpark counts too, so
# that renamed or newer variants are never mistaken for (and exported as) a target.
DRAFT_ARCHITECTURES = ("DFlashDraftModel", "Qwen3DSparkModel")
_DRAFT_MARKERS = ("dflash", "dspark")

# Suffixes of Hugging Face causal-LM head classes (LlamaForCausalLM, GPT2LMHeadModel, ...).
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# model_types of vision-language checkpoints exported as their language model (hybrid.VLM_TEXT_TARGETS).
_VLM_TEXT_TARGET_TYPES = ("qwen3_5",)


def is_draft_architecture(name: str) -> bool:
    """True for a DFlash/DSpark draft architecture name."""
    lowered = name.lower()
    return name in DRAFT_ARCHITECTURES or any(marker in lowered for marker in _DRAFT_MARKERS)


def detect_role(model_dir_or_config: dict[str, Any] | str | Path) -> Role:
    """"draft" or "target", from the `architectures` of a config.json (a dict, or a folder holding one).

    Raises ModelFormatError when the config describes neither a draft nor a causal language model.
    """
    config = _as_config(model_dir_or_config)
    architectures = [str(name) for name in config.get("architectures") or []]
    if any(is_draft_architecture(name) for name in architectures):
        return "draft"
    if any(name.endswith(_CAUSAL_LM_SUFFIXES) for name in architectures):
        return "target"
    # A vision-language checkpoint whose language model dflash exports as the target (exporters/hybrid.py).
    if config.get("model_type") in _VLM_TEXT_TARGET_TYPES:
        return "target"
    # Configs saved without `architectures` still name a model type transformers can map to a causal LM.
    if not architectures and _is_causal_lm_model_type(config.get("model_type")):
        return "target"
    described = ", ".join(architectures) or f"model_type {config.get('model_type')!r}"
    raise ModelFormatError(
        f"config.json describes neither a causal language model nor a DFlash/DSpark draft ({described})",
        "pass a Hugging Face causal LM (a ...ForCausalLM architecture) as the target, "
        "or a DFlashDraftModel / Qwen3DSparkModel checkpoint as the draft",
    )


def _as_config(model_dir_or_config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(model_dir_or_config, dict):
        return model_dir_or_config
    config_file = Path(model_dir_or_config) / "config.json"
    if not config_file.is_file():
        raise InputError(f"{model_dir_or_config} has no config.json", "pass a Hugging Face model folder")
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot parse {config_file}: {exc}", "fix or re-download config.json") from exc


def _is_causal_lm_model_type(model_type: object) -> bool:
    if not isinstance(model_type, str):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def read_source_config(model: str | Path) -> dict:
    """config.json of a local folder or a hub id (only that file is fetched for a hub id)."""
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{model} is a file, not a model folder", "pass the folder that holds config.json")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise InputError(f"{model} has no config.json", "pass a Hugging Face model folder or a hub id")
    elif str(model).startswith((".", "/", "~")) or str(model).count("/") > 1:
        # A hub id is `org/name` (or a bare legacy name); anything else that names no folder is a path.
        raise InputError(f"no folder {model}", "pass a local model folder, or a hub id such as org/name")
    else:
        try:
            from huggingface_hub import hf_hub_download

            config_file = Path(hf_hub_download(str(model), "config.json"))
        except Exception as exc:  # noqa: BLE001 - any hub failure means the same thing to the user
            raise InputError(
                f"{model} is neither a local folder nor a reachable hub model ({type(exc).__name__})",
                "check the path, or the hub id and your network / HF_TOKEN",
            ) from exc
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot parse {config_file}: {exc}", "fix or re-download config.json") from exc
