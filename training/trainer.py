"""Training a DFlash or DSpark draft against a frozen target (the DFlash recipe, paper §4.2 / §A.1).

One step, for a batch of N sequences (templated prompt + the target's greedy response):
1. the target runs once over the batch; its hidden states at `target_layer_ids` (HF index L + 1),
   concatenated, are the context features of every position;
2. K anchors a are drawn per sequence inside the response; block i is [token a, mask x (B-1)] at
   positions a .. a+B-1 and sees the context before a plus its own block (model.blocks_forward);
3. the target's frozen lm_head turns block rows into logits. The i-th prediction of a block is the
   token at a + 1 + i: DFlash (candidate offset 1) predicts from rows 1..B-1, DSpark (offset 0) from
   rows 0..B-1, adding the Markov bias W2·W1[x_{i-1}] with teacher-forced previous tokens (the anchor,
   then the true tokens);
4. loss = cross-entropy weighted by exp(-i/gamma) (gamma 7 for B >= 16, 5 for B >= 10, else 4), over
   predictions that fall inside the sequence; AdamW, warmup then cosine, gradient clip 1.0, bf16
   autocast on cuda.

Logged per window: loss, per-position accuracy and tau, the mean greedy acceptance length a block
would get (leading correct predictions + 1). Because the data is the target's own greedy output and
the Markov inputs are exactly the tokens a correct prefix would feed, tau is the acceptance length of
greedy speculative decoding at those anchors.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from dflash.core.errors import InputError
from dflash.exporters.draft_config import parse_draft_config

from .checkpoint import draft_config_dict, save_trained_draft
from .data import Example
from .model import TrainableDraft
from .target import Target, check_target_layer_ids, choose_mask_token_id, default_target_layer_ids, target_features

KINDS = ("dflash", "dspark")
DEFAULT_BLOCK_SIZE = {"dflash": 16, "dspark": 7}
DEFAULT_MARKOV_RANK = {"dflash": 0, "dspark": 32}
CANDIDATE_OFFSET = {"dflash": 1, "dspark": 0}


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
    max_length: int = 2048
    time_limit_s: float | None = None  # the schedule runs on max(step fraction, time fraction)
    seed: int = 0
    log_every: int = 10
    save_dtype: str = "float16"
    max_shard_mb: float | None = None

    def resolved(self) -> "TrainOptions":
        """A copy with the kind's defaults filled in; raises InputError on inconsistent values."""
        if self.kind not in KINDS:
            raise InputError(f"unknown draft kind {self.kind!r}", hint="use --kind dflash or --kind dspark")
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
    """Loss, per-position accuracy and mean acceptance length over some blocks."""

    loss: float
    accuracy: list[float]  # accuracy[i]: the i-th prediction of a block (token at anchor + 1 + i)
    tau: float  # mean (leading correct predictions + 1) per block
    blocks: int

    def to_json(self) -> dict[str, Any]:
        return {
            "loss": round(self.loss, 5),
            "accuracy": [round(a, 4) for a in self.accuracy],
            "tau": round(self.tau, 4),
            "blocks": self.blocks,
        }


@dataclass
class LogEntry:
    step: int
    lr: float
    seconds: float
    metrics: Metrics

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "lr": self.lr, "seconds": round(self.seconds, 2), **self.metrics.to_json()}


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
    model: TrainableDraft | None = field(default=None, repr=False)  # the trained draft, in eval mode

    def to_json(self) -> dict[str, Any]:
        return {
            "output_dir": str(self.output_dir),
            "kind": self.kind,
            "steps": self.steps,
            "seconds": round(self.seconds, 2),
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
    k = min(num_anchors, max(len(c) for c in candidates))
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


def batch_iterator(examples: Sequence[Example], batch_size: int, rng: random.Random) -> Iterator[list[Example]]:
    """Endless shuffled passes over `examples` (the last short batch of a pass is kept)."""
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for first in range(0, len(order), batch_size):
            yield [examples[i] for i in order[first : first + batch_size]]


# ------------------------------------------------------------------------------------------------
# Loss


@dataclass
class StepOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [N, K, P] bool (False where not valid)
    valid: torch.Tensor  # [N, K, P] bool
    ce_sum: torch.Tensor  # weighted CE sum and weight sum, to average over a log window
    weight_sum: torch.Tensor


def compute_loss(
    draft: TrainableDraft,
    target: Target,
    batch: Batch,
    *,
    kind: str,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    gamma: float,
) -> StepOutput:
    """The weighted block cross-entropy of one batch (see the module docstring)."""
    device = target.device
    batch = Batch(*(t.to(device) for t in (batch.input_ids, batch.lengths, batch.anchors, batch.anchor_valid)))
    block_size = draft.config.block_size
    offset = CANDIDATE_OFFSET[kind]
    num_predictions = block_size - offset

    features = target_features(target, batch.input_ids, target_layer_ids)
    anchor_ids = torch.gather(batch.input_ids, 1, batch.anchors)
    block_ids = torch.full((*batch.anchors.shape, block_size), mask_token_id, dtype=torch.long, device=device)
    block_ids[..., 0] = anchor_ids
    with torch.no_grad():
        block_embeds = target.embed(block_ids)

    with _autocast(device):
        hidden = draft(features, block_embeds, batch.anchors)[:, :, offset:]  # [N, K, P, H]
        labels, valid, previous = block_labels(batch, num_predictions)
        rows = valid.nonzero(as_tuple=True)
        logits = target.lm_head(hidden[rows])  # only the rows that are scored
        if draft.markov_head is not None:
            logits = logits + draft.markov_head(previous[rows])
        ce = F.cross_entropy(logits.float(), labels[rows], reduction="none")
    weights = torch.exp(-rows[2].float() / gamma)
    ce_sum = (ce * weights).sum()
    weight_sum = weights.sum()
    loss = ce_sum / weight_sum.clamp(min=1e-8)
    correct = torch.zeros_like(valid)
    correct[rows] = logits.argmax(dim=-1) == labels[rows]
    return StepOutput(loss, correct, valid, ce_sum.detach(), weight_sum.detach())


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
        self.tau_sum = 0.0
        self.blocks = 0

    def add(self, out: StepOutput) -> None:
        self.ce += float(out.ce_sum)
        self.weight += float(out.weight_sum)
        correct = out.correct.sum(dim=(0, 1)).double().cpu()
        valid = out.valid.sum(dim=(0, 1)).double().cpu()
        self.correct = correct if self.correct is None else self.correct + correct
        self.valid = valid if self.valid is None else self.valid + valid
        # Acceptance: predictions are accepted while correct; an invalid (past the end) row stops it.
        scored = out.valid[..., 0]
        accepted = out.correct.long().cumprod(dim=-1).sum(dim=-1)
        self.tau_sum += float((accepted[scored] + 1).sum())
        self.blocks += int(scored.sum())

    def metrics(self) -> Metrics:
        accuracy = (self.correct / self.valid.clamp(min=1)).tolist() if self.correct is not None else []
        return Metrics(
            loss=self.ce / self.weight if self.weight else float("nan"),
            accuracy=accuracy,
            tau=self.tau_sum / self.blocks if self.blocks else float("nan"),
            blocks=self.blocks,
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
) -> TrainResult:
    """Train a draft for `target` on `train_examples` and save its checkpoint in `output_dir`.

    `on_step(step, total_steps, loss)` is called after every optimizer step, `on_log(entry)` every
    `log_every` steps. With `eval_examples`, the draft is evaluated (fixed anchors) before and after.
    """
    options = options.resolved()
    if not train_examples:
        raise InputError("no training sequences", hint="generate data first (--generate-data N)")
    torch.manual_seed(options.seed)
    rng = random.Random(options.seed)
    config_dict, mask_id, mask_reason, layer_ids = build_draft_config(target, options)
    draft_config = parse_draft_config(config_dict, source="dflash train")
    draft = TrainableDraft(draft_config).to(target.device)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else mask_id
    step_kwargs = dict(kind=options.kind, target_layer_ids=layer_ids, mask_token_id=mask_id, gamma=options.loss_gamma)

    total_steps = options.steps or max(1, math.ceil(options.epochs * len(train_examples) / options.batch_size))
    optimizer = torch.optim.AdamW(
        draft.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay,
        fused=target.device.type == "cuda",
    )
    result = TrainResult(Path(output_dir), options.kind, 0, 0.0, mask_id, mask_reason, layer_ids)
    if eval_examples:
        result.eval_before = evaluate(draft, target, eval_examples, options, step_kwargs, pad_id)

    window = MetricWindow()
    batches = batch_iterator(train_examples, options.batch_size, rng)
    start = time.monotonic()
    draft.train()
    step = 0
    progress = 0.0
    while progress < 1.0:
        lr = lr_at(progress, options.lr, options.warmup_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(next(batches), options.num_anchors, pad_id, rng)
        out = compute_loss(draft, target, batch, **step_kwargs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), options.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window.add(out)
        elapsed = time.monotonic() - start
        progress = step / total_steps
        if options.time_limit_s:
            progress = max(progress, elapsed / options.time_limit_s)
        if on_step:
            on_step(step, total_steps, float(out.loss.detach()))
        if step % options.log_every == 0 or progress >= 1.0:
            entry = LogEntry(step, lr, elapsed, window.metrics())
            result.history.append(entry)
            window.reset()
            if on_log:
                on_log(entry)

    result.steps = step
    result.seconds = time.monotonic() - start
    result.model = draft.eval()
    if eval_examples:
        result.eval_after = evaluate(draft, target, eval_examples, options, step_kwargs, pad_id)
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
        **(extra_info or {}),
    }
    save_trained_draft(
        output_dir, config_dict, draft.state_dict(), dtype=options.save_dtype,
        max_shard_mb=options.max_shard_mb, training_info=info,
    )
    return result


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
    """A seeded hold-out of `eval_sequences` sequences (at most a tenth of the data): (train, eval)."""
    count = min(eval_sequences, len(examples) // 10)
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [examples[i] for i in sorted(held)]
