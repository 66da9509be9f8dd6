"""`dflash export` for drafts: a DFlash/DSpark checkpoint to the per-row stateful OpenVINO IR.

What is written, and why each piece looks the way it does, is in docs/draft-format.md. In short:
trace the per-row PyTorch draft (`draft_model.py`) with `openvino.convert_model`, name the ports,
make it stateful the way optimum-intel does (`beam_idx` + Gather on every past input, a zero state
initializer), tag it with rt_info, compress the weights, and save it next to the source config and,
for a DSpark draft with a Markov head, the head's own IR.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import openvino as ov
import torch

from dflash.core.draft_format import DRAFT_MODEL_FILE, MARKOV_HEAD_FILE, DraftMetadata, read_draft_metadata, write_rt_info  # noqa: F401
from dflash.core.errors import ExportError, InputError, ModelFormatError
from dflash.exporters.draft_checkpoint import load_draft_weights
from dflash.exporters.draft_config import DraftConfig, load_draft_config
from dflash.exporters.draft_model import DraftModel, draft_model_from_weights
from dflash.exporters.markov_head import markov_head_from_weights, save_markov_head
from dflash.exporters.staging import check_output_dir, publish, quiet_nncf, saving, staging_dir, stdout_to_stderr

from . import interrupts
from .tracing import name_ports, trace_and_convert

WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
# In a draft checkpoint: the target's tokens ranked by how often the target emits them (training/vocab.py),
# and the number of them the draft proposes by default ("size"; absent: the whole vocabulary).
DRAFT_VOCAB_FILE = "draft_vocab.json"

INPUT_NAMES = ("inputs_embeds", "hidden_states", "position_ids", "token_type_ids", "attention_mask")
OUTPUT_NAME = "last_hidden_state"


def past_names(num_layers: int) -> list[str]:
    """Names of the past key/value inputs before they become state variables (optimum's convention)."""
    return [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def export_draft(
    draft: str | Path,
    output_dir: str | Path,
    *,
    weight_format: str = "fp16",
    draft_vocab_size: int | None = None,
    target_hidden_size: int | None = None,
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> Path:
    """Export the draft `draft` (local folder or hub id) into `output_dir`; returns `output_dir`.

    `weight_format` is "fp32", "fp16", "int8" or "int4" (NNCF). With `target_hidden_size`, a draft
    whose hidden size differs from its target's is rejected (ModelFormatError). `draft_vocab_size`: how
    many of the target's tokens the draft may propose, the most frequent first by the checkpoint's
    `draft_vocab.json` (None: the number that file gives, or all without one; 0: all). `on_step`
    receives a short line as each stage starts.

    The export is staged beside `output_dir` and published with a rename (exporters/staging.py): a
    failed or interrupted export leaves `output_dir` as it was. An `output_dir` that holds anything but
    a previous draft export is refused (InputError) unless `overwrite`.
    """
    step = on_step or (lambda message: None)
    if weight_format not in WEIGHT_FORMATS:
        raise InputError(
            f"unknown weight format {weight_format!r}", hint=f"choose one of {', '.join(WEIGHT_FORMATS)}"
        )
    output_dir = Path(output_dir)
    check_output_dir(output_dir, "draft", overwrite=overwrite, sources=[draft])
    source = resolve_draft_source(draft, on_step=step)
    check_output_dir(output_dir, "draft", overwrite=overwrite, sources=[source])
    config = load_draft_config(source)
    check_exportable(config, target_hidden_size)
    draft_vocab = resolve_draft_vocab(Path(source), draft_vocab_size)

    step(f"loading {config.kind} draft weights from {source}")
    weights = load_draft_weights(source, config)
    model = draft_model_from_weights(config, weights)

    with staging_dir(output_dir) as stage:
        step("converting the draft to OpenVINO (per-row, stateful)")
        with interrupts.deferred():  # a signal inside the converter's Python callbacks aborts the process
            ov_model = convert_draft(model)
            add_draft_rt_info(ov_model, config, draft_vocab)
            ov_model = compress_draft_weights(ov_model, config, weight_format, step)

        step(f"saving {output_dir / DRAFT_MODEL_FILE}")
        with interrupts.deferred(), saving(output_dir):
            ov.save_model(ov_model, stage / DRAFT_MODEL_FILE, compress_to_fp16=weight_format == "fp16")
            shutil.copyfile(Path(source) / "config.json", stage / "config.json")
            if config.markov_rank > 0:
                step(f"saving the Markov head (rank {config.markov_rank}, uncompressed)")
                save_markov_head(markov_head_from_weights(weights), stage)
        publish(stage, output_dir, "draft")
    return output_dir


def check_exportable(config: DraftConfig, target_hidden_size: int | None = None) -> None:
    """Reject drafts this export cannot serve correctly (ModelFormatError)."""
    if target_hidden_size is not None and config.hidden_size != target_hidden_size:
        raise ModelFormatError(
            f"the draft's hidden size {config.hidden_size} differs from the target's {target_hidden_size}",
            hint="export the draft that was trained for this target",
        )
    if config.sliding_window is not None and config.sliding_window < config.draft_block_size:
        # PagedAttention's CPU kernel limits a bidirectional block differently from this mask when the
        # window is narrower than the block; a window at least as wide gives the same answer on both.
        raise ModelFormatError(
            f"the draft's sliding_window {config.sliding_window} is smaller than its block_size {config.draft_block_size}",
            hint="PagedAttention drafting needs sliding_window >= block_size",
        )


def resolve_draft_source(draft: str | Path, on_step: Callable[[str], None] | None = None) -> Path:
    """A local folder as is; anything else is taken as a hub id and downloaded (config and weights)."""
    path = Path(draft)
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{path} is not a folder", hint="pass the draft's folder, not a file in it")
        return path
    repo_id = str(draft)
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        raise InputError(f"no folder {repo_id}", hint="pass a local draft folder or a hub id such as org/name")
    if on_step:
        on_step(f"downloading {repo_id} from the Hugging Face hub")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise InputError(
            f"cannot download {repo_id}: {exc}".splitlines()[0],
            hint="check the hub id and your network, or pass a local folder",
        ) from exc


class _FlatDraft(torch.nn.Module):
    """The draft with flat past/present tensors, the calling convention `convert_model` traces."""

    def __init__(self, model: DraftModel):
        super().__init__()
        self.model = model

    def forward(self, inputs_embeds, hidden_states, position_ids, token_type_ids, attention_mask, *past):
        past_key_values = [(past[i], past[i + 1]) for i in range(0, len(past), 2)]
        out, presents = self.model(
            inputs_embeds, hidden_states, position_ids, token_type_ids, attention_mask, past_key_values
        )
        return (out, *[t for pair in presents for t in pair])


def convert_draft(model: DraftModel):
    """Trace `model` into a stateful OpenVINO model with the contract's port names (no rt_info)."""
    config = model.config
    h, k = config.hidden_size, config.num_target_features
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    # Past > 0 and a mixed [context; block] call, so nothing in the trace specialises to a first call.
    batch, past, rows = 1, 3, 2 + config.draft_block_size
    token_type_ids = torch.tensor([[0, 0] + [1] * config.draft_block_size])
    example = (
        torch.randn(batch, rows, h),
        torch.randn(batch, rows, k * h),
        torch.arange(past, past + rows)[None],
        token_type_ids,
        torch.ones(batch, past + rows, dtype=torch.int64),
        *[torch.randn(batch, kv_heads, past, head_dim) for _ in range(2 * config.num_hidden_layers)],
    )
    inputs = [
        ([-1, -1, h], ov.Type.f32),
        ([-1, -1, k * h], ov.Type.f32),
        ([-1, -1], ov.Type.i64),
        ([-1, -1], ov.Type.i64),
        ([-1, -1], ov.Type.i64),
        *[([-1, kv_heads, -1, head_dim], ov.Type.f32)] * (2 * config.num_hidden_layers),
    ]
    try:
        ov_model = trace_and_convert(_FlatDraft(model), example, inputs)
    except Exception as exc:  # the converter raises many types; report them as one export failure
        raise ExportError(f"OpenVINO could not convert the draft: {exc}".splitlines()[0]) from exc

    kv_inputs = past_names(config.num_hidden_layers)
    kv_outputs = present_names(config.num_hidden_layers)
    name_ports(ov_model, [*INPUT_NAMES, *kv_inputs], [OUTPUT_NAME, *kv_outputs])
    make_draft_stateful(ov_model, kv_inputs, kv_outputs)
    return ov_model


def make_draft_stateful(ov_model, kv_inputs: list[str], kv_outputs: list[str]) -> None:
    """Turn past/present pairs into state variables, as optimum-intel does for decoders.

    `apply_make_stateful_transformation` alone is not enough for SDPAToPagedAttention: it also needs
    the `beam_idx` Gather on every past input and a state initializer whose batch comes from a model
    input (`inputs_embeds` here); optimum-intel's helpers add exactly those.
    """
    from optimum.exporters.openvino.stateful import fuse_cache_reorder, make_stateful

    not_kv_inputs = [port for port in ov_model.inputs if not (port.get_names() & set(kv_inputs))]
    fuse_cache_reorder(ov_model, not_kv_inputs, kv_inputs, gather_dim=0)
    make_stateful(ov_model, not_kv_inputs, kv_inputs, kv_outputs, batch_dim=0, num_beams_and_batch=None)


def resolve_draft_vocab(source: Path, size: int | None) -> list[int] | None:
    """The target token ids an exported draft may propose: the first `size` of the checkpoint's ranking
    (DRAFT_VOCAB_FILE); None for the whole vocabulary (size 0, or no size given and none in the file)."""
    path = source / DRAFT_VOCAB_FILE
    if size == 0 or (size is None and not path.is_file()):
        return None
    if not path.is_file():
        raise InputError(
            f"--draft-vocab-size {size} needs a ranking of the target's tokens, and {source} has no {DRAFT_VOCAB_FILE}",
            "make one with `python -m dflash.training.vocab TARGET_DIR DRAFT/draft_vocab.json`, or leave the option out",
        )
    try:
        data = json.loads(path.read_text())
        ranking = [int(token) for token in data["ranking"]]
        vocab_size = int(data.get("vocab_size", len(ranking)))
        size = size if size is not None else data.get("size")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFormatError(f"{path} is not a draft vocabulary ranking ({exc})", "rebuild it with `python -m dflash.training.vocab`") from exc
    if size is None:
        return None
    if size < 0 or size > vocab_size:
        raise InputError(f"draft vocabulary size {size} is outside 0..{vocab_size}, the target's vocabulary by {path}",
                         "choose a size within that range (0: the whole vocabulary)")  # fmt: skip
    if size > len(ranking):  # tokens the ranking never saw, lowest id first (a BPE's earlier, commoner merges)
        seen = set(ranking)
        ranking += [token for token in range(vocab_size) if token not in seen][: size - len(ranking)]
    return ranking[:size]


def add_draft_rt_info(ov_model, config: DraftConfig, draft_vocab: list[int] | None = None) -> None:
    """Write the contract's rt_info (all values strings) onto the backbone."""
    write_rt_info(ov_model, "True", "dflash_mode")
    entries = {
        "mask_token_id": str(config.mask_token_id),
        "target_layer_ids": ",".join(map(str, config.target_layer_ids)),
        "block_size": str(config.draft_block_size),  # rt_info key, read by core.draft_format
        "candidate_position_offset": str(config.candidate_position_offset),
        "markov_rank": str(config.markov_rank),
    }
    if config.markov_rank > 0:
        entries["markov_head_type"] = config.markov_head_type
    if draft_vocab is not None:
        entries["draft_vocab"] = ",".join(map(str, draft_vocab))
    for key, value in entries.items():
        write_rt_info(ov_model, value, "dflash", key)


def compress_draft_weights(ov_model, config: DraftConfig, weight_format: str, step: Callable[[str], None]):
    """int8/int4 weight compression with NNCF; fp32/fp16 leave the model as is (fp16 happens on save)."""
    if weight_format not in ("int8", "int4"):
        return ov_model
    import nncf

    step(f"compressing weights to {weight_format} (NNCF)")
    with stdout_to_stderr(), quiet_nncf():  # NNCF's tables and progress bar: not on stdout (--json)
        if weight_format == "int8":
            return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        return nncf.compress_weights(
            ov_model,
            mode=nncf.CompressWeightsMode.INT4_ASYM,
            group_size=_int4_group_size(config),
            ratio=1.0,
            all_layers=True,
        )


def _int4_group_size(config: DraftConfig) -> int:
    """128 (the usual group) when it divides every input width, else the largest power of two that
    does, else per-channel (-1): tiny drafts have 64-wide layers."""
    widths = [config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim]
    for size in (128, 64, 32, 16):
        if all(w % size == 0 for w in widths):
            return size
    return -1
