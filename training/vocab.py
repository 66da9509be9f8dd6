"""A draft vocabulary: the target tokens a draft may propose, ranked by how often the target emits them.

A draft row's logits go through the target's lm_head: hidden x vocabulary multiply-adds, 28 M for
SmolLM2's 49,152 words, about three times the rest of a 3-layer draft row. Most of that vocabulary is
almost never what the target says next, so a draft that proposes only its most frequent N tokens loses
little acceptance (a proposal outside them would rarely have been accepted) and its lm_head shrinks by
the same factor (FR-Spec, Zhao et al. 2025; EAGLE-3 ships drafts with a cut vocabulary). Output stays
lossless: the target still verifies over its whole vocabulary.

The ranking counts the tokens the target itself generates: its greedy answers to prompts (by default the
built-in training prompts, never a benchmark set), generated with this package's engine. Half the
prompts rank, the other half measure how much of the target's output the top N covers (held out by
prompt), so the size can be chosen on data the ranking did not see:

    python -m dflash.training.vocab TARGET_DIR draft_vocab.json --num-prompts 1200
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


def build(target_dir: str | Path, *, num_prompts: int, max_new_tokens: int, concurrency: int, seed: int = 0) -> dict:
    """Rank the target's tokens by its answers to `num_prompts` built-in prompts. Coverage is measured
    held out by prompt (a ranking made on one half, counted on the other), then the ranking that is kept
    is made on all the answers."""
    from dflash.training.prompts import builtin_prompts

    prompts = builtin_prompts(num_prompts, seed=seed)
    answers = generated_answers(target_dir, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency)
    vocab_size = _vocab_size(target_dir)
    half = len(answers) // 2
    ranked_counts, held_out_counts = count_tokens(answers[:half], vocab_size), count_tokens(answers[half:], vocab_size)
    held_out = coverage(rank_tokens(ranked_counts), held_out_counts)
    counts = ranked_counts + held_out_counts
    return {
        "source": f"greedy answers of the target to {len(answers)} built-in training prompts (chat template, "
                  f"{max_new_tokens} new tokens, EOS ignored); held-out coverage: ranked on the answers to "
                  f"{half} prompts, counted on the other {len(answers) - half}",
        "vocab_size": vocab_size,
        "tokens": int(counts.sum()),
        "held_out_coverage": {str(n): c for n, c in held_out.items()},
        "ranking": rank_tokens(counts)[: int(np.count_nonzero(counts))].tolist(),
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
    args = parser.parse_args(argv)
    info = build(args.target_dir, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                 concurrency=args.concurrency)  # fmt: skip
    Path(args.out).write_text(json.dumps(info) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "ranking"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
