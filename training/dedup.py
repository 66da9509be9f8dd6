"""Deduplication and the hold-out split: an evaluation that cannot leak.

Greedy answers repeat: the same prompt answered twice, or two prompts that differ in a word, give the
same (or nearly the same) answer. If one copy trains and the other is held out, the held-out figure
measures memory. So:

- `dedupe` drops exact duplicates (same answer tokens) and near-duplicates (MinHash over token
  5-gram shingles, locality-sensitive banding, then a check of the estimated Jaccard similarity
  against `threshold`): one representative per cluster survives;
- `split_by_prompt` holds out whole prompt groups (every sequence of a prompt on one side, never by
  sequence), after dedup, so a duplicated answer can never land on both sides.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .data import Example

_MERSENNE = np.uint64((1 << 61) - 1)


@dataclass
class DedupStats:
    sequences: int
    exact_duplicates: int
    near_duplicates: int
    kept: int

    def to_json(self) -> dict[str, int]:
        return {"sequences": self.sequences, "exact_duplicates": self.exact_duplicates,
                "near_duplicates": self.near_duplicates, "kept": self.kept}


def _response(example: Example) -> np.ndarray:
    return np.asarray(example.input_ids[example.prompt_len :], dtype=np.uint64)


def _shingles(tokens: np.ndarray, size: int) -> np.ndarray:
    """Distinct 64-bit hashes of the token `size`-grams (the whole sequence when it is shorter)."""
    if len(tokens) < size:
        size = max(1, len(tokens))
    windows = np.lib.stride_tricks.sliding_window_view(tokens, size)
    powers = np.uint64(1_000_003) ** np.arange(size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return np.unique((windows * powers).sum(axis=1, dtype=np.uint64))


def minhash_signatures(examples: Sequence[Example], num_hashes: int = 64, shingle: int = 5, seed: int = 0) -> np.ndarray:
    """[len(examples), num_hashes] MinHash signatures of each response's token shingles."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 1 << 61, size=num_hashes, dtype=np.uint64)
    b = rng.integers(0, 1 << 61, size=num_hashes, dtype=np.uint64)
    out = np.empty((len(examples), num_hashes), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for row, example in enumerate(examples):
            hashes = _shingles(_response(example), shingle)
            out[row] = ((hashes[:, None] * a[None, :] + b[None, :]) % _MERSENNE).min(axis=0)
    return out


def dedupe(
    examples: Sequence[Example], *, threshold: float = 0.8, num_hashes: int = 64, bands: int = 16
) -> tuple[list[Example], DedupStats]:
    """Examples without exact or near-duplicate answers (first occurrence kept), and what was dropped."""
    seen: set[tuple[int, ...]] = set()
    unique: list[Example] = []
    for example in examples:
        key = example.input_ids[example.prompt_len :]
        if key not in seen:
            seen.add(key)
            unique.append(example)
    exact = len(examples) - len(unique)
    if not unique:
        return [], DedupStats(len(examples), exact, 0, 0)

    signatures = minhash_signatures(unique, num_hashes)
    rows = num_hashes // bands
    buckets: dict[tuple[int, bytes], int] = {}
    keep = np.ones(len(unique), dtype=bool)
    for index in range(len(unique)):
        signature = signatures[index]
        candidates = set()
        for band in range(bands):
            key = (band, signature[band * rows : (band + 1) * rows].tobytes())
            other = buckets.get(key)
            if other is not None:
                candidates.add(other)
        if any(float((signatures[other] == signature).mean()) >= threshold for other in candidates):
            keep[index] = False
            continue
        for band in range(bands):
            buckets.setdefault((band, signature[band * rows : (band + 1) * rows].tobytes()), index)
    kept = [example for example, flag in zip(unique, keep) if flag]
    return kept, DedupStats(len(examples), exact, int((~keep).sum()), len(kept))


def split_by_prompt(
    examples: Sequence[Example], eval_sequences: int, seed: int = 0, *, max_fraction: float = 0.1
) -> tuple[list[Example], list[Example]]:
    """(train, eval): whole prompt groups held out until `eval_sequences` (at most `max_fraction`) are reached.

    Every sequence of a prompt (its `prompt_key`) lands on the same side. Groups are visited in a
    seeded order; the split does not dedupe (call `dedupe` first).
    """
    budget = min(eval_sequences, int(len(examples) * max_fraction))
    if budget <= 0:
        return list(examples), []
    groups: dict[str, list[int]] = {}
    for index, example in enumerate(examples):
        groups.setdefault(example.prompt_key, []).append(index)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    held: set[int] = set()
    for key in keys:
        if len(held) >= budget:
            break
        if len(held) + len(groups[key]) > budget and held:
            continue
        held.update(groups[key])
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [examples[i] for i in sorted(held)]
