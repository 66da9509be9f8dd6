"""A draft vocabulary: the target tokens a draft may propose, ranked by how often the target emits them.

A draft row's logits go through the target's lm_head: hidden x vocabulary multiply-adds, 28 M for
SmolLM2's 49,152 words, about three times the rest of a 3-layer draft row. Most of that vocabulary is
almost never what the target says next, so a draft that proposes only its most frequent N tokens loses
little acceptance (a proposal outside them would rarely have been accepted) and its lm_head shrinks by
the same factor (FR-Spec, Zhao et al. 2025; EAGLE-3 ships drafts with a cut vocabulary). Output stays
lossless: the target still verifies over its whole vocabulary.

The ranking counts the tokens the target itself generates: its greedy answers to prompts (by default the
built-in training prompts, never a benchmark set), generated with this package's engine, and, with
`--text-from`, its own next token at every position of real text and code (teacher-forced: one forward
pass a stretch, no generation). Answers to chat prompts alone leave out the identifiers of code: the
default drafts' first ranking (chat answers only, 97.1% of held-out answers covered by 8,192 tokens)
cost the DSpark draft 7% of its acceptance on HumanEval against its whole vocabulary. Half the prompts
(and half the files) rank, the other half measure how much of the target's output the top N covers
(held out by prompt and by file), so the size can be chosen on data the ranking did not see:

    python -m dflash.training.vocab TARGET_DIR draft_vocab.json --num-prompts 1200 \
        --text-from /usr/lib/python3.11 --text-tokens 120000
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)


def count_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """How often each token id occurs over the sequences. # [vocab_size] i64"""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens in sequences:
        np.add.at(counts, np.asarray(tokens, dtype=np.int64), 1)
    return counts


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """Token ids, most frequent first; ties (unseen tokens included) by id. # [vocab_size] i64"""
    return np.lexsort((np.arange(len(counts)), -counts)).astype(np.int64)


def coverage(ranking: np.ndarray, counts: np.ndarray, sizes: Sequence[int] = COVERAGE_SIZES) -> dict[int, float]:
    """The share of the counted tokens that the top N of `ranking` covers, for each N."""
    total = max(int(counts.sum()), 1)
    return {n: round(float(counts[ranking[:n]].sum()) / total, 5) for n in sizes if n <= len(ranking)}


def generated_answers(target_dir: str | Path, prompts: Sequence[str], *, max_new_tokens: int, concurrency: int) -> list[list[int]]:
    """The target's greedy answers (chat template, EOS ignored, as `dflash bench` decodes), token ids."""
    from dflash.core.config import EngineConfig, SamplingParams
    from dflash.core.engine import LLMEngine

    engine = LLMEngine(target_dir, EngineConfig(max_num_seqs=concurrency))
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [list(result.token_ids) for result in engine.generate(prompts, params, chat=True)]


def predicted_tokens(target_dir: str | Path, files: Iterable[Path], *, max_tokens: int,
                     chunk_tokens: int = 512) -> list[list[int]]:  # fmt: skip
    """The target's own next token (its argmax) at every position of stretches of `files`, teacher-forced:
    one forward pass a stretch of `chunk_tokens` (the exported target through optimum-intel), until about
    `max_tokens` positions."""
    import torch
    from optimum.intel import OVModelForCausalLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = OVModelForCausalLM.from_pretrained(target_dir, compile=True)
    predictions: list[list[int]] = []
    total = 0
    for path in files:
        try:
            ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        except (UnicodeDecodeError, OSError):
            continue
        for first in range(0, len(ids), chunk_tokens):
            chunk = ids[first : first + chunk_tokens]
            if len(chunk) < 32:
                continue
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([chunk]), attention_mask=torch.ones(1, len(chunk), dtype=torch.int64)).logits
            predictions.append(logits[0].argmax(-1).tolist())
            total += len(chunk)
            if total >= max_tokens:
                return predictions
    return predictions


def build(target_dir: str | Path, *, num_prompts: int, max_new_tokens: int, concurrency: int, seed: int = 0,
          text_from: Sequence[str | Path] = (), text_tokens: int = 120_000) -> dict:  # fmt: skip
    """Rank the target's tokens by its answers to `num_prompts` built-in prompts and, with `text_from`,
    by its predictions over about `text_tokens` positions of the files there (`predicted_tokens`), the two
    counted alike. Coverage is measured held out (a ranking made on half the prompts and half the
    files, counted on the other halves, each source on its own), then the ranking that is kept is made
    on all of it. `counts` keeps each ranked token's count, so that a later ranking can add to it."""
    from dflash.training.corpus import source_files
    from dflash.training.prompts import builtin_prompts

    prompts = builtin_prompts(num_prompts, seed=seed)
    answers = generated_answers(target_dir, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency)
    vocab_size = _vocab_size(target_dir)
    half = len(answers) // 2
    halves = {"answers": (count_tokens(answers[:half], vocab_size), count_tokens(answers[half:], vocab_size))}
    source = (f"greedy answers of the target to {len(answers)} built-in training prompts (chat template, "
              f"{max_new_tokens} new tokens, EOS ignored)")  # fmt: skip
    if text_from:
        files = source_files(text_from, suffixes=(".py",), seed=seed)
        first_half, second_half = files[0::2], files[1::2]  # every other file: both halves sample every package
        texts = [predicted_tokens(target_dir, part, max_tokens=text_tokens // 2) for part in (first_half, second_half)]
        halves["text"] = tuple(count_tokens(part, vocab_size) for part in texts)
        source += (f", and its own next token at {int(sum(h.sum() for h in halves['text']))} positions of Python files under "
                   f"{', '.join(str(p) for p in text_from)} (teacher-forced, files held out by halves)")  # fmt: skip
    ranking_half = rank_tokens(sum(first for first, _ in halves.values()))
    held_out = {name: coverage(ranking_half, second) for name, (_, second) in halves.items()}
    counts = sum(first + second for first, second in halves.values())
    ranking = rank_tokens(counts)[: int(np.count_nonzero(counts))]
    return {
        "source": source + "; held-out coverage: ranked on half the prompts (and files), counted on the other half",
        "vocab_size": vocab_size,
        "tokens": int(counts.sum()),
        "held_out_coverage": {str(n): c for n, c in held_out["answers"].items()},
        **({"held_out_coverage_text": {str(n): c for n, c in held_out["text"].items()}} if "text" in held_out else {}),
        "ranking": ranking.tolist(),
        "counts": counts[ranking].tolist(),
    }  # fmt: skip


def _vocab_size(target_dir: str | Path) -> int:
    return int(json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target_dir", help="an exported target (dflash export)")
    parser.add_argument("out", help="where to write the ranking (JSON)")
    parser.add_argument("--num-prompts", type=int, default=1200)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--text-from", action="append", default=[], metavar="PATH",
                        help="also count the target's own next token over the Python files under PATH (repeatable)")  # fmt: skip
    parser.add_argument("--text-tokens", type=int, default=120_000, help="positions of --text-from to count")
    args = parser.parse_args(argv)
    info = build(args.target_dir, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                 concurrency=args.concurrency, text_from=args.text_from, text_tokens=args.text_tokens)  # fmt: skip
    Path(args.out).write_text(json.dumps(info) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k not in ("ranking", "counts")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
