"""The environment of a benchmark: versions, CPU, and the weight precisions of the models measured."""

from __future__ import annotations

import platform
import re
from pathlib import Path


def environment(target_dir: str | Path, draft_dir: str | Path) -> dict:
    """Versions, CPU and models: what a reader needs to compare two reports."""
    return {
        "dflash_version": _version("dflash"),
        "openvino_version": _openvino_version(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": _cpu_count(),
        "target_dir": str(Path(target_dir).resolve()),
        "draft_dir": str(Path(draft_dir).resolve()),
        "target_weight_precisions": weight_precisions(target_dir),
        "draft_weight_precisions": weight_precisions(draft_dir),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _openvino_version() -> str | None:
    try:
        import openvino

        return openvino.get_version()
    except Exception:  # noqa: BLE001 - the report only notes it
        return None


def _cpu_count() -> int | None:
    import os

    return os.cpu_count()


def cpu_model() -> str | None:
    """The `model name` line of /proc/cpuinfo (Linux), else platform.processor() or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


_CONST = re.compile(r'<layer[^>]*type="Const"[^>]*>\s*<data([^>]*)/?>')
_ATTR = re.compile(r'(element_type|size)="([^"]*)"')
_MIN_WEIGHT_BYTES = 4096  # smaller constants are shapes, axes and scalars, not weights


def weight_precisions(model_dir: str | Path) -> dict[str, int] | None:
    """How many weight-sized constants (>= 4 KiB) of each element type the model's IR holds
    (e.g. {"u8": 210, "f16": 2}): a readable sign of int8/fp16/fp32 weights. None without a readable IR."""
    folder = Path(model_dir)
    xmls = sorted(folder.glob("openvino_*model.xml")) or sorted(folder.glob("*.xml"))
    xmls = [x for x in xmls if "tokenizer" not in x.name]
    if not xmls:
        return None
    try:
        text = xmls[0].read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    counts: dict[str, int] = {}
    for attributes in _CONST.findall(text):
        data = dict(_ATTR.findall(attributes))
        if "element_type" in data and int(data.get("size", "0") or 0) >= _MIN_WEIGHT_BYTES:
            counts[data["element_type"]] = counts.get(data["element_type"], 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1])) or None

