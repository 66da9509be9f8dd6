"""Checks `generate` and `bench` run before loading anything: each problem named with its fix, exit 2.

The engine would fail on the same inputs later, with OpenVINO's message and after seconds of loading;
here the message names the folder and file. The draft gets the checks `dflash validate` runs (without
the slow PagedAttention conversion).
"""

from __future__ import annotations

from pathlib import Path

from dflash.core.errors import InputError

MODEL_XML = "openvino_model.xml"
# Any one of these lets transformers build the tokenizer that `dflash export` saves.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def looks_like_path(text: str) -> bool:
    """A positional argument that names a file system location rather than a prompt."""
    import os

    return os.sep in text or (os.altsep or "/") in text or text.startswith("~") or path_exists(Path(text))


def path_exists(path: Path, *, folder: bool = False) -> bool:
    """Whether `path` names an existing file (or folder); a text that cannot be a file name at all (longer
    than the system allows: a long prompt) names none."""
    try:
        return path.is_dir() if folder else path.exists()
    except OSError:
        return False


def is_folder(text: str) -> bool:
    """A positional argument that names an existing folder (a long prompt is none: `path_exists`)."""
    return path_exists(Path(text), folder=True)


def check_model_dir(folder: Path, role: str) -> None:
    """An exported model folder: present, with its tokenizer (a target), complete, readable by OpenVINO."""
    if not folder.exists():
        raise InputError(f"no {role} folder {folder}", f"pass the {role} folder that `dflash export` wrote")
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder", f"pass the exported {role}'s folder, not a file in it")
    xml = folder / MODEL_XML
    if not xml.is_file():
        hint = f"pass the {role} folder that `dflash export` wrote"
        if (folder / "config.json").is_file():
            hint = f"this looks like a checkpoint, not an export: run `dflash export {folder} <output-dir>` first"
        raise InputError(f"{folder} has no {MODEL_XML}", hint)
    if role == "target" and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])})",
            "re-export the target with `dflash export` (it saves them), or copy them from the source model",
        )
    from dflash.exporters.staging import check_complete

    problem = check_complete(folder)
    if problem:
        raise InputError(f"the {role} is not a complete export: {problem}", f"re-export it (dflash export){_validate_hint(role, folder)}")
    _read_ir(xml, role, folder)


def check_target_dir(folder: Path) -> None:
    check_model_dir(folder, "target")


def check_draft_dir(draft: Path, target: Path) -> None:
    """The checks of `dflash validate DRAFT --target TARGET` but the PagedAttention conversion."""
    check_model_dir(draft, "draft")
    from dflash.exporters.validate import validate_draft

    report = validate_draft(draft, target, check_paged=False)
    failed = report.failed
    if failed:
        first = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise InputError(
            f"the draft {draft} fails the check {first.name}{more}: {first.detail}",
            f"{first.fix or 'fix the draft'}; `dflash validate {draft} --target {target}` shows every check",
        )


def _read_ir(xml: Path, role: str, folder: Path) -> None:
    import openvino as ov

    from ._errors import openvino_reason

    try:
        ov.Core().read_model(xml)
    except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError for every unreadable IR
        raise InputError(
            f"{xml} (or its .bin) is damaged or incomplete: {openvino_reason(exc)}",
            f"re-export the {role} (dflash export){_validate_hint(role, folder)}",
        ) from exc


def _validate_hint(role: str, folder: Path) -> str:
    return f" or run `dflash validate {folder}`" if role == "draft" else ""


def check_writable(path: Path, option: str) -> None:
    """An output file of a long run: its folder must exist or be creatable, and be writable, now."""
    import os

    if path.exists() and path.is_dir():
        raise InputError(f"{option} {path} is a folder", f"pass a file name for {option}")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create {parent} for {option}: {exc.strerror or exc}", f"pass another path to {option}") from exc
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{option} {path} is not writable", f"pass another path to {option}")
