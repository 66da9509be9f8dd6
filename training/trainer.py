"""Training a DFlash or DSpark draft against a frozen target: distillation on the target's own predictions.

One step, for a batch of N sequences (a templated prompt and the target's answer, or a stretch of
real text/code with a short lead-in):
1. the target runs once over the batch; its hidden states at `target_layer_ids` (HF index L + 1),
   concatenated, are the context features of every position, and its logits at every position are
   the teacher (what the target itself would say next);
2. K anchors a are drawn per sequence after the lead-in (`prompt_len`); block i is [token a, mask x
   (B-1)] at positions a .. a+B-1 and sees the context before a plus its own block
   (model.blocks_forward);
3. the target's frozen lm_head turns block rows into logits. The i-th prediction of a block is the
   token at a + 1 + i: DFlash (candidate offset 1) predicts from rows 1..B-1, DSpark (offset 0) from
   rows 0..B-1, adding the Markov bias W2·W1[x_{i-1}] with the previous tokens (the anchor, then the
   sequence's tokens);
4. the teacher of prediction i is the target's distribution at a + i. It is what greedy speculative
   decoding verifies against only while the sequence follows the target's own greedy chain, so a
   prediction counts ("on-policy") only when the anchor is the target's argmax at a - 1 and every
   sequence token a+1 .. a+i is the target's argmax before it. On the target's own greedy answers
   that is every prediction; on real text or sampled answers it keeps exactly the blocks whose labels
   a greedy decode would produce (`--no-on-policy` scores everything against the sequence's tokens);
5. loss = ce_weight x cross-entropy to the teacher's argmax + (1 - ce_weight) x a divergence to the
   teacher's distribution (forward KL, or total variation as DSpark), each prediction weighted
   exp(-i/gamma) (gamma 7 for B >= 16, 5 for B >= 10, else 4); AdamW, warm-up then cosine, gradient
   clip 1.0, bf16 autocast on cuda.

Logged per window: loss, per-position accuracy (draft argmax = teacher argmax), tau (mean greedy
acceptance length of a block: leading correct predictions + 1), target tokens per second, and the
held-out tau. Training is resumable: `trainer_state.pt` in the output folder holds the fp32 weights,
the optimizer, the schedule position, the data order and the random state, written every
`save_every_s` seconds and at the end, next to a checkpoint that `dflash export` reads.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from dflash.core.errors import InputError
from dflash.exporters.draft_config import parse_draft_config

from .checkpoint import draft_config_dict, save_trained_draft
from .data import Example
from .model import TrainableDraft
from .target import Target, check_target_layer_ids, choose_mask_token_id, default_target_layer_ids, target_forward

KINDS = ("dflash", "dspark")
LOSSES = ("kl", "tv", "ce")
DEFAULT_BLOCK_SIZE = {"dflash": 16, "dspark": 7}
DEFAULT_MARKOV_RANK = {"dflash": 0, "dspark": 32}
CANDIDATE_OFFSET = {"dflash": 1, "dspark": 0}
STATE_FILE = "trainer_state.pt"
STATE_VERSION = 2


def default_loss_gamma(block_size: int) -> float:
    """The recipe's decay: 7 for B16, 5 for B10, 4 for B8 and smaller blocks (DSpark B7 uses 4)."""
    if block_size >= 16:
        return 7.0
    if block_size >= 10:
        return 5.0
    return 4.0


@dataclass
class TrainOptions:
    """Everything that shapes the draft and its training; None means "the default for the kind"."""

    kind: str = "dflash"
    block_size: int | None = None
    num_layers: int = 1
    markov_rank: int | None = None
    target_layer_ids: list[int] | None = None
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    num_anchors: int = 64
    batch_size: int = 8
    steps: int | None = None  # optimizer steps; None: `epochs` passes over the data
    epochs: float = 1.0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_gamma: float | None = None
    loss: str = "kl"  # divergence to the teacher's distribution: kl, tv, or ce (hard labels only)
    ce_weight: float = 0.1  # share of cross-entropy to the teacher's argmax in the loss
    on_policy: bool = True  # score only predictions on the target's own greedy chain (module docstring)
    max_length: int = 2048
    time_limit_s: float | None = None  # the schedule runs on max(step fraction, training-time fraction)
    seed: int = 0
    log_every: int = 10
    save_dtype: str = "float16"
    max_shard_mb: float | None = None

    def resolved(self) -> "TrainOptions":
        """A copy with the kind's defaults filled in; raises InputError on inconsistent values."""
        if self.kind not in KINDS:
            raise InputError(f"unknown draft kind {self.kind!r}", hint="use --kind dflash or --kind dspark")
        if self.loss not in LOSSES:
            raise InputError(f"unknown loss {self.loss!r}", hint="use --loss kl, tv or ce")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise InputError("--ce-weight must lie between 0 and 1", hint="e.g. --ce-weight 0.1")
        block = self.block_size or DEFAULT_BLOCK_SIZE[self.kind]
        rank = DEFAULT_MARKOV_RANK[self.kind] if self.markov_rank is None else self.markov_rank
        offset = CANDIDATE_OFFSET[self.kind]
        if block < 1 + offset:
            raise InputError(
                f"block size {block} leaves no prediction for a {self.kind} draft",
                hint="a DFlash block counts the seed row: use --block-size 2 or more",
            )
        if self.kind == "dflash" and rank:
            raise InputError(
                "a DFlash draft has no Markov head", hint="use --kind dspark for --markov-rank, or leave it out"
            )
        for name in ("num_layers", "num_anchors", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be at least 1", hint=f"fix --{name.replace('_', '-')}")
        if rank < 0 or (self.steps is not None and self.steps < 1) or self.lr <= 0:
            raise InputError("markov rank, steps and learning rate must be positive", hint="fix the options")
        return TrainOptions(
            **{**asdict(self), "block_size": block, "markov_rank": rank, "loss_gamma": self.loss_gamma or default_loss_gamma(block)}
        )


@dataclass
class Metrics:
    """Loss, per-position accuracy and acceptance, and mean acceptance length over some blocks."""

    loss: float
    accuracy: list[float]  # accuracy[i]: the i-th prediction of a block (token at anchor + 1 + i) is right
    tau: float  # mean (leading correct predictions + 1) per block
    blocks: int
    acceptance: list[float] = field(default_factory=list)  # acceptance[i]: predictions 0..i all right

    def to_json(self) -> dict[str, Any]:
        return {
            "loss": round(self.loss, 5),
            "accuracy": [round(a, 4) for a in self.accuracy],
            "acceptance": [round(a, 4) for a in self.acceptance],
            "tau": round(self.tau, 4),
            "blocks": self.blocks,
        }


@dataclass
class LogEntry:
    step: int
    lr: float
    seconds: float  # training time so far, across resumed sessions
    metrics: Metrics
    tokens: int = 0  # target tokens trained on so far (sequence tokens of every batch)
    tokens_per_second: float = 0.0  # over the log window
    eval: Metrics | None = None  # the held-out set at this step

    def to_json(self) -> dict[str, Any]:
        out = {"step": self.step, "lr": self.lr, "seconds": round(self.seconds, 2), "tokens": self.tokens,
               "tokens_per_second": round(self.tokens_per_second, 1), **self.metrics.to_json()}
        if self.eval is not None:
            out["eval"] = self.eval.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LogEntry":
        def metrics(d: dict[str, Any]) -> Metrics:
            return Metrics(d["loss"], d["accuracy"], d["tau"], d["blocks"], d.get("acceptance", []))

        return cls(data["step"], data["lr"], data["seconds"], metrics(data), data.get("tokens", 0),
                   data.get("tokens_per_second", 0.0), metrics(data["eval"]) if data.get("eval") else None)


@dataclass
class TrainResult:
    """What `train_draft` produced."""

    output_dir: Path
    kind: str
    steps: int
    seconds: float
    mask_token_id: int
    mask_token_reason: str
    target_layer_ids: list[int]
    history: list[LogEntry] = field(default_factory=list)
    eval_before: Metrics | None = None
    eval_after: Metrics | None = None
    total_steps: int = 0
    tokens: int = 0
    finished: bool = True  # False when the session stopped (stop_after_s) before the schedule ended
    resumed_from_step: int = 0
    model: TrainableDraft | None = field(default=None, repr=False)  # the trained draft, in eval mode

    def to_json(self) -> dict[str, Any]:
        return {
            "output_dir": str(self.output_dir),
            "kind": self.kind,
            "steps": self.steps,
            "total_steps": self.total_steps,
            "finished": self.finished,
            "resumed_from_step": self.resumed_from_step,
            "seconds": round(self.seconds, 2),
            "tokens": self.tokens,
            "mask_token_id": self.mask_token_id,
            "mask_token_reason": self.mask_token_reason,
            "target_layer_ids": self.target_layer_ids,
            "eval_before": self.eval_before.to_json() if self.eval_before else None,
            "eval_after": self.eval_after.to_json() if self.eval_after else None,
            "last_log": self.history[-1].to_json() if self.history else None,
        }


# ------------------------------------------------------------------------------------------------
# Batches and blocks


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, T] right-padded
    lengths: torch.Tensor  # [N]
    anchors: torch.Tensor  # [N, K]
    anchor_valid: torch.Tensor  # [N, K] False for padding anchors of short responses


def make_batch(examples: Sequence[Example], num_anchors: int, pad_id: int, rng: random.Random) -> Batch:
    """Pad `examples` and draw up to `num_anchors` distinct anchors per sequence inside its response.

    An anchor a is a response position with at least one token after it: prompt_len <= a <= length - 2
    (the first response token is the first seed/anchor the draft ever sees).
    """
    width = max(len(e.input_ids) for e in examples)
    candidates = [range(e.prompt_len, len(e.input_ids) - 1) for e in examples]
    k = max(1, min(num_anchors, max(len(c) for c in candidates)))
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    anchors = torch.zeros((len(examples), k), dtype=torch.long)
    anchor_valid = torch.zeros((len(examples), k), dtype=torch.bool)
    for row, (example, positions) in enumerate(zip(examples, candidates)):
        input_ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        chosen = sorted(rng.sample(positions, min(k, len(positions))))
        anchors[row, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        anchors[row, len(chosen) :] = example.prompt_len  # padding blocks: computed, never scored
        anchor_valid[row, : len(chosen)] = True
    lengths = torch.tensor([len(e.input_ids) for e in examples])
    return Batch(input_ids, lengths, anchors, anchor_valid)


def block_labels(batch: Batch, num_predictions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """labels [N, K, P] (token at anchor + 1 + i), valid [N, K, P], previous tokens [N, K, P] (at anchor + i)."""
    offsets = torch.arange(num_predictions, device=batch.anchors.device)
    label_pos = batch.anchors[..., None] + 1 + offsets
    valid = batch.anchor_valid[..., None] & (label_pos < batch.lengths[:, None, None])
    width = batch.input_ids.shape[1]
    flat = batch.input_ids[:, None, :].expand(-1, batch.anchors.shape[1], -1)
    labels = torch.gather(flat, 2, label_pos.clamp(max=width - 1))
    previous = torch.gather(flat, 2, (label_pos - 1).clamp(max=width - 1))
    return labels, valid, previous


class BatchOrder:
    """Endless shuffled passes over `count` examples, resumable: (epoch, position) and the shuffle seed."""

    def __init__(self, count: int, batch_size: int, seed: int, epoch: int = 0, position: int = 0):
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.epoch, self.position = epoch, position
        self._order = self._shuffled(epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.count))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> list[int]:
        if self.position >= self.count:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffled(self.epoch)
        chosen = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return chosen

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "count": self.count}


def batch_iterator(examples: Sequence[Example], batch_size: int, rng: random.Random) -> Iterator[list[Example]]:
    """Endless shuffled passes over `examples` (the last short batch of a pass is kept)."""
    order = BatchOrder(len(examples), batch_size, rng.randrange(2**31))
    while True:
        yield [examples[i] for i in order.next()]


# ------------------------------------------------------------------------------------------------
# Loss


@dataclass
class StepOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [N, K, P] bool (False where not valid)
    valid: torch.Tensor  # [N, K, P] bool
    ce_sum: torch.Tensor  # weighted loss sum and weight sum, to average over a log window
    weight_sum: torch.Tensor
    tokens: int = 0  # real tokens in the batch


def teacher_chain(
    batch: Batch, teacher_argmax: torch.Tensor, num_predictions: int, on_policy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, valid, previous) [N, K, P] of the predictions scored against the teacher.

    The label of prediction i is the teacher's argmax at a + i (the token the target picks after the
    sequence up to a + i). With `on_policy`, prediction i is valid only while the anchor and the
    sequence's tokens a+1 .. a+i are each the teacher's argmax before them (see the module docstring);
    without it, the labels are the sequence's own next tokens and every prediction inside it counts.
    """
    seq_labels, valid, previous = block_labels(batch, num_predictions)
    if not on_policy:
        return seq_labels, valid, previous
    n, t = batch.input_ids.shape
    device = batch.input_ids.device
    positions = batch.anchors[..., None] + torch.arange(num_predictions, device=device)  # a + i
    flat_argmax = teacher_argmax[:, None, :].expand(-1, batch.anchors.shape[1], -1)
    labels = torch.gather(flat_argmax, 2, positions.clamp(max=t - 1))
    # follows[j]: the sequence token at a+1+j is the teacher's argmax at a+j (the chain continues).
    follows = labels == seq_labels
    before_anchor = torch.gather(teacher_argmax, 1, (batch.anchors - 1).clamp(min=0))
    anchor_ids = torch.gather(batch.input_ids, 1, batch.anchors)
    anchor_ok = (before_anchor == anchor_ids) & (batch.anchors > 0)
    # Prediction i needs the chain through a+i: anchor_ok and follows[0..i-1]; it must lie inside the sequence.
    chain = torch.cat([anchor_ok[..., None], follows[..., :-1]], dim=-1).long().cumprod(dim=-1).bool()
    inside = batch.anchor_valid[..., None] & (positions < batch.lengths[:, None, None])
    return labels, chain & inside, previous


def compute_loss(
    draft: TrainableDraft,
    target: Target,
    batch: Batch,
    *,
    kind: str,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    gamma: float,
    loss: str = "kl",
    ce_weight: float = 0.1,
    on_policy: bool = True,
) -> StepOutput:
    """The weighted block loss of one batch (see the module docstring)."""
    device = target.device
    batch = Batch(*(t.to(device) for t in (batch.input_ids, batch.lengths, batch.anchors, batch.anchor_valid)))
    block_size = draft.config.block_size
    offset = CANDIDATE_OFFSET[kind]
    num_predictions = block_size - offset

    features, final_hidden = target_forward(target, batch.input_ids, target_layer_ids)
    with torch.no_grad():
        teacher_argmax = _chunked_argmax(target, final_hidden)
    labels, valid, previous = teacher_chain(batch, teacher_argmax, num_predictions, on_policy)
    anchor_ids = torch.gather(batch.input_ids, 1, batch.anchors)
    block_ids = torch.full((*batch.anchors.shape, block_size), mask_token_id, dtype=torch.long, device=device)
    block_ids[..., 0] = anchor_ids
    with torch.no_grad():
        block_embeds = target.embed(block_ids)

    rows = valid.nonzero(as_tuple=True)
    with _autocast(device):
        hidden = draft(features, block_embeds, batch.anchors)[:, :, offset:]  # [N, K, P, H]
        logits = target.lm_head(hidden[rows]).float()  # only the rows that are scored
        if draft.markov_head is not None:
            logits = logits + draft.markov_head(previous[rows]).float()
    row_labels = labels[rows]
    student_logp = logits.log_softmax(-1)
    per_row = -student_logp.gather(-1, row_labels[:, None]).squeeze(-1)  # cross-entropy to the teacher's argmax
    if loss != "ce" and ce_weight < 1.0:
        with torch.no_grad():
            teacher_pos = (batch.anchors[..., None] + torch.arange(num_predictions, device=device))[rows]
            teacher_logp = target.lm_head(final_hidden[rows[0], teacher_pos]).float().log_softmax(-1)
            teacher_p = teacher_logp.exp()
            entropy = -(teacher_p * teacher_logp).sum(-1)
            del teacher_logp
        if loss == "kl":  # KL(teacher || draft) = soft cross-entropy - the teacher's entropy (no gradient)
            divergence = -(teacher_p * student_logp).sum(-1) - entropy
        else:  # total variation
            divergence = 0.5 * (teacher_p - student_logp.exp()).abs().sum(-1)
        per_row = ce_weight * per_row + (1.0 - ce_weight) * divergence
    weights = torch.exp(-rows[2].float() / gamma)
    ce_sum = (per_row * weights).sum()
    weight_sum = weights.sum()
    total = ce_sum / weight_sum.clamp(min=1e-8)
    correct = torch.zeros_like(valid)
    correct[rows] = logits.argmax(dim=-1) == row_labels
    return StepOutput(total, correct, valid, ce_sum.detach(), weight_sum.detach(), int(batch.lengths.sum()))


def _chunked_argmax(target: Target, final_hidden: torch.Tensor, rows_per_chunk: int = 8192) -> torch.Tensor:
    """The teacher's argmax [N, T] at every position, without holding all [N, T, V] logits at once."""
    n, t, h = final_hidden.shape
    flat = final_hidden.reshape(n * t, h)
    out = torch.empty(n * t, dtype=torch.long, device=final_hidden.device)
    for first in range(0, n * t, rows_per_chunk):
        out[first : first + rows_per_chunk] = target.lm_head(flat[first : first + rows_per_chunk]).argmax(-1)
    return out.view(n, t)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


class MetricWindow:
    """Sums over steps, turned into Metrics on demand."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ce = 0.0
        self.weight = 0.0
        self.correct: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.accepted: torch.Tensor | None = None
        self.tau_sum = 0.0
        self.blocks = 0
        self.tokens = 0

    def add(self, out: StepOutput) -> None:
        self.ce += float(out.ce_sum)
        self.weight += float(out.weight_sum)
        self.tokens += out.tokens
        correct = out.correct.sum(dim=(0, 1)).double().cpu()
        valid = out.valid.sum(dim=(0, 1)).double().cpu()
        # Acceptance: predictions are accepted while correct; an invalid (past the end) row stops it.
        scored = out.valid[..., 0]
        prefix = out.correct.long().cumprod(dim=-1)
        accepted_at = prefix[scored].sum(dim=0).double().cpu()
        self.correct = correct if self.correct is None else self.correct + correct
        self.valid = valid if self.valid is None else self.valid + valid
        self.accepted = accepted_at if self.accepted is None else self.accepted + accepted_at
        self.tau_sum += float((prefix.sum(dim=-1)[scored] + 1).sum())
        self.blocks += int(scored.sum())

    def metrics(self) -> Metrics:
        accuracy = (self.correct / self.valid.clamp(min=1)).tolist() if self.correct is not None else []
        acceptance = (self.accepted / max(1, self.blocks)).tolist() if self.accepted is not None else []
        return Metrics(
            loss=self.ce / self.weight if self.weight else float("nan"),
            accuracy=accuracy,
            tau=self.tau_sum / self.blocks if self.blocks else float("nan"),
            blocks=self.blocks,
            acceptance=acceptance,
        )


# ------------------------------------------------------------------------------------------------
# The loop


def lr_at(progress: float, base_lr: float, warmup_ratio: float) -> float:
    """Linear warmup over the first `warmup_ratio` of training, then cosine decay to zero."""
    if warmup_ratio > 0 and progress < warmup_ratio:
        return base_lr * max(progress, 1e-3) / warmup_ratio
    span = max(1e-8, 1.0 - warmup_ratio)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup_ratio) / span)))


def build_draft_config(target: Target, options: TrainOptions) -> tuple[dict[str, Any], int, str, list[int]]:
    """The draft's config.json dict, its mask token id (and why), and its target layer ids."""
    if options.target_layer_ids:
        layer_ids = check_target_layer_ids(options.target_layer_ids, target.num_layers)
    else:
        layer_ids = default_target_layer_ids(target.num_layers, options.num_layers)
    if options.mask_token_id is not None:
        if not 0 <= options.mask_token_id < target.vocab_size:
            raise InputError(
                f"mask token id {options.mask_token_id} is outside the target vocabulary of {target.vocab_size}",
                hint="pick an id the target never produces, or leave --mask-token-id out",
            )
        mask_id, reason = options.mask_token_id, "given with --mask-token-id"
    else:
        mask_id, reason = choose_mask_token_id(target.tokenizer, target.vocab_size)
    target_config = target.config.to_dict()
    if hasattr(target.config, "get_text_config"):
        target_config = {**target_config, **target.config.get_text_config().to_dict()}
    target_config["vocab_size"] = target.vocab_size
    config = draft_config_dict(
        options.kind,
        target_config,
        num_layers=options.num_layers,
        block_size=options.block_size,
        target_layer_ids=layer_ids,
        mask_token_id=mask_id,
        markov_rank=options.markov_rank,
        intermediate_size=options.intermediate_size,
        num_anchors=options.num_anchors,
        dtype=options.save_dtype,
    )
    return config, mask_id, reason, layer_ids


# Options a resumed run must share with the run it continues (the rest may change between sessions).
_FIXED_ON_RESUME = ("kind", "block_size", "num_layers", "markov_rank", "target_layer_ids", "intermediate_size",
                    "mask_token_id")


def data_fingerprint(train_examples: Sequence[Example], eval_examples: Sequence[Example] | None) -> dict[str, Any]:
    """What a resumed run must train and hold out again: the sizes and a digest of both sides' sequences.

    Resuming on other data (another decontamination set, more files, another split) would put sequences
    held out before into training: the held-out figures would then measure memory.
    """
    digest = hashlib.sha256()
    for side in (train_examples, eval_examples or ()):
        for example in side:
            digest.update(hashlib.sha256(repr(example.input_ids).encode()).digest())
        digest.update(b"|")
    return {"train_sequences": len(train_examples), "eval_sequences": len(eval_examples or ()),
            "sha256": digest.hexdigest()}


def load_state(output_dir: str | Path) -> dict[str, Any]:
    """The resumable state `train_draft` wrote in `output_dir` (InputError when there is none)."""
    path = Path(output_dir) / STATE_FILE
    if not path.is_file():
        raise InputError(
            f"nothing to resume: {path} does not exist",
            hint="--resume continues a run in the same OUTPUT_DIR; drop --resume to start a new one",
        )
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("version") != STATE_VERSION:
        raise InputError(f"{path} was written by another version of dflash train", hint="start a new run")
    return state


def train_draft(
    target: Target,
    train_examples: Sequence[Example],
    output_dir: str | Path,
    options: TrainOptions,
    *,
    eval_examples: Sequence[Example] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    on_log: Callable[[LogEntry], None] | None = None,
    extra_info: dict[str, Any] | None = None,
    resume: bool = False,
    stop_after_s: float | None = None,
    stop_after_steps: int | None = None,
    save_every_s: float | None = None,
    eval_every: int | None = None,
    eval_log_sequences: int = 64,
    init_from: str | Path | None = None,
) -> TrainResult:
    """Train a draft for `target` on `train_examples` and save its checkpoint in `output_dir`.

    `on_step(step, total_steps, loss)` is called after every optimizer step, `on_log(entry)` every
    `log_every` steps. With `eval_examples`, the draft is evaluated (fixed anchors) before and after,
    and on the first `eval_log_sequences` of them every `eval_every` steps (default: every log).
    `resume` continues the run saved in `output_dir` (weights, optimizer, schedule, data order);
    `stop_after_s` / `stop_after_steps` (the step count to reach) end this session early (the schedule
    is not shortened: resume to finish it);
    `save_every_s` writes the checkpoint and the resumable state that often.
    `init_from` (a draft checkpoint folder, the format this function saves) starts a new run from its
    weights instead of a fresh initialisation: the draft options must describe the same draft
    (InputError otherwise), the optimizer and schedule start anew; it cannot be combined with `resume`.
    """
    options = options.resolved()
    if init_from is not None and resume:
        raise InputError("--init-from starts a new run from a checkpoint's weights; it cannot be combined with --resume",
                         hint="drop --init-from to continue the saved run, or --resume to start a warm-started one")
    if not train_examples:
        raise InputError("no training sequences", hint="generate data first (--generate-data N)")
    output_dir = Path(output_dir)
    state = load_state(output_dir) if resume else None
    data = data_fingerprint(train_examples, eval_examples)
    if state is not None:
        saved = state["options"]
        changed = [name for name in _FIXED_ON_RESUME if saved.get(name) != getattr(options, name)
                   and not (name == "mask_token_id" and getattr(options, name) is None)
                   and not (name == "target_layer_ids" and getattr(options, name) is None)]
        if changed:
            raise InputError(
                f"--resume cannot change {', '.join(changed)} (the saved run has "
                + ", ".join(f"{n}={saved.get(n)}" for n in changed) + ")",
                hint="resume with the same draft options, or start a new run in another folder",
            )
        options = TrainOptions(**{**asdict(options), **{n: saved[n] for n in _FIXED_ON_RESUME}}).resolved()
        if state["data"] != data:
            before = state["data"]
            raise InputError(
                f"--resume with other data: the saved run trained on {before['train_sequences']} sequences and held out "
                f"{before['eval_sequences']}, these are {data['train_sequences']} and {data['eval_sequences']}"
                + (" (the same counts, other sequences)" if before["sha256"] != data["sha256"]
                   and before["train_sequences"] == data["train_sequences"] else ""),
                hint="resume with the same --data files, --decontaminate sets, dedup and --eval-sequences, "
                     "or the held-out sequences would leak into training",
            )
    torch.manual_seed(options.seed)
    rng = random.Random(options.seed)
    config_dict, mask_id, mask_reason, layer_ids = build_draft_config(target, options)
    draft_config = parse_draft_config(config_dict, source="dflash train")
    draft = TrainableDraft(draft_config).to(target.device)
    if init_from is not None:
        draft.load_state_dict(init_weights(init_from, draft_config))
    elif state is not None and state.get("init_from"):
        init_from = state["init_from"]  # a resumed warm-started run keeps saying where it started
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else mask_id
    step_kwargs = dict(kind=options.kind, target_layer_ids=layer_ids, mask_token_id=mask_id, gamma=options.loss_gamma,
                       loss=options.loss, ce_weight=options.ce_weight, on_policy=options.on_policy)

    total_steps = options.steps or max(1, math.ceil(options.epochs * len(train_examples) / options.batch_size))
    optimizer = torch.optim.AdamW(
        draft.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay,
        fused=target.device.type == "cuda",
    )
    order = BatchOrder(len(train_examples), options.batch_size, options.seed)
    result = TrainResult(output_dir, options.kind, 0, 0.0, mask_id, mask_reason, layer_ids)
    step, trained_s, tokens = 0, 0.0, 0
    if state is not None:
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step, trained_s, tokens = state["step"], state["seconds"], state["tokens"]
        total_steps = state["total_steps"] if options.steps is None else options.steps
        if state["order"]["count"] == len(train_examples):
            order = BatchOrder(len(train_examples), options.batch_size, options.seed, state["order"]["epoch"],
                               state["order"]["position"])
        rng.setstate(state["rng"])
        result.history = [LogEntry.from_json(entry) for entry in state["history"]]
        result.eval_before = Metrics(**state["eval_before"]) if state.get("eval_before") else None
        result.resumed_from_step = step
    result.total_steps = total_steps
    eval_log_set = list(eval_examples or [])[:eval_log_sequences]
    if eval_examples and result.eval_before is None:
        result.eval_before = evaluate(draft, target, eval_examples, options, step_kwargs, pad_id)

    def save(final: bool) -> None:
        info = {
            "target": str(target.path),
            "kind": options.kind,
            "mask_token_id": mask_id,
            "mask_token_reason": mask_reason,
            "options": asdict(options),
            "train_sequences": len(train_examples),
            "eval_sequences": len(eval_examples or []),
            "result": result.to_json(),
            "history": [entry.to_json() for entry in result.history],
            **({"init_from": str(init_from)} if init_from is not None else {}),
            **(extra_info or {}),
        }
        save_trained_draft(output_dir, config_dict, draft.state_dict(), dtype=options.save_dtype,
                           max_shard_mb=options.max_shard_mb, training_info=info)
        torch.save(
            {
                "version": STATE_VERSION,
                "options": asdict(options),
                "data": data,
                "draft": {k: v.detach().cpu() for k, v in draft.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "step": step,
                "total_steps": total_steps,
                "seconds": trained_s,
                "tokens": tokens,
                "order": order.state(),
                "rng": rng.getstate(),
                "history": [entry.to_json() for entry in result.history],
                "eval_before": asdict(result.eval_before) if result.eval_before else None,
                "init_from": str(init_from) if init_from is not None else None,
                "final": final,
            },
            output_dir / (STATE_FILE + ".tmp"),
        )
        (output_dir / (STATE_FILE + ".tmp")).replace(output_dir / STATE_FILE)

    window = MetricWindow()
    session_start = time.monotonic()
    last_save = session_start
    window_start, window_tokens = session_start, 0
    draft.train()
    progress = _progress(step, total_steps, trained_s, options.time_limit_s)
    result.finished = progress >= 1.0
    while progress < 1.0:
        if (stop_after_s is not None and time.monotonic() - session_start >= stop_after_s) or (
            stop_after_steps is not None and step >= stop_after_steps
        ):
            result.finished = False
            break
        step_start = time.monotonic()
        lr = lr_at(progress, options.lr, options.warmup_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch([train_examples[i] for i in order.next()], options.num_anchors, pad_id, rng)
        out = compute_loss(draft, target, batch, **step_kwargs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), options.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += out.tokens
        window_tokens += out.tokens
        window.add(out)
        trained_s += time.monotonic() - step_start
        progress = _progress(step, total_steps, trained_s, options.time_limit_s)
        if on_step:
            on_step(step, total_steps, float(out.loss.detach()))
        if step % options.log_every == 0 or progress >= 1.0:
            now = time.monotonic()
            held_out = None
            if eval_log_set and (eval_every is None or step % eval_every == 0 or progress >= 1.0):
                held_out = evaluate(draft, target, eval_log_set, options, step_kwargs, pad_id)
            entry = LogEntry(step, lr, trained_s, window.metrics(), tokens, window_tokens / max(1e-9, now - window_start),
                             held_out)
            result.history.append(entry)
            window.reset()
            window_start, window_tokens = time.monotonic(), 0
            if on_log:
                on_log(entry)
        if save_every_s is not None and time.monotonic() - last_save >= save_every_s:
            result.steps, result.seconds, result.tokens = step, trained_s, tokens
            save(final=False)
            last_save = time.monotonic()
    else:
        result.finished = True

    result.steps, result.seconds, result.tokens = step, trained_s, tokens
    result.model = draft.eval()
    if eval_examples:
        result.eval_after = evaluate(draft, target, eval_examples, options, step_kwargs, pad_id)
    save(final=result.finished)
    return result


# What a checkpoint must share with the draft being trained to warm-start it (DraftConfig fields).
_INIT_FIELDS = ("kind", "num_hidden_layers", "target_layer_ids", "draft_block_size", "markov_rank", "hidden_size",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "mask_token_id",
                "vocab_size")


def init_weights(path: str | Path, config) -> dict[str, torch.Tensor]:
    """The weights of the draft checkpoint at `path` as a `TrainableDraft` state dict for a draft of `config`.

    Raises InputError (one line) when the checkpoint is missing or describes another draft.
    """
    from dflash.exporters.draft_checkpoint import load_draft_weights
    from dflash.exporters.draft_config import load_draft_config

    path = Path(path)
    if not (path / "config.json").is_file():
        raise InputError(f"--init-from {path}: no draft checkpoint there (config.json is missing)",
                         hint="point --init-from at a folder `dflash train` wrote")
    source = load_draft_config(path)
    differ = [name for name in _INIT_FIELDS if getattr(source, name) != getattr(config, name)
              and not (name == "num_hidden_layers" and source.num_hidden_layers < config.num_hidden_layers)]
    if differ:
        raise InputError(
            f"--init-from {path} is another draft: "
            + ", ".join(f"{name} {getattr(source, name)} there, {getattr(config, name)} here" for name in differ),
            hint="train with the checkpoint's --kind, --target-layer-ids, --block-size and --markov-rank, and at least "
                 "its --num-layers",
        )
    weights = load_draft_weights(path, source)
    if config.num_hidden_layers > source.num_hidden_layers:
        weights = grow_layers(weights, source.num_hidden_layers, config.num_hidden_layers)
    return {name if name.startswith("markov_head.") else f"model.{name}": tensor for name, tensor in weights.items()}


def source_layer_positions(have: int, want: int) -> dict[int, int]:
    """Where `grow_layers` puts a `have`-layer draft's layers among `want`: position -> source layer,
    spread evenly (3 -> 5: 0, 2, 4); the other positions hold new layers."""
    return {round(i * (want - 1) / (have - 1)) if have > 1 else 0: i for i in range(have)}


def grow_layers(weights: dict[str, torch.Tensor], have: int, want: int) -> dict[str, torch.Tensor]:
    """A draft's weights (names without `model.`) grown from `have` to `want` layers, computing the same function.

    The `have` layers keep their order, spread evenly over the `want` positions (3 -> 5: at 0, 2, 4); each new
    layer is a copy of the layer before it with its attention output and MLP down projections zeroed, so it
    adds nothing to the residual stream until training moves those (block expansion, as LLaMA Pro grows a
    model). A deeper draft warm-started this way starts at the shallower draft's acceptance.
    """
    placed = source_layer_positions(have, want)
    grown = {name: tensor for name, tensor in weights.items() if not name.startswith("layers.")}
    source = 0
    for position in range(want):
        new = position not in placed
        source = source if new else placed[position]
        prefix = f"layers.{source}."
        for name, tensor in weights.items():
            if name.startswith(prefix):
                rest = name[len(prefix):]
                zero = new and rest.startswith(("self_attn.o_proj.", "mlp.down_proj."))
                grown[f"layers.{position}.{rest}"] = torch.zeros_like(tensor) if zero else tensor.clone()
    return grown


def _progress(step: int, total_steps: int, trained_s: float, time_limit_s: float | None) -> float:
    progress = step / total_steps
    if time_limit_s:
        progress = max(progress, trained_s / time_limit_s)
    return progress


@torch.no_grad()
def evaluate(
    draft: TrainableDraft,
    target: Target,
    examples: Sequence[Example],
    options: TrainOptions,
    step_kwargs: dict[str, Any],
    pad_id: int,
) -> Metrics:
    """Metrics over `examples` with anchors drawn from a fixed seed (comparable before and after training)."""
    rng = random.Random(1234)
    window = MetricWindow()
    was_training = draft.training
    draft.eval()
    for first in range(0, len(examples), options.batch_size):
        batch = make_batch(examples[first : first + options.batch_size], options.num_anchors, pad_id, rng)
        window.add(compute_loss(draft, target, batch, **step_kwargs))
    draft.train(was_training)
    return window.metrics()


def split_examples(examples: Sequence[Example], eval_sequences: int, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Hold out by prompt: (train, eval). See `dflash.training.dedup.split_by_prompt`."""
    from .dedup import split_by_prompt

    return split_by_prompt(examples, eval_sequences, seed=seed)
