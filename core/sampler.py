"""Turning logits into tokens: greedy argmax, or temperature / top-k / top-p sampling with a seed.

Speculative decoding is greedy-only here (acceptance compares the draft's tokens with the target's
argmax), so sampling applies to autoregressive requests. Each sampling request owns a numpy
Generator seeded from its `seed`, so a seeded request gives the same text whatever else runs beside it.
"""

from __future__ import annotations

import numpy as np

from .config import SamplingParams


def greedy(logits: np.ndarray) -> np.ndarray:
    """Argmax of each row. # [rows, vocab] -> [rows]"""
    return np.argmax(logits, axis=-1)


class Sampler:
    """Picks the next token of each sampling row; keeps one random generator per request."""

    def __init__(self) -> None:
        self._generators: dict[str, np.random.Generator] = {}

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def sample(self, req_id: str, logits: np.ndarray, params: SamplingParams) -> int:
        """One token from one row of logits. # [vocab] -> int"""
        if params.is_greedy:
            return int(np.argmax(logits))
        generator = self._generators.get(req_id)
        if generator is None:
            generator = self._generators[req_id] = np.random.default_rng(params.seed)
        probs = _filtered_probs(logits.astype(np.float64), params)
        return int(generator.choice(probs.shape[0], p=probs))


def _filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Softmax of logits / temperature, restricted to the top-k and then the top-p nucleus."""
    scaled = logits / params.temperature
    order = np.argsort(-scaled, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    kept = scaled[order]
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cutoff = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:cutoff], probs[:cutoff]
        probs = probs / probs.sum()
    full = np.zeros_like(logits)
    full[order] = probs
    return full
