"""Turning logits into tokens: greedy argmax, or temperature / top-k / top-p sampling with a seed.

`filtered_probs` is the one definition of a request's sampling distribution: softmax of the logits over
the temperature, restricted to the top-k and then to the top-p nucleus. The target alone samples from
it; with a draft, speculative sampling (core/verification.py) compares the target's and the draft's
distributions, both made by it, so that the committed tokens are distributed as the target alone's.

Randomness is keyed by position, not drawn from a stream: each sampling request has a 64-bit key (from
its `seed`, or fresh entropy without one), and the draw of its output token n uses the uniform
`uniform(key, n)` (a counter-based hash), by inverse CDF over the token ids. A token therefore depends
only on the request's key, its position and its distribution: not on what else runs in the step, nor
on how many draws came before. Verification with deterministic proposals uses the very same draws, so
with the same seed a request gives the target alone's own tokens (core/verification.py).
"""

from __future__ import annotations

import numpy as np

from .config import SamplingParams

# Streams of a request's uniforms: the target's token at a position (plain steps, bonus and residual
# draws, and the verification of deterministic proposals), the acceptance tests of sampled proposals,
# and the draft's draws of sampled proposals.
TOKEN_STREAM, ACCEPT_STREAM, DRAFT_STREAM = 0, 1, 2
_MASK64 = (1 << 64) - 1


def greedy(logits: np.ndarray) -> np.ndarray:
    """Argmax of each row. # [rows, vocab] -> [rows]"""
    return np.argmax(logits, axis=-1)


def request_key(seed: int | None) -> int:
    """A request's 64-bit key: from its seed, or from fresh entropy without one."""
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0])


def uniform(key: int, position: int, stream: int = TOKEN_STREAM) -> float:
    """The uniform in [0, 1) of a request's draw at `position` (an output token index) in `stream`:
    SplitMix64's output function over a counter made of the key, the stream and the position."""
    z = (key + stream * 0xD1B54A32D192ED03 + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


class Sampler:
    """Picks the next token of each sampling row; keeps each request's key."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # draws made without a position (sample(..., position=None))

    def forget(self, req_id: str) -> None:
        self._keys.pop(req_id, None)
        self._counts.pop(req_id, None)

    def key(self, req_id: str, params: SamplingParams) -> int:
        """The request's key (made from its seed on first use)."""
        key = self._keys.get(req_id)
        if key is None:
            key = self._keys[req_id] = request_key(params.seed)
        return key

    def sample(self, req_id: str, logits: np.ndarray, params: SamplingParams, position: int | None = None) -> int:
        """One token from one row of logits, drawn at output position `position` (None: the next of
        this sampler's own count for the request). # [vocab] -> int"""
        if params.is_greedy:
            return int(np.argmax(logits))
        if position is None:
            position = self._counts[req_id] = self._counts.get(req_id, -1) + 1
        return draw(uniform(self.key(req_id, params), position), filtered_probs(logits, params))


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Softmax of logits / temperature, restricted to the top-k and then the top-p nucleus. # [V] -> [V] f64

    Tokens are ranked by logit, ties by lower id first; the nucleus is the smallest prefix of that
    ranking whose mass reaches top_p (always at least one token). Only the leading part of the
    ranking is sorted (the nucleus is usually small next to the vocabulary).
    """
    scaled = np.divide(logits, params.temperature, dtype=np.float64)
    if params.top_k == 0 and params.top_p >= 1.0:
        return _softmax(scaled)
    vocab = scaled.shape[0]
    if params.top_k > 0:
        kept = _ranked(scaled, min(params.top_k, vocab))[: params.top_k]
        probs = _softmax(scaled[kept])
    else:
        kept, probs = None, _softmax(scaled.copy())
    if params.top_p < 1.0:
        if kept is None:
            kept = _nucleus_of_all(scaled, probs, params.top_p)
            probs = probs[kept]
        cutoff = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        kept, probs = kept[:cutoff], probs[:cutoff]
        probs = probs / probs.sum()
    full = np.zeros(vocab, dtype=np.float64)
    full[kept] = probs
    return full


_filtered_probs = filtered_probs  # the earlier private name


def filtered_probs_rows(logits: np.ndarray, params: SamplingParams, dtype=np.float64) -> np.ndarray:
    """`filtered_probs` of each row, as `dtype` (the draft's distributions are kept as f32: what matters
    is that a candidate is drawn from, and verified against, the same numbers). # [rows, V] -> [rows, V]"""
    if params.top_k == 0 and params.top_p >= 1.0:  # the common case, in one pass over all rows
        scaled = np.multiply(logits, 1.0 / params.temperature, dtype=dtype)
        scaled -= scaled.max(axis=-1, keepdims=True)
        np.exp(scaled, out=scaled)
        scaled /= scaled.sum(axis=-1, keepdims=True, dtype=np.float64).astype(dtype)
        return scaled
    if not len(logits):
        return np.zeros(logits.shape, dtype=dtype)
    return np.stack([filtered_probs(row, params) for row in logits]).astype(dtype, copy=False)


def _softmax(scaled: np.ndarray) -> np.ndarray:
    """Softmax of a f64 vector, computed in place (the vocabulary is large: one pass fewer counts)."""
    scaled -= scaled.max()
    np.exp(scaled, out=scaled)
    scaled /= scaled.sum()
    return scaled


def _ranked(scaled: np.ndarray, n: int) -> np.ndarray:
    """Ids of at least the n highest values, ranked (highest first, ties by lower id): every id whose
    value ties the n-th is included, so the result is a prefix of the full ranking."""
    if n >= scaled.shape[0]:
        return np.lexsort((np.arange(scaled.shape[0]), -scaled))
    threshold = scaled[np.argpartition(-scaled, n - 1)[n - 1]]
    ids = np.flatnonzero(scaled >= threshold)
    return ids[np.lexsort((ids, -scaled[ids]))]


def _nucleus_of_all(scaled: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """A ranked prefix of the vocabulary that holds the top-p nucleus (it may hold more)."""
    n = 64
    while True:
        ranked = _ranked(scaled, n)
        if len(ranked) >= scaled.shape[0] or np.cumsum(probs[ranked])[-1] >= top_p:
            return ranked
        n *= 4


_DRAW_BLOCK = 256  # draws scan block sums, then one block: a cumulative sum over the vocabulary is slow


def draw(u: float, probs: np.ndarray) -> int:
    """The token of uniform u under a distribution given as non-negative weights (normalized here),
    by inverse CDF over the token ids. # [V] -> int"""
    return int(draw_rows(np.array([u]), probs[None])[0])


def draw_rows(us: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Per row, the token of its uniform under its row's weights (inverse CDF over blocks of the
    vocabulary, then within the chosen block). # [rows], [rows, V] -> [rows] i64"""
    rows, vocab = probs.shape
    num_blocks = -(-vocab // _DRAW_BLOCK)
    padded = probs
    if num_blocks * _DRAW_BLOCK != vocab:
        padded = np.zeros((rows, num_blocks * _DRAW_BLOCK), dtype=probs.dtype)
        padded[:, :vocab] = probs
    blocks = padded.reshape(rows, num_blocks, _DRAW_BLOCK)
    block_sums = blocks.sum(axis=-1)  # [rows, num_blocks]
    block_cdf = np.cumsum(block_sums, axis=-1, dtype=np.float64)
    targets = np.asarray(us, dtype=np.float64) * block_cdf[:, -1]
    tokens = np.empty(rows, dtype=np.int64)
    for r in range(rows):
        b = int(np.searchsorted(block_cdf[r], targets[r], side="right"))
        if b >= num_blocks:  # rounding past the total: the last block with weight
            b = int(np.flatnonzero(block_sums[r] > 0)[-1])
        weights = blocks[r, b]
        within = np.cumsum(weights, dtype=np.float64)
        i = int(np.searchsorted(within, targets[r] - (block_cdf[r, b - 1] if b else 0.0), side="right"))
        if i >= _DRAW_BLOCK or weights[i] <= 0:  # rounding past the block's last token: its last one with weight
            i = int(np.flatnonzero(weights > 0)[-1])
        tokens[r] = b * _DRAW_BLOCK + i
    return tokens
