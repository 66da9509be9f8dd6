"""Export a Hugging Face causal LM as a DFlash target: optimum-intel's stateful IR plus layer locators.

The result is the standard optimum-intel export (`input_ids`, `attention_mask`, `position_ids`,
`beam_idx` -> `logits`; `openvino_model.xml/.bin`, config, tokenizer files, generation config,
`openvino_tokenizer.xml`/`openvino_detokenizer.xml` when openvino-tokenizers can make them), so
OpenVINO GenAI and optimum-intel read it as they read any of their own exports. dflash adds one
thing: the `hidden_states_decoder_layers` rt_info for every family, not only qwen3.

Stages, in order (each announced through `on_step`):
1. read config.json and refuse drafts;
2. convert with optimum-intel into a staging folder next to the output (exporters/staging.py), so a
   failed or interrupted export never leaves a half-written model where a finished one is expected;
   hybrid linear-attention targets (Qwen3.5) get their rotary positions from `position_ids`
   (exporters/hybrid.py); of a vision-language Qwen3.5 checkpoint (`qwen3_5`) only the language model
   is exported, staged as a `qwen3_5_text` checkpoint (`text_target_source`);
3. annotate the decoder layers on the uncompressed graph;
4. compress the weights with NNCF through optimum-intel's own weight-quantization config (int8/int4),
   then check that every locator still resolves;
5. convert the tokenizer (a failure is only a warning);
6. publish the staging folder as OUTPUT_DIR with a rename (the previous export goes only then).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openvino as ov

from dflash.core.errors import ExportError, InputError, ModelFormatError
from dflash.core.hidden_states import (
    RT_INFO_KEY,
    annotate_hidden_states,
    hidden_state_outputs,
    read_hidden_state_locators,
)

from . import interrupts
from .hybrid import (
    is_hybrid_config,
    require_hybrid_export_support,
    text_target_source,
    use_position_ids_for_rope,
)
from .roles import detect_role, read_source_config
from .staging import check_output_dir, disk_full_error, publish, quiet_nncf, saving, staging_dir, stdout_to_stderr

__all__ = ["WEIGHT_FORMATS", "detect_role", "export_target"]

WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
TASK = "text-generation-with-past"
MODEL_XML = "openvino_model.xml"

# NNCF weight compression per format, as optimum-intel's OVWeightQuantizationConfig arguments.
# int8: asymmetric per-channel (what `optimum-cli --weight-format int8` does).
# int4: asymmetric, group 128 (optimum-cli's default); "adjust" picks a smaller power-of-two group
# for matrices whose input width 128 does not divide (small models), instead of leaving them in int8.
_WEIGHT_COMPRESSION: dict[str, dict[str, Any]] = {
    "int8": {"bits": 8, "sym": False},
    "int4": {"bits": 4, "sym": False, "group_size": 128, "ratio": 1.0, "group_size_fallback": "adjust"},
}

StepCallback = Callable[[str], None]


def export_target(
    model: str | Path,
    output_dir: str | Path,
    *,
    weight_format: str = "fp16",
    trust_remote_code: bool = False,
    overwrite: bool = False,
    on_step: StepCallback | None = None,
) -> Path:
    """Export the causal LM `model` (hub id or local folder) to `output_dir`; return `output_dir`.

    `weight_format` is fp32, fp16, int8 or int4. Raises InputError/ModelFormatError for input that is
    not a target (no config.json, a DFlash/DSpark draft, not a causal LM) or an `output_dir` that holds
    anything but a previous target export (unless `overwrite`), and ExportError when optimum-intel,
    NNCF, the hidden-state annotation or the disk fails. The export is staged beside `output_dir` and
    published with a rename: a failed or interrupted export leaves `output_dir` as it was.
    """
    step = on_step or (lambda _description: None)
    if weight_format not in WEIGHT_FORMATS:
        raise InputError(
            f"unknown weight format {weight_format!r}", f"choose one of {', '.join(WEIGHT_FORMATS)}"
        )
    output_dir = Path(output_dir)
    check_output_dir(output_dir, "target", overwrite=overwrite, sources=[model])

    step("Loading model")
    config = read_source_config(model)
    _require_target(model, config)
    if is_hybrid_config(config):
        require_hybrid_export_support(config)

    with staging_dir(output_dir) as stage, text_target_source(model, config, on_step) as (source, source_config):
        work = stage / ".convert"  # optimum-intel's own output; the final files go to `stage`
        ov_model = _converted_model(source, source_config, work, output_dir, weight_format, trust_remote_code, step)
        with interrupts.deferred(), saving(output_dir):
            # fp16 weights are already f16 constants; compressing again only keeps them so.
            ov.save_model(ov_model, stage / MODEL_XML, compress_to_fp16=weight_format == "fp16")
            del ov_model
            for item in work.iterdir():
                if item.name not in (MODEL_XML, Path(MODEL_XML).with_suffix(".bin").name):
                    os.replace(item, stage / item.name)
            shutil.rmtree(work)

        step("Converting tokenizer")
        with interrupts.deferred(), saving(output_dir):
            _convert_tokenizer(stage, trust_remote_code)
        publish(stage, output_dir, "target")
    return output_dir


def _converted_model(
    model: str | Path,
    config: dict[str, Any],
    work: Path,
    output_dir: Path,
    weight_format: str,
    trust_remote_code: bool,
    step: StepCallback,
) -> ov.Model:
    """Convert `model` into `work` with optimum-intel, annotate its hidden states and compress its
    weights as `weight_format` asks; the annotation is checked on the model returned."""
    step("Converting to OpenVINO")
    ov_config = _ov_config(weight_format)
    # Signals wait for the end of each stage: one inside the converter's Python callbacks aborts
    # the process or turns into an unrelated conversion error.
    with interrupts.deferred():
        _convert(model, work, ov_config, trust_remote_code, output_dir)
        ov_model = ov.Core().read_model(work / MODEL_XML)
        if is_hybrid_config(config):
            # optimum-intel's Qwen3.5 graph ignores position_ids, which PagedAttention needs
            use_position_ids_for_rope(ov_model)

    step("Annotating hidden states")
    with interrupts.deferred():
        _annotate(ov_model, model, config, trust_remote_code)

    if weight_format in _WEIGHT_COMPRESSION:
        step(f"Compressing weights ({weight_format})")
        with interrupts.deferred():
            ov_model = _compress(ov_model, ov_config.quantization_config, weight_format)
    _check_annotation(ov_model)
    return ov_model


def _require_target(model: str | Path, config: dict[str, Any]) -> None:
    if detect_role(config) == "draft":
        architectures = ", ".join(config.get("architectures") or [])
        raise ModelFormatError(
            f"{model} is a DFlash/DSpark draft ({architectures}), not a target",
            "pass the draft on its own (`dflash export DRAFT OUT`) or with --draft next to its target",
        )


def _ov_config(weight_format: str) -> Any:
    from optimum.intel.openvino.configuration import OVConfig, OVWeightQuantizationConfig

    if weight_format in _WEIGHT_COMPRESSION:
        # Telling optimum-intel the model will be quantized also keeps it from pinning an f16 KV cache.
        return OVConfig(quantization_config=OVWeightQuantizationConfig(**_WEIGHT_COMPRESSION[weight_format]))
    return OVConfig(dtype=weight_format)


def _convert(model: str | Path, staging: Path, ov_config: Any, trust_remote_code: bool, output_dir: Path) -> None:
    """optimum-intel's own export path (model loading, dtype handling, stateful conversion)."""
    from optimum.exporters.openvino import main_export

    try:
        with stdout_to_stderr():
            main_export(
                str(model),
                staging,
                task=TASK,
                library_name="transformers",
                ov_config=ov_config,
                stateful=True,
                trust_remote_code=trust_remote_code,
                convert_tokenizer=False,
            )
    except Exception as exc:  # noqa: BLE001 - every optimum/transformers failure becomes one ExportError
        full = disk_full_error(exc, output_dir)
        if full is not None:
            raise full from exc
        raise ExportError(
            f"optimum-intel could not convert {model}: {_first_line(exc)}",
            "check that it is a causal LM supported by optimum-intel 2.2.0 "
            "(pass --trust-remote-code for models with custom code); --debug shows the traceback",
        ) from exc
    if not (staging / MODEL_XML).is_file():
        raise ExportError(
            f"optimum-intel wrote no {MODEL_XML} for {model}", "--debug shows what it did write"
        )


def _annotate(ov_model: ov.Model, model: str | Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    """Keep optimum-intel's own annotation (qwen3 family); otherwise write one for this family."""
    if ov_model.has_rt_info(RT_INFO_KEY):
        return
    num_layers = _num_layers(config)
    annotate_hidden_states(ov_model, num_layers, source_model=_skeleton(model, trust_remote_code))


def _num_layers(config: dict[str, Any]) -> int:
    text_config = config.get("text_config") or config
    num_layers = text_config.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ModelFormatError("config.json has no valid num_hidden_layers", "fix or re-download config.json")
    return num_layers


def _skeleton(model: str | Path, trust_remote_code: bool) -> Any | None:
    """The PyTorch module tree without weights (meta device), for optimum-intel's layer discovery.

    It costs no memory; when it cannot be built, the graph-only locator does the work alone.
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - optional: the graph locator needs no PyTorch model
        return None


def _compress(ov_model: ov.Model, quantization_config: Any, weight_format: str) -> ov.Model:
    """NNCF weight compression through optimum-intel's config, as `optimum-cli export` applies it."""
    # optimum-intel 2.2.0 exposes no public call that compresses an in-memory ov.Model; this is the
    # function its own CLI path (_main_quantize -> _apply_quantization) ends in. The version is pinned.
    from optimum.intel.openvino.quantization import _weight_only_quantization

    try:
        with stdout_to_stderr(), quiet_nncf():
            return _weight_only_quantization(ov_model, quantization_config)
    except Exception as exc:  # noqa: BLE001 - every NNCF failure becomes one ExportError
        raise ExportError(
            f"NNCF could not compress the weights to {weight_format}: {_first_line(exc)}",
            "try another --weight-format (int8 or fp16); --debug shows the traceback",
        ) from exc


def _check_annotation(ov_model: ov.Model) -> None:
    """Every annotated layer must resolve to exactly one node in the graph that will be saved."""
    try:
        hidden_state_outputs(ov_model, sorted(read_hidden_state_locators(ov_model)))
    except ModelFormatError as exc:
        raise ExportError(f"the hidden-state annotation does not resolve: {exc.message}", exc.hint) from exc


def _convert_tokenizer(staging: Path, trust_remote_code: bool) -> None:
    """openvino_tokenizer.xml / openvino_detokenizer.xml, through optimum-intel; a failure is a warning."""
    try:
        from optimum.exporters.openvino.convert import export_tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(staging, trust_remote_code=trust_remote_code)
        with stdout_to_stderr():
            export_tokenizer(tokenizer, staging, task=TASK)
    except Exception as exc:  # noqa: BLE001 - the model is usable without OpenVINO tokenizer models
        warnings.warn(
            f"openvino_tokenizer.xml was not written ({_first_line(exc)}); "
            "OpenVINO GenAI needs it, dflash uses the Hugging Face tokenizer files",
            stacklevel=3,
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
