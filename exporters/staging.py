"""Exports that never destroy: stage beside OUTPUT_DIR, publish with a rename, refuse foreign folders.

    check_output_dir(out, "draft", overwrite=False, sources=[checkpoint])   # before any work
    with staging_dir(out) as stage:                                         # .NAME.partial-XXXX
        ... write every file into stage ...
        publish(stage, out, "draft")                                        # marker, then renames

- An OUTPUT_DIR that exists, is not empty and is not a previous export of the same kind is refused
  (InputError, exit 2) unless `overwrite`; a folder that is (or holds) a source model is always refused.
- Everything is written into a staging folder beside OUTPUT_DIR (same filesystem, so publishing is a
  rename). A failure or an interrupt before `publish` leaves OUTPUT_DIR as it was; the staging folder
  is removed on every exit path Python sees (`staging_dir`'s finally).
- `publish` writes the marker `dflash_export.json` last (the kind and every file's size), then swaps
  the folders with two renames under deferred signals. `check_complete` compares a folder with its
  marker, so a truncated or half-copied export is named before OpenVINO reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

from dflash.core.errors import InputError

from . import interrupts

MARKER = "dflash_export.json"
MARKER_VERSION = 1
STAGING_INFIX = ".partial-"
MODEL_FILES = ("openvino_model.xml", "openvino_model.bin")
_KINDS = ("target", "draft")


def is_staging_name(name: str) -> bool:
    """True for a staging folder's name (`.NAME.partial-XXXX`): an export that did not finish."""
    return name.startswith(".") and STAGING_INFIX in name


def export_kind(folder: Path) -> str | None:
    """"target" or "draft" for a folder that holds a dflash export (by its marker, or for exports
    written before the marker existed, by openvino_model.xml and the role of its config.json)."""
    marker = folder / MARKER
    if marker.is_file():
        try:
            kind = json.loads(marker.read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            return None
        return kind if kind in _KINDS else None
    if not (folder / "openvino_model.xml").is_file() or not (folder / "config.json").is_file():
        return None
    from dflash.core.errors import DflashError

    from .roles import detect_role

    try:
        return detect_role(folder)
    except DflashError:
        return None


def check_output_dir(
    output_dir: Path, kind: str, *, overwrite: bool = False, sources: Iterable[str | Path | None] = ()
) -> None:
    """Refuse an OUTPUT_DIR that an export of `kind` ("target", "draft" or "pair") must not replace."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise InputError(f"{output_dir} exists and is not a folder", "choose another output folder")
    out = output_dir.resolve()
    for source in sources:
        if source is None or not Path(source).exists():
            continue  # a hub id
        src = Path(source).resolve()
        if src == out or out in src.parents:
            what = "is the source model folder" if src == out else f"holds the source model {source}"
            raise InputError(
                f"{output_dir} {what}",
                "write the export to a folder of its own; the source is read while the export is written",
            )
    if not output_dir.is_dir() or overwrite:
        return
    entries = sorted(p.name for p in output_dir.iterdir())
    if not entries:
        return
    if kind == "pair":
        foreign = [name for name in entries if name not in _KINDS]
        if not foreign:
            for sub in ("target", "draft"):
                check_output_dir(output_dir / sub, sub, overwrite=False)
            return
    elif export_kind(output_dir) == kind:
        return  # a previous export of the same kind: replaced when this one is complete
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    held = export_kind(output_dir)
    what = f"a dflash {held} export" if held else f"other files ({shown})"
    expected = "a target and a draft folder" if kind == "pair" else f"a previous {kind} export"
    replace = "write target/ and draft/ into it anyway (other files stay)" if kind == "pair" else "replace it"
    raise InputError(
        f"{output_dir} is not empty: it holds {what}, not {expected}",
        f"pass --overwrite to {replace}, or choose a new or empty folder",
    )


@contextmanager
def staging_dir(output_dir: Path) -> Iterator[Path]:
    """A fresh folder beside `output_dir` to write the export into; removed however the block ends."""
    output_dir = Path(output_dir)
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}{STAGING_INFIX}", dir=output_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        stage.chmod(0o777 & ~umask)  # mkdtemp's 0700 would become the published folder's mode
    except OSError as exc:
        raise InputError(
            f"cannot write beside {output_dir}: {exc.strerror or exc}", "choose a writable output folder"
        ) from exc
    try:
        yield stage
    finally:
        with interrupts.deferred():
            shutil.rmtree(stage, ignore_errors=True)


def write_marker(stage: Path, kind: str) -> None:
    """The marker, written last: the kind and the size of every file (what `check_complete` reads)."""
    files = {
        str(path.relative_to(stage)): path.stat().st_size
        for path in sorted(stage.rglob("*"))
        if path.is_file() and path.name != MARKER
    }
    data = {"kind": kind, "version": MARKER_VERSION, "files": files}
    (stage / MARKER).write_text(json.dumps(data, indent=2) + "\n")


def publish(stage: Path, output_dir: Path, kind: str) -> Path:
    """Make `stage` the new `output_dir` (the old one, if any, is removed once the new one is in place)."""
    write_marker(stage, kind)
    output_dir = Path(output_dir)
    with interrupts.deferred():
        if not output_dir.exists():
            os.rename(stage, output_dir)
            return output_dir
        old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
        os.rename(output_dir, old / "previous")
        try:
            os.rename(stage, output_dir)
        except BaseException:
            os.rename(old / "previous", output_dir)
            shutil.rmtree(old, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    return output_dir


def check_complete(folder: Path) -> str | None:
    """None when `folder` is a complete export (or one without a marker); else what is wrong."""
    folder = Path(folder)
    if is_staging_name(folder.name):
        return f"{folder} is the staging folder of an export that did not finish"
    marker = folder / MARKER
    if not marker.is_file():
        return None
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{marker} does not read ({type(exc).__name__})"
    # Only the model's own pair is compared, and its weights by size: the .xml may be edited on purpose
    # (rt_info), and the other files have checks of their own that say more (tokenizer, Markov head).
    for name in MODEL_FILES:
        if name not in files:
            continue
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if name.endswith(".bin") and actual != files[name]:
            how = "truncated" if actual < files[name] else "changed"
            return f"{path} is {how} ({actual} bytes, the export wrote {files[name]})"
    return None


def _disk_full(exc: BaseException, folder: Path) -> bool:
    """ENOSPC/EDQUOT, or a write error (OpenVINO says only "iostream error") on an almost full disk."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


def _unchanged(output_dir: Path) -> str:
    return f"{output_dir} was left as it was" if output_dir.exists() else f"nothing was written to {output_dir}"


def disk_full_error(exc: BaseException, output_dir: Path):
    """An ExportError naming a full disk when `exc` is (or looks like) one, else None."""
    from dflash.core.errors import ExportError

    where = Path(output_dir).parent
    if not isinstance(exc, (OSError, RuntimeError)) or not _disk_full(exc, where):
        return None
    return ExportError(
        f"no space left on the device of {where} while writing the export",
        "free some space (the new export is staged there while the previous one is kept) and run it "
        f"again; {_unchanged(Path(output_dir))}",
    )


@contextmanager
def saving(output_dir: Path) -> Iterator[None]:
    """Turn a failed write of the staged export into one ExportError that names the cause."""
    from dflash.core.errors import ExportError

    output_dir = Path(output_dir)
    try:
        yield
    except (OSError, RuntimeError) as exc:
        full = disk_full_error(exc, output_dir)
        if full is not None:
            raise full from exc
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ExportError(
            f"cannot write the export beside {output_dir}: {lines[-1] if lines else type(exc).__name__}",
            f"check the folder's permissions and free space; {_unchanged(output_dir)}",
        ) from exc


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """optimum, NNCF and rich print progress to stdout; keep stdout for the CLI's data (--json)."""
    with redirect_stdout(sys.stderr):
        yield


@contextmanager
def quiet_nncf() -> Iterator[None]:
    """NNCF logs its bit-width tables at INFO through a handler bound to the real stdout (which no
    redirect reaches): below WARNING they are dropped while NNCF runs."""
    import logging

    from nncf.common.logging.logger import nncf_logger

    previous = nncf_logger.level
    nncf_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        nncf_logger.setLevel(previous)


# Libraries whose loggers chatter during an export (deprecation notes, CUDA probes, bit-width tables).
_CHATTY_LOGGERS = ("transformers", "torch", "optimum", "nncf", "accelerate", "huggingface_hub")


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Other libraries' output during an export is dropped: progress bars (tqdm, rich), deprecation
    notes, TracerWarnings, torch's CUDA probe. dflash's own progress (on_step callbacks write to the
    CLI's stderr console, bound before this) and its own warnings still show; failures still raise.
    DFLASH_DEBUG=1 keeps everything."""
    import io
    import logging
    import sys
    import warnings

    if os.environ.get("DFLASH_DEBUG", "") not in ("", "0", "false", "False"):
        yield
        return
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    sink, stderr = io.StringIO(), sys.stderr
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings(), redirect_stdout(sink), redirect_stderr(sink):
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"dflash(\.|$)")  # dflash's own warnings still show
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: stderr.write(
                warnings.formatwarning(message, category, filename, lineno, line)
            )
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
