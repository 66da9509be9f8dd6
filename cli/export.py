"""`dflash export`: Hugging Face target and/or DFlash/DSpark draft to OpenVINO IR."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from ._errors import debug_enabled, handled_errors
from ._options import (
    DebugOpt,
    DraftVocabSizeOpt,
    DraftWeightFormatOpt,
    JsonOpt,
    QuietOpt,
    TrustRemoteCodeOpt,
    WeightFormat,
    WeightFormatOpt,
)
from ._output import Output
from .validate import print_report

EXAMPLES = """\
Examples:

  dflash export Qwen/Qwen3-8B out/ --draft z-lab/Qwen3-8B-DFlash-b16 --weight-format int4

  dflash export ./my-target ./my-target-ov --weight-format int8

  dflash export ./dspark-draft ./dspark-draft-ov --json

  dflash export ./dflash-draft ./dflash-draft-ov --draft-vocab-size 8192   # propose only the 8192 most frequent tokens

  dflash export ./my-target ./folder-with-other-files --overwrite
"""


def export(
    model: Annotated[str, typer.Argument(help="Target or draft: a hub id or a local folder.", show_default=False)],
    output_dir: Annotated[Path, typer.Argument(help="Folder to write (with --draft: OUTPUT_DIR/target and OUTPUT_DIR/draft).", show_default=False)],
    draft: Annotated[
        Optional[str],
        typer.Option("--draft", help="A DFlash/DSpark draft to export with the target and validate against it.", show_default=False),
    ] = None,
    weight_format: WeightFormatOpt = WeightFormat.fp16,
    draft_weight_format: DraftWeightFormatOpt = None,
    draft_vocab_size: DraftVocabSizeOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an OUTPUT_DIR that holds anything but a previous export of the same kind."),
    ] = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Export a target and/or a DFlash/DSpark draft to OpenVINO IR.

    The role of MODEL comes from its config.json: a draft architecture (DFlashDraftModel, Qwen3DSparkModel) is exported in the per-row PagedAttention layout, anything else as a stateful causal LM annotated with its decoder layers' hidden states (of a vision-language Qwen3.5 checkpoint, qwen3_5, its language model: the vision tower is left out). With --draft the pair goes to OUTPUT_DIR/target and OUTPUT_DIR/draft and is validated at the end.

    The export is written into a staging folder beside OUTPUT_DIR and replaces it only when complete: a failed or interrupted export leaves OUTPUT_DIR as it was. An OUTPUT_DIR that holds anything but a previous export of the same kind is refused (exit 2) unless --overwrite.
    """
    output = Output(json_mode=json_output, quiet=quiet)
    with handled_errors(output, debug=debug):
        from dflash.exporters.pair import export_models
        from dflash.exporters.staging import quiet_libraries

        # dflash's own progress and warnings only (other libraries' deprecations, CUDA probes, progress
        # bars and NNCF tables are dropped); --debug keeps everything
        with output.status(f"Exporting {model}") as on_step, nullcontext() if debug_enabled(debug) else quiet_libraries():
            result = export_models(
                model,
                output_dir,
                draft=draft,
                weight_format=weight_format.value,
                draft_weight_format=draft_weight_format.value if draft_weight_format else None,
                draft_vocab_size=draft_vocab_size,
                trust_remote_code=trust_remote_code,
                overwrite=overwrite,
                on_step=on_step,
            )
        if json_output:
            output.json(result.to_json())
        else:
            for label, path in (("target", result.target_dir), ("draft", result.draft_dir)):
                if path is not None:
                    output.success(f"{label} written to {path}")
            if result.validation is not None:
                print_report(result.validation, output)
        if result.validation is not None and not result.validation.ok:
            raise typer.Exit(1)
