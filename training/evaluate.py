"""A trained draft's acceptance on any prompts, in PyTorch, counted the way the engine counts it.

For each prompt (chat template, as `dflash bench` sends it) the target answers greedily for
`max_new_tokens` tokens with EOS ignored (as `dflash bench` decodes). Then, in one pass per prompt,
the draft predicts a block at every response position (a block's predictions depend only on the
context before its anchor and the anchor token, so all of them can be computed at once), and the
engine's step sequence is replayed on that answer: the first step's seed is the first answer token
(the prefill's), a step drafts min(candidates, tokens left - 1) tokens, accepts the longest prefix
that equals the answer and commits it plus the bonus token, and the next step's seed is that bonus
token. Per-position acceptance is then "of the steps that drafted position i, the share that accepted
it" and tau the mean accepted length with the bonus, exactly the engine's metrics
(`core/metrics.py`). The DSpark Markov head is fed the answer's tokens, which is what the engine's
greedy walk feeds it wherever the prefix is still accepted. A checkpoint with a draft vocabulary
(`draft_vocab.json`, the tokens its export may propose) is evaluated as it is exported: its candidates
are the argmax over those tokens only (the engine's cut lm_head), unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dflash.exporters.draft_checkpoint import load_draft_weights
from dflash.exporters.draft_config import DraftConfig, load_draft_config

from .data import generate_responses
from .model import TrainableDraft
from .target import Target, target_forward


@dataclass
class PromptEval:
    prompt_len: int
    steps: int
    accepted: int  # tokens accepted over all steps (bonus not included)


@dataclass
class DraftEvaluation:
    """The engine-style acceptance of a draft on a prompt set."""

    prompts: int
    max_new_tokens: int
    num_candidates: int
    steps: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    per_prompt: list[PromptEval] = field(default_factory=list)

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """tau: accepted tokens per step plus the bonus token."""
        return (sum(p.accepted for p in self.per_prompt) + self.steps) / self.steps if self.steps else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
            "num_candidates": self.num_candidates,
            "steps": self.steps,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
        }


def load_draft_vocab(path: str | Path, size: int | None = None) -> list[int] | None:
    """The target token ids the checkpoint's export proposes (`dflash export`'s rule: the first `size` of its
    `draft_vocab.json` ranking, the file's own size when None; None: the whole vocabulary)."""
    from dflash.exporters.draft import resolve_draft_vocab

    return resolve_draft_vocab(Path(path), size)


def load_trained_draft(path: str | Path, device: torch.device) -> tuple[TrainableDraft, DraftConfig]:
    """A draft checkpoint folder (z-lab or DeepSpec layout) as a TrainableDraft in float32, eval mode."""
    config = load_draft_config(path)
    weights = load_draft_weights(path, config)
    draft = TrainableDraft(config)
    state = {}
    for name, tensor in weights.items():
        state[name if name.startswith("markov_head.") else f"model.{name}"] = tensor
    draft.load_state_dict(state)
    return draft.to(device).eval(), config


@torch.no_grad()
def block_predictions(
    draft: TrainableDraft, config: DraftConfig, target: Target, sequence: torch.Tensor, first: int,
    draft_vocab: Sequence[int] | None = None,
) -> torch.Tensor:
    """[positions, P] the draft's greedy predictions for blocks anchored at first .. len-2 of `sequence`.

    With `draft_vocab`, only those token ids are proposed: the argmax over their logits (the Markov bias
    included), as the engine's cut lm_head computes it.
    """
    offset = config.candidate_position_offset
    predictions = config.block_size - offset
    ids = sequence[None].to(target.device)
    features, _ = target_forward(target, ids, list(config.target_layer_ids))
    anchors = torch.arange(first, len(sequence) - 1, device=target.device)[None]
    block_ids = torch.full((1, anchors.shape[1], config.block_size), config.mask_token_id, device=target.device)
    block_ids[..., 0] = ids[0, anchors[0]]
    hidden = draft(features.float(), target.embed(block_ids).float(), anchors)[:, :, offset:]  # [1, K, P, H]
    logits = target.lm_head(hidden.to(target.dtype)).float()
    if draft.markov_head is not None:
        width = ids.shape[1]
        previous_pos = (anchors[..., None] + torch.arange(predictions, device=target.device)).clamp(max=width - 1)
        logits = logits + draft.markov_head(ids[0, previous_pos]).float()
    if draft_vocab is not None:
        kept = torch.as_tensor(list(draft_vocab), dtype=torch.long, device=logits.device)
        return kept[logits.index_select(-1, kept).argmax(-1)[0]]
    return logits.argmax(-1)[0]


def replay_engine(answer: Sequence[int], predictions: torch.Tensor, num_candidates: int) -> tuple[int, list[int], list[int]]:
    """(steps, drafted per position, accepted per position) of greedy speculative decoding on `answer`.

    `answer` is the greedy answer (its first token came from the prefill); predictions[j] holds the
    draft's candidates for the block seeded by answer[j].
    """
    drafted = [0] * num_candidates
    accepted = [0] * num_candidates
    steps, seed, total = 0, 0, len(answer)
    # The engine drafts while two or more tokens remain, at most as many as leave room for the bonus
    # token (core/speculative.py: room = max_new_tokens - output tokens - 1); the last token is the target's.
    while total - (seed + 1) > 1:
        count = min(num_candidates, total - seed - 2)
        candidates = predictions[seed, :count].tolist()
        run = 0
        while run < count and candidates[run] == answer[seed + 1 + run]:
            run += 1
        for i in range(count):
            drafted[i] += 1
        for i in range(run):
            accepted[i] += 1
        steps += 1
        seed += run + 1  # the accepted tokens and the bonus token: the bonus seeds the next step
    return steps, drafted, accepted


def evaluate_draft(
    target: Target,
    draft: TrainableDraft,
    config: DraftConfig,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    num_candidates: int | None = None,
    batch_size: int = 8,
    answers: Sequence[Sequence[int]] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    draft_vocab: Sequence[int] | None = None,
) -> DraftEvaluation:
    """Engine-style acceptance of `draft` on `prompt_ids` (token ids, chat template applied); `draft_vocab`:
    the token ids the exported draft may propose (`load_draft_vocab`), None for all."""
    block_predictions_count = config.block_size - config.candidate_position_offset
    k = min(num_candidates or block_predictions_count, block_predictions_count)
    result = DraftEvaluation(len(prompt_ids), max_new_tokens, k, drafted_per_position=[0] * k, accepted_per_position=[0] * k)
    if answers is None:
        answers = []
        for first in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[first : first + batch_size]
            answers += [r for r, _ in generate_responses(target, batch, max_new_tokens, ignore_eos=True)]
    for index, (prompt, answer) in enumerate(zip(prompt_ids, answers)):
        sequence = torch.tensor(list(prompt) + list(answer), dtype=torch.long)
        predictions = block_predictions(draft, config, target, sequence, len(prompt), draft_vocab).cpu()
        steps, drafted, accepted = replay_engine(list(answer), predictions, k)
        result.steps += steps
        result.drafted_per_position = [a + b for a, b in zip(result.drafted_per_position, drafted)]
        result.accepted_per_position = [a + b for a, b in zip(result.accepted_per_position, accepted)]
        result.per_prompt.append(PromptEval(len(prompt), steps, sum(accepted)))
        if on_progress:
            on_progress(index + 1, len(prompt_ids))
    return result
