"""Real text and code as training data: stretches of files, labelled by the target's own predictions.

No generation is needed: the trainer runs the target over the stretch (it does so for the features
anyway) and scores the draft against the target's argmax/distribution at every position, keeping
only the blocks that lie on the target's own greedy chain (trainer module docstring). A teacher-forced
pass is ~200x cheaper than greedy decoding, so this is the cheap way to a lot of varied data.

`text_dataset` walks folders (e.g. a Python installation's standard library and site-packages: code,
docstrings, comments, README/reST text), skips tests, tokenizes each file and cuts it into stretches
of `chunk_tokens`; the first `lead_in` tokens of a stretch are context only. Every record's group is
its file, so the hold-out keeps a file on one side.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

SUFFIXES = (".py", ".md", ".rst", ".txt")
SKIP_PARTS = {"test", "tests", "testing", "__pycache__", "idlelib", "lib2to3", "turtledemo", "_vendor", "vendored",
              "locale", "licenses"}


def source_files(
    roots: Sequence[str | Path], suffixes: Sequence[str] = SUFFIXES, max_bytes: int = 400_000, *, seed: int = 0
) -> list[Path]:
    """Files under `roots` with one of `suffixes`, outside test folders, at most `max_bytes`, in an order
    shuffled by `seed` (a token limit then samples every package, not the alphabetically first; another seed
    gives a warm-started run other files)."""
    files = []
    for root in roots:
        root = Path(root)
        if root.is_file():
            files.append(root)
            continue
        for path in root.rglob("*"):
            if path.suffix not in suffixes or not path.is_file():
                continue
            if any(part in SKIP_PARTS or part.startswith("test_") for part in path.relative_to(root).parts):
                continue
            try:
                if path.stat().st_size > max_bytes or path.stat().st_size < 200:
                    continue
            except OSError:
                continue
            files.append(path)
    files = sorted(set(files))
    random.Random(seed).shuffle(files)
    return files


def text_dataset(
    tokenizer: Any,
    files: Iterable[Path],
    out_file: str | Path,
    *,
    chunk_tokens: int = 512,
    lead_in: int = 16,
    max_tokens: int | None = None,
    exclude: Callable[[Sequence[int]], bool] | None = None,
) -> dict[str, int]:
    """Write stretches of `files` as dataset records (source "text"); returns counts.

    `exclude(ids)` drops a stretch (decontamination); `max_tokens` stops once that many are written.
    """
    counts = {"files": 0, "sequences": 0, "tokens": 0, "excluded": 0}
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with out_file.open("w") as sink:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            counts["files"] += 1
            for first in range(0, len(ids), chunk_tokens):
                chunk = ids[first : first + chunk_tokens]
                if len(chunk) < lead_in + 32:
                    continue
                if exclude is not None and exclude(chunk):
                    counts["excluded"] += 1
                    continue
                record = {"prompt_len": lead_in, "input_ids": chunk, "group": f"file:{path}", "source": "text"}
                sink.write(json.dumps(record) + "\n")
                counts["sequences"] += 1
                counts["tokens"] += len(chunk)
            if max_tokens is not None and counts["tokens"] >= max_tokens:
                break
    return counts
