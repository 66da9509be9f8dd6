"""Draft checkpoint weights: reading real DFlash/DSpark checkpoints, writing them, and tiny random ones.

A draft checkpoint is a Hugging Face folder: `config.json` plus weights in safetensors (one file or shards
with `model.safetensors.index.json`) or torch `.bin` files. Weight names are the backbone's
(`fc.weight`, `hidden_norm.weight`, `layers.{i}...`, `norm.weight`), with or without a `model.` prefix.
DeepSpec DSpark checkpoints also carry the target's `embed_tokens`/`lm_head` and a confidence head,
which the export does not use, and the Markov head `markov_head.markov_w{1,2}.weight` [V, r].
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from dflash.core.errors import InputError, ModelFormatError
from dflash.exporters.draft_config import DraftConfig, parse_draft_config

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

# Weights a checkpoint may carry that the exported draft does not use: the engine grafts the target's
# embedding and lm_head, and the confidence head is not part of the contract.
IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "confidence_head.", "rotary_emb.")
MASK_TOKEN = "<|mask|>"


def expected_weight_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight the export reads (names without the `model.` prefix)."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, config.num_target_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_out, h),
                p + "self_attn.k_proj.weight": (kv_out, h),
                p + "self_attn.v_proj.weight": (kv_out, h),
                p + "self_attn.o_proj.weight": (h, q_out),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (config.intermediate_size, h),
                p + "mlp.up_proj.weight": (config.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, config.intermediate_size),
            }
        )
        if config.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_out,),
                    p + "self_attn.k_proj.bias": (kv_out,),
                    p + "self_attn.v_proj.bias": (kv_out,),
                    p + "self_attn.o_proj.bias": (h,),
                }
            )
    if config.markov_rank > 0:
        shapes["markov_head.markov_w1.weight"] = (config.vocab_size, config.markov_rank)
        shapes["markov_head.markov_w2.weight"] = (config.vocab_size, config.markov_rank)
    return shapes


def load_draft_weights(path: str | Path, config: DraftConfig):
    """Read the weights of the draft folder `path` as float32 tensors, named without `model.` prefix.

    Raises ModelFormatError when a weight is missing, has the wrong shape, or is not part of the
    DFlash/DSpark backbone (a sign of an unsupported variant).
    """
    weights = {}
    for name, tensor in _read_state_dict(Path(path)).items():
        key = name.removeprefix("model.")
        if key.startswith(IGNORED_PREFIXES):
            continue
        weights[key] = tensor.float()

    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelFormatError(
            f"the draft checkpoint in {path} lacks {shown}",
            hint="the weights do not match config.json (layers, heads, target_layer_ids, markov_rank)",
        )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        shown = ", ".join(unexpected[:4]) + (f" and {len(unexpected) - 4} more" if len(unexpected) > 4 else "")
        raise ModelFormatError(
            f"the draft checkpoint in {path} has weights this exporter does not know: {shown}",
            hint="only DFlash/DSpark drafts with a Qwen3 backbone and a vanilla Markov head are supported",
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelFormatError(
                f"weight {name} in {path} has shape {list(weights[name].shape)}, config.json implies {list(shape)}",
                hint="the weights do not match config.json (hidden size, heads, head_dim, target_layer_ids)",
            )
    return weights


def _read_state_dict(path: Path) -> dict[str, Any]:
    if (path / SAFETENSORS_FILE).is_file():
        return _load_file(path / SAFETENSORS_FILE)
    if (path / SAFETENSORS_INDEX).is_file():
        return _load_sharded(path, SAFETENSORS_INDEX)
    if (path / BIN_FILE).is_file():
        return _load_file(path / BIN_FILE)
    if (path / BIN_INDEX).is_file():
        return _load_sharded(path, BIN_INDEX)
    loose = sorted(path.glob("*.safetensors"))
    if len(loose) == 1:
        return _load_file(loose[0])
    raise InputError(
        f"no draft weights in {path}",
        hint=f"expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX}",
    )


def _load_file(file: Path) -> dict[str, Any]:
    import torch

    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(file))
    return torch.load(str(file), map_location="cpu", weights_only=True)


def _load_sharded(path: Path, index_name: str) -> dict[str, Any]:
    try:
        weight_map = json.loads((path / index_name).read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFormatError(
            f"cannot read {path / index_name}: {exc}", hint="the shard index needs a 'weight_map'"
        ) from exc
    if not isinstance(weight_map, dict):
        raise ModelFormatError(f"{path / index_name}: 'weight_map' is not an object", hint="re-download the checkpoint")
    state = {}
    root = path.resolve()
    for shard in sorted(set(map(str, weight_map.values()))):
        file = (path / shard).resolve()
        if root not in file.parents:  # an index must not make the export read files elsewhere ("../..")
            raise ModelFormatError(
                f"{path / index_name} names the shard {shard!r}, which is outside the checkpoint folder",
                hint="a shard index lists file names inside the checkpoint folder; re-download the checkpoint",
            )
        if not file.is_file():
            raise ModelFormatError(f"{path / index_name} names the shard {shard}, which is missing", hint="re-download the checkpoint")
        state.update(_load_file(file))
    return state


def save_draft_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    weights: dict[str, Any],
    *,
    file_format: str = "safetensors",
    num_shards: int = 1,
) -> Path:
    """Write `config.json` and `weights` (names as given) to `path`, as safetensors or torch `.bin`.

    With `num_shards` > 1 the weights are split over shard files plus the Hugging Face index file.
    """
    import torch

    if file_format not in ("safetensors", "bin"):
        raise ValueError(f"file_format must be 'safetensors' or 'bin', got {file_format!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def write(file: Path, part: dict[str, Any]) -> None:
        part = {k: v.contiguous() for k, v in part.items()}
        if file_format == "safetensors":
            from safetensors.torch import save_file

            save_file(part, str(file), metadata={"format": "pt"})
        else:
            torch.save(part, str(file))

    single, index = (SAFETENSORS_FILE, SAFETENSORS_INDEX) if file_format == "safetensors" else (BIN_FILE, BIN_INDEX)
    if num_shards <= 1:
        write(path / single, weights)
        return path
    stem, suffix = single.rsplit(".", 1)
    names = list(weights)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"{stem}-{shard + 1:05d}-of-{num_shards:05d}.{suffix}"
        part = {name: weights[name] for name in names[shard::num_shards]}
        write(path / file_name, part)
        weight_map.update({name: file_name for name in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (path / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def make_tiny_draft(
    path: str | Path,
    target_dir: str | Path,
    kind: str = "dflash",
    *,
    seed: int = 0,
    num_layers: int = 2,
    draft_block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    markov_rank: int = 0,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    num_key_value_heads: int | None = None,
    file_format: str = "safetensors",
    prefixed: bool | None = None,
    num_shards: int = 1,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight draft for the tiny target in `target_dir`, in the real source format.

    `kind="dflash"` writes the z-lab layout (nested `dflash_config`, unprefixed weights);
    `kind="dspark"` the DeepSpec layout (a copy of the target config with top-level draft fields,
    `model.`-prefixed backbone weights, the target's embedding and lm_head, a confidence head and,
    with `markov_rank` > 0, a Markov head). Sizes follow the target (hidden size, heads, vocab); the mask
    token is the target tokenizer's `<|mask|>`. `prefixed` overrides the format's weight prefix,
    `file_format` ("safetensors" or "bin") and `num_shards` the weight files, `overrides` any config key.
    """
    import torch

    if kind not in ("dflash", "dspark"):
        raise ValueError(f"kind must be 'dflash' or 'dspark', got {kind!r}")
    target_dir = Path(target_dir)
    target = json.loads((target_dir / "config.json").read_text())
    target = target.get("text_config") or target  # a vision-language target: its language model
    num_target_layers = target["num_hidden_layers"]
    if target_layer_ids is None:
        # Two well-separated, non-final target layers (z-lab's rule repeats a layer on a 4-layer target).
        target_layer_ids = sorted({0, max(0, num_target_layers - 2)})
    if layer_types is None:
        layer_types = ["full_attention"] * num_layers
    backbone = _tiny_backbone(target, num_layers, draft_block_size, layer_types, sliding_window, num_key_value_heads)
    mask_token_id = _mask_token_id(target_dir, target["vocab_size"])
    config = _tiny_config(kind, target, backbone, mask_token_id, target_layer_ids, markov_rank)
    config.update(overrides)

    draft_config = parse_draft_config(config, source="make_tiny_draft")
    generator = torch.Generator().manual_seed(seed)
    weights = _random_weights(draft_config, generator)
    use_prefix = kind == "dspark" if prefixed is None else prefixed
    if use_prefix:
        weights = {_prefixed(name): tensor for name, tensor in weights.items()}
    if kind == "dspark":
        weights.update(_dspark_extras(draft_config, markov_rank, generator, prefix="model." if use_prefix else ""))
    return save_draft_checkpoint(path, config, weights, file_format=file_format, num_shards=num_shards)


def _tiny_backbone(
    target: dict[str, Any],
    num_layers: int,
    draft_block_size: int,
    layer_types: list[str],
    sliding_window: int | None,
    num_key_value_heads: int | None,
) -> dict[str, Any]:
    """The backbone fields of a tiny draft's config.json, sized after the target's config."""
    num_target_layers = target["num_hidden_layers"]
    return {
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": num_key_value_heads or target.get("num_key_value_heads") or target["num_attention_heads"],
        "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
        "hidden_act": target.get("hidden_act", "silu"),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "attention_bias": False,
        "vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        "block_size": draft_block_size,  # the source formats' config.json key
        "num_target_layers": num_target_layers,
    }


def _tiny_config(
    kind: str,
    target: dict[str, Any],
    backbone: dict[str, Any],
    mask_token_id: int,
    target_layer_ids: list[int],
    markov_rank: int,
) -> dict[str, Any]:
    """A tiny draft's whole config.json: the z-lab layout (dflash) or the DeepSpec one (dspark)."""
    rope = target.get("rope_parameters") or {"rope_type": "default", "rope_theta": target.get("rope_theta", 10000.0)}
    if kind == "dflash":
        config = {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            **backbone,
            "rope_theta": rope.get("rope_theta", 10000.0),
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
            "dtype": "float32",
        }
    else:
        config = copy.deepcopy(target)
        config.update(backbone)
        config.update(
            {
                "architectures": ["Qwen3DSparkModel"],
                "model_type": "qwen3",
                "rope_parameters": rope,
                "mask_token_id": mask_token_id,
                "target_layer_ids": list(target_layer_ids),
                "num_anchors": 512,
                "enable_confidence_head": True,
                "markov_rank": markov_rank,
            }
        )
        if markov_rank > 0:
            config["markov_head_type"] = "vanilla"
            config["confidence_head_with_markov"] = True
    return config


def _mask_token_id(target_dir: Path, vocab_size: int) -> int:
    """The target tokenizer's `<|mask|>` id, or the last vocabulary id when it has none."""
    tokenizer_file = target_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        for token in json.loads(tokenizer_file.read_text()).get("added_tokens", []):
            if token.get("content") == MASK_TOKEN:
                return int(token["id"])
    return vocab_size - 1


def _random_weights(config: DraftConfig, generator) -> dict[str, Any]:
    """Seeded weights with unit-scale activations: projections ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1²).

    The scale keeps every layer's contribution comparable to the residual, so a wrong mask, window or
    row selection changes the output visibly instead of vanishing under the residual stream.
    """
    import torch

    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.startswith("markov_head."):
            weights[name] = torch.randn(shape, generator=generator) * 0.5
        elif name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * torch.randn(shape, generator=generator)
        else:
            weights[name] = torch.randn(shape, generator=generator) / shape[1] ** 0.5
    return weights


def _prefixed(name: str) -> str:
    # DeepSpec keeps the heads beside the backbone, not inside `model.`.
    return name if name.startswith("markov_head.") else "model." + name


def _dspark_extras(config: DraftConfig, markov_rank: int, generator, prefix: str) -> dict[str, Any]:
    """What a DeepSpec checkpoint carries besides the backbone: embedding, lm_head, confidence head."""
    import torch

    h, v = config.hidden_size, config.vocab_size
    conf_in = h + (markov_rank if markov_rank > 0 else 0)
    return {
        prefix + "embed_tokens.weight": torch.randn((v, h), generator=generator) * 0.05,
        "lm_head.weight": torch.randn((v, h), generator=generator) * 0.05,
        "confidence_head.proj.weight": torch.randn((1, conf_in), generator=generator) * 0.05,
        "confidence_head.proj.bias": torch.zeros(1),
    }
