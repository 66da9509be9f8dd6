"""The DSpark Markov head at runtime: choosing each block row's candidate after the token drafted before it.

A DSpark draft's backbone gives every block row base logits U_k over the vocabulary (the anchor row
predicts too). The vanilla Markov head adds a low-rank bias from the token drafted before the row,
bias(x)[v] = <W1[x], W2[v]>, which makes the block semi-autoregressive: x_{-1} is the anchor (the
request's newest committed token) and x_k = argmax(U_k + bias(x_{k-1})).

Two ways to compute that walk (docs/draft-format.md has the head's I/O):

- dense walk (`top_k == 0`, what `dflash export` asks for): per position, the full [V] bias of the
  token before (over the draft vocabulary's columns where the draft has one). Exact, and one head call
  per position, batched over every request that drafts that position.
- Top-K lattice (`top_k > 0`): each row keeps the K tokens with the highest base logits; one head
  call scores every edge between a row's candidates and the candidates of the row before (the anchor
  for the first row), for all packed block rows of all requests at once; then a greedy walk in numpy
  takes, row by row, the best candidate after the token before. It equals the dense walk whenever the
  dense winner is among the row's K candidates.

A position whose previous token is not among the candidates the lattice scored after ends the block
there: the lattice has no edge for it. (The greedy walk always chains a scored candidate; the rule
guards the walk against lattices built otherwise.)

Under sampling with sampled proposals, both walks draw instead of taking the argmax: row k's token is
drawn from the request's filtered distribution (temperature, top-k, top-p) of U_k + bias(x_{k-1}), with
x_{k-1} the token drawn for the row before, over the vocabulary (dense walk) or over the row's K lattice
candidates (Top-K lattice). That distribution, which the Markov bias of the drawn token shaped, is what
speculative sampling verifies the candidate against (`Proposal.probs`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import openvino as ov

from dflash.core.draft_format import (
    DENSE_INPUTS,
    DENSE_OUTPUT,
    MARKOV_HEAD_FILE,
    TOPK_INPUTS,
    TOPK_OUTPUT,
    markov_head_part,
    read_draft_metadata,
    read_rt_info,
)
from dflash.core.draft_format import SUPPORTED_MARKOV_HEAD_TYPES as SUPPORTED_HEAD_TYPES

from .config import SamplingParams, compile_properties
from .drafter import Proposal
from .errors import InputError, ModelFormatError
from .paged import RequestTensors
from .sampler import DRAFT_STREAM, draw, filtered_probs, uniform

# The dense walk's bias rows of recent tokens are kept (`markov_bias`): a row is a rank-r product over the
# draft vocabulary (32 x 8,192 for the default DSpark draft: 22 us), a kept one a lookup, and drafted text
# repeats its tokens. At most this many bytes of rows: 512 rows of 8,192 columns.
BIAS_CACHE_BYTES = 16 << 20

Sampling = tuple[SamplingParams, int, int]  # a request whose candidates are drawn: its params, key, first candidate's position

_REEXPORT_HINT = "re-export the draft with `dflash export` (it writes the Markov head next to the backbone)"


class _HeadPart:
    """One compiled part of the head and its infer request, whose own tensors take the inputs in place."""

    def __init__(self, compiled: ov.CompiledModel):
        self.request = compiled.create_infer_request()
        self.tensors = RequestTensors(self.request, compiled)


class MarkovHeadRunner:
    """The dense and Top-K parts of a vanilla Markov head (in numpy on its W1/W2, or compiled: `head_tables`),
    and the candidate walks on them.

    `seconds` adds up the time spent in the two parts, in numpy or inference (the engine counts it in the
    draft's time, since `select_candidates` runs inside the draft step).
    """

    def __init__(self, head: ov.Model | str | Path, *, device: str = "CPU", ov_config: dict[str, str] | None = None):
        model = head if isinstance(head, ov.Model) else _read_head(Path(head))
        head_type = read_rt_info(model, "markov_head", "type") or "vanilla"
        if head_type not in SUPPORTED_HEAD_TYPES:
            raise ModelFormatError(
                f"the Markov head is of type {head_type!r}; only the vanilla head is supported",
                "use a DSpark draft trained with markov_head_type 'vanilla'",
            )
        # Both parts in numpy where they are the plain products of the head's W1/W2 (`head_tables`): a
        # position's bias over a draft vocabulary, or a lattice's [R, K, K] edges, are a few hundred rank-r
        # dot products, which cost less than an inference call's overhead (at c=1 on a 2-core AVX2 CPU,
        # 0.02 ms against 0.17-0.32 ms for the edges). A head built otherwise is compiled.
        self._tables = head_tables(model)
        self._dense = self._topk = None
        if self._tables is None:
            config = _head_config(device, ov_config)
            core = ov.Core()
            self._dense = _HeadPart(core.compile_model(markov_head_part(model, "dense"), device, config))
            self._topk = _HeadPart(core.compile_model(markov_head_part(model, "topk"), device, config))
        # (vocab_ids, W2[vocab_ids] transposed to [r, V'] and contiguous): a row's bias is then one pass
        # over a [r, V'] table (a third faster than over W2's [V', r] rows, measured cold at c=1)
        self._w2t: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        # token -> its bias row over those columns, least recently used first (`markov_bias`)
        self._bias_rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._max_bias_rows = 0
        self.vocab_size = _shape_or_rt_info(model, "markov_bias", -1, "vocab_size")
        self.rank = int(read_rt_info(model, "markov_head", "rank") or 0)
        default_k = read_rt_info(model, "markov_head", "top_k")  # the export's walk: 0 dense, K > 0 a lattice
        self.default_top_k = min(int(default_k), self.vocab_size) if default_k is not None else 0
        self.seconds = 0.0
        self.num_calls = 0

    # ---- the two parts ----------------------------------------------------------------------------

    def markov_bias(self, prev_token_ids: np.ndarray, vocab_ids: np.ndarray | None = None) -> np.ndarray:
        """Dense part: [N] previous tokens -> [N, V] f32 bias W2 · W1[prev]; with `vocab_ids`, only
        those columns ([N, len(vocab_ids)]: a draft vocabulary's). In numpy, the rows of recent tokens
        are kept (`BIAS_CACHE_BYTES`; 80-85% of the rows a walk asks for on HumanEval at c=1 and 8) and
        every call returns a new array."""
        prev = np.asarray(prev_token_ids).reshape(-1)
        if self._tables is None:
            bias = self._infer(self._dense, {DENSE_INPUTS[0]: prev})
            return bias if vocab_ids is None else bias[:, vocab_ids]
        start = time.perf_counter()
        w1, w2 = self._tables
        if self._w2t[1] is None or self._w2t[0] is not vocab_ids:  # the same array (or None) every step
            self._w2t = (vocab_ids, np.ascontiguousarray((w2 if vocab_ids is None else w2[vocab_ids]).T))
            self._bias_rows.clear()
            self._max_bias_rows = max(1, BIAS_CACHE_BYTES // (4 * self._w2t[1].shape[1]))
        rows = self._bias_rows
        tokens = prev.tolist()
        missing = [t for t in dict.fromkeys(tokens) if t not in rows]
        if missing:
            for token, row in zip(missing, w1[missing] @ self._w2t[1]):
                rows[token] = row.copy()  # a view would keep the whole product alive while one row is kept
        bias = np.stack([rows[t] for t in tokens]) if tokens else np.zeros((0, self._w2t[1].shape[1]), np.float32)
        for token in tokens:  # a copy above: the walk adds the base logits into it in place
            rows.move_to_end(token)
        while len(rows) > self._max_bias_rows:
            rows.popitem(last=False)
        self._book(start)
        return bias

    def edge_scores(self, prev_candidate_ids: np.ndarray, candidate_ids: np.ndarray) -> np.ndarray:
        """Top-K part: [R, Kp] and [R, K] token ids -> [R, Kp, K] f32 edge scores <W1[prev], W2[cand]>."""
        if self._tables is None:
            prev_name, cand_name = TOPK_INPUTS
            return self._infer(self._topk, {prev_name: np.asarray(prev_candidate_ids), cand_name: np.asarray(candidate_ids)})
        start = time.perf_counter()
        w1, w2 = self._tables
        edges = np.matmul(w1[prev_candidate_ids], w2[candidate_ids].transpose(0, 2, 1))
        self._book(start)
        return edges

    def _book(self, start: float) -> None:
        """Count one call of a part (numpy or inference) that began at `start`."""
        self.seconds += time.perf_counter() - start
        self.num_calls += 1

    def _infer(self, part: _HeadPart, inputs: dict[str, np.ndarray]) -> np.ndarray:
        start = time.perf_counter()
        for name, values in inputs.items():
            part.tensors.write(name, values)
        part.request.start_async()  # then wait: infer() would convert every input and copy every output
        part.request.wait()
        out = part.request.get_output_tensor(0).data.copy()
        self._book(start)
        return out

    # ---- candidate selection --------------------------------------------------------------------------

    def resolve_top_k(self, top_k: int | None) -> int:
        """The K to use: None -> the export's (rt_info markov_head/top_k); 0 -> 0 (the dense walk, exact);
        else min(top_k, V) (the Top-K lattice).

        `dflash export` writes 0: with the default DSpark draft on the first 40 HumanEval prompts (c=8,
        7 candidates) the dense walk accepted tau 3.94 where the lattice of K 8 (the K exports wrote
        before) accepted 3.34, K 16 3.56 and K 32 3.70: the head's bias often raises a token outside the
        backbone's best K. Over a draft vocabulary it costs about what the lattice does."""
        if top_k is None:
            return self.default_top_k
        if top_k < 0:
            raise InputError(f"markov_head_top_k must be >= 0, got {top_k}", "0 selects the dense Markov walk")
        return min(top_k, self.vocab_size)

    def select_candidates(
        self,
        base_logits_per_request: Sequence[np.ndarray],
        anchors: Sequence[int],
        top_k: int,
        sampling: Sequence[Sampling | None] | None = None,
        vocab_ids: np.ndarray | None = None,
    ) -> list[list[int] | Proposal]:
        """The drafted tokens of each request: its candidate rows' base logits [K_r, V] and its anchor
        (the token before the first candidate row) in, K_r tokens (fewer where a block ends) out.

        `vocab_ids`: a draft with a draft vocabulary gives base logits over those target tokens only
        ([K_r, len(vocab_ids)]); the walks stay inside them and return target ids.

        `top_k` 0 runs the dense walk, > 0 the Top-K lattice with that K (see `resolve_top_k`).
        `sampling`, per request: None walks the argmax; (params, key, position) draws each token (row r
        with the request's uniform at output position position + r) and returns a Proposal that holds
        the distributions drawn from.
        """
        sampling = list(sampling) if sampling is not None else [None] * len(base_logits_per_request)
        if len(sampling) != len(base_logits_per_request):
            raise ValueError("one sampling entry per request is needed")
        if len(base_logits_per_request) != len(anchors):
            raise ValueError("one anchor per request is needed")
        width = self.vocab_size if vocab_ids is None else len(vocab_ids)
        for logits in base_logits_per_request:
            if logits.ndim != 2 or (len(logits) and logits.shape[1] != width):
                raise ModelFormatError(
                    f"the draft's logits have shape {list(logits.shape)}, the Markov head expects {width} per row",
                    "use the Markov head exported with this draft, for this target",
                )
        if top_k == 0:
            return self._dense_walk(base_logits_per_request, anchors, sampling, vocab_ids)
        return self._lattice_walk(base_logits_per_request, anchors, min(top_k, width), sampling, vocab_ids)

    def _dense_walk(self, base: Sequence[np.ndarray], anchors: Sequence[int], sampling: Sequence[Sampling | None],
                    vocab_ids: np.ndarray | None) -> list[list[int] | Proposal]:  # fmt: skip
        drafted: list[list[int]] = [[] for _ in base]
        probs: list[list] = [[] for _ in base]
        for position in range(max((len(u) for u in base), default=0)):
            active = [i for i, u in enumerate(base) if len(u) > position]
            prev = [drafted[i][-1] if position else anchors[i] for i in active]
            logits = self.markov_bias(np.asarray(prev, dtype=np.int64), vocab_ids)  # one call for every request here
            for row, i in enumerate(active):
                logits[row] += base[i][position]
            picks = logits.argmax(axis=1)
            for row, i in enumerate(active):
                if sampling[i] is None:
                    index = int(picks[row])
                else:
                    params, key, first = sampling[i]
                    q = filtered_probs(logits[row], params)
                    probs[i].append(q if vocab_ids is None else (vocab_ids, q))
                    index = draw(uniform(key, first + position, DRAFT_STREAM), q)
                drafted[i].append(index if vocab_ids is None else int(vocab_ids[index]))
        return [_proposal(tokens, rows, how, self.vocab_size) for tokens, rows, how in zip(drafted, probs, sampling)]

    def _lattice_walk(self, base: Sequence[np.ndarray], anchors: Sequence[int], k: int, sampling: Sequence[Sampling | None],
                      vocab_ids: np.ndarray | None) -> list[list[int] | Proposal]:  # fmt: skip
        lattices = build_lattices(base, anchors, k, vocab_ids)
        lattices_with_rows = [lat for lat in lattices if lat.num_rows]
        if not lattices_with_rows:
            return [_proposal([], [], how, self.vocab_size) for how in sampling]
        edges = self.edge_scores(
            np.concatenate([lat.prev_candidate_ids for lat in lattices_with_rows]),
            np.concatenate([lat.candidate_ids for lat in lattices_with_rows]),
        )  # [sum K_r, K, K]: one call for every block row of every request
        drafted, row = [], 0
        for lat, anchor, how in zip(lattices, anchors, sampling):
            lattice_edges = edges[row : row + lat.num_rows]
            if how is None:
                drafted.append(greedy_lattice_walk(lat, lattice_edges, anchor))
            else:
                tokens, probs = sampled_lattice_walk(lat, lattice_edges, anchor, *how)
                drafted.append(_proposal(tokens, probs, how, self.vocab_size))
            row += lat.num_rows
        return drafted


# ---- the lattice, in numpy -------------------------------------------------------------------------


class Lattice:
    """One request's Top-K lattice: per candidate row its K candidates, their base logits, and the
    tokens scored before them (the anchor, repeated to width K, for the first row)."""

    def __init__(self, candidate_ids: np.ndarray, candidate_logits: np.ndarray, prev_candidate_ids: np.ndarray):
        self.candidate_ids = candidate_ids  # [K_r, K] i64, best base logit first
        self.candidate_logits = candidate_logits  # [K_r, K] f32
        self.prev_candidate_ids = prev_candidate_ids  # [K_r, K] i64

    @property
    def num_rows(self) -> int:
        return len(self.candidate_ids)


_ARGMAX_TOP_K = 16  # up to this K, K argmax passes (above: a stable sort)


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """[rows, V] -> [rows, k] ids of the k highest logits per row, highest first (ties: lower id first,
    at the k-th place too: the first k of a stable sort)."""
    return top_k_with_values(np.array(logits), k)[0]


def top_k_with_values(scratch: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`top_k_candidates` of `scratch` [rows, V], and their logits [rows, k]; `scratch` is overwritten.

    For a small K, K passes of argmax (each takes the highest left, the lowest id among equals) whose
    picked entries drop to -inf: on a DSpark b7 draft's [7, 8192] candidate rows with K 8, 0.07 ms
    against 0.6 ms for numpy's argpartition (which also picked arbitrarily among the entries tied at
    the k-th place). Where a pick is not a number above -inf (a NaN, which argmax takes first, or a row
    with fewer than K entries above -inf), the passes are undone and a stable sort decides."""
    if k <= _ARGMAX_TOP_K:
        rows = np.arange(len(scratch))
        ids = np.empty((len(scratch), k), dtype=np.int64)
        values = np.empty((len(scratch), k), dtype=scratch.dtype)
        for j in range(k):
            ids[:, j] = best = scratch.argmax(axis=1)
            values[:, j] = scratch[rows, best]
            scratch[rows, best] = -np.inf
        if (values > -np.inf).all():
            return ids, values
        for j in reversed(range(k)):  # the input back, entry by entry (a pass may have taken an entry twice)
            scratch[rows, ids[:, j]] = values[:, j]
    ids = np.argsort(-scratch, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(scratch, ids, axis=1)


def build_lattice(base_logits: np.ndarray, anchor: int, k: int, vocab_ids: np.ndarray | None = None) -> Lattice:
    """The lattice of one request: base logits [K_r, V] of its candidate rows, its anchor token.
    With `vocab_ids`, the logits cover those target tokens only and the lattice holds their target ids."""
    return build_lattices([base_logits], [anchor], k, vocab_ids)[0]


def build_lattices(base_logits: Sequence[np.ndarray], anchors: Sequence[int], k: int,
                   vocab_ids: np.ndarray | None = None) -> list[Lattice]:  # fmt: skip
    """`build_lattice` for several requests, their Top-K candidates found in one pass over all their rows."""
    counts = [len(u) for u in base_logits]
    if not sum(counts):
        empty = np.zeros((0, k), dtype=np.int64)
        return [Lattice(empty, np.zeros((0, k), dtype=np.float32), empty) for _ in counts]
    logits = np.concatenate([u for u in base_logits if len(u)])  # a copy: the Top-K passes overwrite it
    columns, candidate_logits = top_k_with_values(logits, k)
    candidates = columns if vocab_ids is None else vocab_ids[columns].astype(np.int64)
    prev = np.empty_like(candidates)
    prev[1:] = candidates[:-1]  # each row's predecessors: the row before's candidates, ...
    starts = np.cumsum([0, *counts[:-1]])
    has_rows = np.asarray(counts) > 0
    prev[starts[has_rows]] = np.asarray(anchors, dtype=np.int64)[has_rows, None]  # ... or a first row's anchor
    bounds = list(zip(starts, starts + counts))
    return [Lattice(candidates[a:b], candidate_logits[a:b], prev[a:b]) for a, b in bounds]


def greedy_lattice_walk(lattice: Lattice, edge_scores: np.ndarray, anchor: int) -> list[int]:
    """Row by row, the candidate with the best base logit + edge score after the token drafted before
    (the anchor for the first row). Ends where that token is not among the row's scored predecessors."""
    drafted: list[int] = []
    prev_token = anchor
    for row in range(lattice.num_rows):
        slots = np.flatnonzero(lattice.prev_candidate_ids[row] == prev_token)
        if len(slots) == 0:
            break  # no edge leaves the previous token: the block ends here
        scores = lattice.candidate_logits[row] + edge_scores[row, slots[0]]
        prev_token = int(lattice.candidate_ids[row, int(np.argmax(scores))])
        drafted.append(prev_token)
    return drafted


def sampled_lattice_walk(lattice: Lattice, edge_scores: np.ndarray, anchor: int, params: SamplingParams, key: int,
                         position: int) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:  # fmt: skip
    """The greedy walk's draws: row by row, a candidate drawn from the request's filtered distribution
    of base logit + edge score after the token drawn before, over the row's K candidates (row r with
    the request's uniform at output position position + r). Returns the tokens and, per row,
    (candidate ids [K], their probabilities [K])."""
    drafted: list[int] = []
    probs: list[tuple[np.ndarray, np.ndarray]] = []
    prev_token = anchor
    for row in range(lattice.num_rows):
        slots = np.flatnonzero(lattice.prev_candidate_ids[row] == prev_token)
        if len(slots) == 0:
            break
        q = filtered_probs(lattice.candidate_logits[row] + edge_scores[row, slots[0]], params)
        prev_token = int(lattice.candidate_ids[row, draw(uniform(key, position + row, DRAFT_STREAM), q)])
        drafted.append(prev_token)
        probs.append((lattice.candidate_ids[row], q))
    return drafted, probs


def _proposal(tokens: list[int], probs: list, sampling: Sampling | None, vocab_size: int) -> list[int] | Proposal:
    """A walk's tokens as they go to the drafter: plain for the argmax walk, a Proposal holding the
    [len, V] distributions drawn from (rows given dense, or as (ids, probabilities)) for a sampled one."""
    if sampling is None:
        return tokens
    dense = np.zeros((len(tokens), vocab_size), dtype=np.float64)
    for i, row in enumerate(probs):
        if isinstance(row, tuple):
            dense[i, row[0]] = row[1]
        else:
            dense[i] = row
    return Proposal(tokens, dense)


# ---- loading ----------------------------------------------------------------------------------------


def load_markov_head(
    draft_dir: str | Path,
    draft_model: ov.Model,
    *,
    device: str = "CPU",
    ov_config: dict[str, str] | None = None,
    vocab_size: int | None = None,
) -> MarkovHeadRunner | None:
    """The Markov head of an exported draft, or None when its rt_info says markov_rank 0.

    Raises ModelFormatError for a head type other than vanilla, a missing head file, or a head whose
    vocabulary differs from `vocab_size` (the target's, when given).
    """
    meta = read_draft_metadata(draft_model)
    if meta.markov_rank <= 0:
        return None
    if meta.markov_head_type not in SUPPORTED_HEAD_TYPES:
        raise ModelFormatError(
            f"the draft's Markov head is of type {meta.markov_head_type!r}; only the vanilla head is supported",
            "use a DSpark draft trained with markov_head_type 'vanilla'",
        )
    path = Path(draft_dir) / MARKOV_HEAD_FILE
    if not path.is_file():
        raise ModelFormatError(
            f"the draft has markov_rank {meta.markov_rank} but {draft_dir} has no {MARKOV_HEAD_FILE}",
            _REEXPORT_HINT,
        )
    head = MarkovHeadRunner(path, device=device, ov_config=ov_config)
    if head.rank and head.rank != meta.markov_rank:
        raise ModelFormatError(
            f"the Markov head has rank {head.rank}, the draft's rt_info says {meta.markov_rank}", _REEXPORT_HINT
        )
    if vocab_size is not None and head.vocab_size != vocab_size:
        raise ModelFormatError(
            f"the Markov head covers {head.vocab_size} tokens, the target's vocabulary has {vocab_size}",
            "use a DSpark draft trained for this target",
        )
    return head


def head_tables(head: ov.Model) -> tuple[np.ndarray, np.ndarray] | None:
    """W1 and W2 ([V, r] f32) of a head whose parts are the plain products over them, as `dflash export`
    writes it: markov_bias = MatMul(Gather(W1, prev_token_ids), W2, transpose_b) and edge_scores =
    MatMul(Gather(W1, prev_candidate_ids), Gather(W2, candidate_ids), transpose_b), over constant tables
    (f32, or f16/bf16 widened). None for a head built otherwise: the engine then compiles its parts."""
    bias, edges = _product_inputs(head, DENSE_OUTPUT), _product_inputs(head, TOPK_OUTPUT)
    if bias is None or edges is None:
        return None
    w1, w2 = _gathered_table(bias[0], DENSE_INPUTS[0]), _constant_table(bias[1])
    e1, e2 = _gathered_table(edges[0], TOPK_INPUTS[0]), _gathered_table(edges[1], TOPK_INPUTS[1])
    if any(t is None for t in (w1, w2, e1, e2)) or not (np.array_equal(w1, e1) and np.array_equal(w2, e2)):
        return None
    return w1, w2


def _product_inputs(head: ov.Model, output: str) -> list | None:
    """The two input nodes of the MatMul(transpose_b) that makes `output`, or None."""
    node = head.output(output).get_node().input_value(0).get_node()
    if node.get_type_name() != "MatMul" or node.get_attributes() != {"transpose_a": False, "transpose_b": True}:
        return None
    return [node.input_value(i).get_node() for i in range(2)]


def _constant_table(node) -> np.ndarray | None:
    if node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Constant" or len(node.get_output_shape(0)) != 2:
        return None
    return np.ascontiguousarray(node.get_data(), dtype=np.float32)


def _gathered_table(node, input_name: str) -> np.ndarray | None:
    """The table of Gather(table, the input `input_name`, axis 0), or None."""
    if node.get_type_name() != "Gather" or node.get_attributes().get("batch_dims", 0) != 0:
        return None
    table, indices, axis = (node.input_value(i).get_node() for i in range(3))
    while indices.get_type_name() == "Convert":
        indices = indices.input_value(0).get_node()
    if indices.get_type_name() != "Parameter" or indices.output(0).get_any_name() != input_name:
        return None
    if axis.get_type_name() != "Constant" or int(np.asarray(axis.get_data()).reshape(-1)[0]) != 0:
        return None
    return _constant_table(table)


def _read_head(path: Path) -> ov.Model:
    if not path.is_file():
        raise ModelFormatError(f"no Markov head at {path}", _REEXPORT_HINT)
    return ov.Core().read_model(path)


def _head_config(device: str, ov_config: dict[str, str] | None) -> dict[str, str]:
    """The engine's compile options, with f32 inference on CPU unless the caller chose a precision:
    the head's weights are kept f32 on purpose (its bias decides between close candidates), and a
    bf16 MatMul would round them away. Its cost is small next to the backbone's."""
    config = compile_properties(ov_config)
    if device.upper().startswith("CPU"):
        config.setdefault("INFERENCE_PRECISION_HINT", "f32")
    return config


def _shape_or_rt_info(model: ov.Model, output: str, axis: int, key: str) -> int:
    """A static output dimension (the head's V), else the rt_info value that records it."""
    dim = model.output(output).get_partial_shape()[axis]
    if dim.is_static:
        return dim.get_length()
    value = read_rt_info(model, "markov_head", key)
    if value is None:
        raise ModelFormatError(f"the Markov head does not say its {key}", _REEXPORT_HINT)
    return int(value)
