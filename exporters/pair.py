"""`dflash export`: pick each model's role from its config and export the target, the draft or both."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dflash.core.errors import ModelFormatError

from .roles import read_source_config

StepCallback = Callable[[str], None]


@dataclass
class ExportResult:
    target_dir: Path | None = None
    draft_dir: Path | None = None
    validation: object | None = None  # a ValidationReport when a pair was exported
    outputs: list[Path] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "target": str(self.target_dir) if self.target_dir else None,
            "draft": str(self.draft_dir) if self.draft_dir else None,
            "validation": self.validation.to_json() if self.validation is not None else None,
        }


def export_models(
    model: str | Path,
    output_dir: str | Path,
    *,
    draft: str | Path | None = None,
    weight_format: str = "fp16",
    draft_weight_format: str | None = None,
    draft_vocab_size: int | None = None,
    trust_remote_code: bool = False,
    overwrite: bool = False,
    on_step: StepCallback | None = None,
) -> ExportResult:
    """Export MODEL (a target or a draft) to OUTPUT_DIR; with `draft`, the pair to target/ and draft/.

    `draft_vocab_size`: see `export_draft`. A pair is validated at the end (the report is returned; the caller decides what a failure means).
    OUTPUT_DIR (with a pair: OUTPUT_DIR/target and OUTPUT_DIR/draft) must be new, empty or a previous
    export of the same kind unless `overwrite`; each model is staged and published atomically.
    """
    from .staging import check_output_dir

    if draft is not None:  # a single model's exporter checks its folder itself, knowing its role
        check_output_dir(Path(output_dir), "pair", overwrite=overwrite, sources=[model, draft])
    config = read_source_config(model)
    from .roles import detect_role

    output_dir = Path(output_dir)
    role = detect_role(config)
    draft_weight_format = draft_weight_format or weight_format
    result = ExportResult()

    if draft is None:
        if role == "draft":
            result.draft_dir = _export_draft(model, output_dir, draft_weight_format, draft_vocab_size, None, overwrite, on_step)
        else:
            result.target_dir = _export_target(model, output_dir, weight_format, trust_remote_code, overwrite, on_step)
        return result

    if role != "target":
        raise ModelFormatError(
            f"{model} is a draft, but --draft was also given",
            "pass the target as MODEL and the draft with --draft",
        )
    if detect_role(read_source_config(draft)) != "draft":
        raise ModelFormatError(
            f"{draft} is not a DFlash/DSpark draft (its config.json names no draft architecture)",
            "pass a z-lab DFlash (DFlashDraftModel) or DeepSpec DSpark (Qwen3DSparkModel) checkpoint",
        )
    result.target_dir = _export_target(model, output_dir / "target", weight_format, trust_remote_code, overwrite, on_step)
    hidden = json.loads((result.target_dir / "config.json").read_text()).get("hidden_size")
    result.draft_dir = _export_draft(draft, output_dir / "draft", draft_weight_format, draft_vocab_size, hidden, overwrite, on_step)

    from .validate import validate_draft

    if on_step:
        on_step("Validating the pair")
    result.validation = validate_draft(result.draft_dir, result.target_dir)
    return result


def _export_target(model, out: Path, weight_format: str, trust_remote_code: bool, overwrite: bool, on_step) -> Path:
    from .target import export_target

    return export_target(model, out, weight_format=weight_format, trust_remote_code=trust_remote_code,
                         overwrite=overwrite, on_step=on_step)  # fmt: skip


def _export_draft(draft, out: Path, weight_format: str, vocab_size: int | None, target_hidden_size: int | None,
                  overwrite: bool, on_step) -> Path:  # fmt: skip
    from .draft import export_draft

    return export_draft(draft, out, weight_format=weight_format, draft_vocab_size=vocab_size,
                        target_hidden_size=target_hidden_size, overwrite=overwrite, on_step=on_step)  # fmt: skip
