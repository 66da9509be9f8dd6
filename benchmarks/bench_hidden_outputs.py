"""What the draft's hidden-state outputs cost the target's step.

A target compiled for a draft also outputs the hidden states of the layers the draft reads, on every
step, drafting or not (a paused request catches up from them later). This times the same decode
step of the same target compiled with and without those outputs, in turn, so both see the same
machine: median milliseconds per step and the ratio.

    python benchmarks/bench_hidden_outputs.py                      # the embedded default pair
    python benchmarks/bench_hidden_outputs.py --target T --draft D --concurrency 1 8 32
    python benchmarks/bench_hidden_outputs.py --agreement 20   # and: do both give the same greedy tokens?
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from dflash.core.draft_format import read_draft_metadata
from dflash.core.model_runner import StepInputs, TargetRunner, read_ov_model
from dflash.core.paged import SequenceSlice


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, help="exported target (default: the embedded default pair's)")
    parser.add_argument("--draft", type=Path, help="exported draft whose target layers are read (default: the default DSpark)")


def pair_dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    """(target, draft): --target and --draft, else the embedded default DSpark pair (exported on first use)."""
    if (args.target is None) != (args.draft is None):
        raise SystemExit("--target and --draft go together")
    if args.target:
        return args.target, args.draft
    from dflash.exporters.default_pair import ensure_default_pair

    pair = ensure_default_pair("dspark")
    return pair.target_dir, pair.draft_dir


def target_and_hidden_layers(args: argparse.Namespace) -> tuple[Path, tuple[int, ...]]:
    """The target of --target/--draft (else of the embedded default DSpark pair) and the layers its draft reads."""
    target, draft = pair_dirs(args)
    return target, tuple(read_draft_metadata(read_ov_model(draft)).target_layer_ids)


def greedy_agreement(runners: dict[str, TargetRunner], target: Path, num_prompts: int, num_tokens: int = 8) -> None:
    """Greedy tokens of each runner on HumanEval prompts (tokenized as the engine does, chat template), one
    prompt at a time from an empty cache: how many prompts give the same tokens, and the same logits bit for bit."""
    from dflash.bench.datasets import load_dataset
    from dflash.core.tokenization import load_tokenizer, tokenize_prompt

    tokenizer = load_tokenizer(target)
    kv_block_size = next(iter(runners.values())).kv_block_size
    same_tokens = same_logits = 0
    for prompt in load_dataset("humaneval", num_prompts):
        _, ids = tokenize_prompt(tokenizer, prompt, chat=True)
        blocks = list(range(-(-(len(ids) + num_tokens) // kv_block_size)))
        results = []
        for runner in runners.values():
            past, rows, tokens, logits = 0, ids, [], []
            for _ in range(num_tokens):
                step = StepInputs([SequenceSlice(past, len(rows), blocks)], np.asarray(rows), np.asarray([len(rows) - 1]))
                row_logits = runner.run(step).logits[0].copy()
                logits.append(row_logits)
                tokens.append(int(row_logits.argmax()))
                past, rows = past + len(rows), [tokens[-1]]
            results.append((tokens, np.stack(logits)))
        same_tokens += results[0][0] == results[1][0]
        same_logits += np.array_equal(results[0][1], results[1][1])
    print(f"{num_prompts} HumanEval prompts, {num_tokens} greedy tokens: same tokens {same_tokens}, same logits {same_logits}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--past", type=int, default=200, help="tokens already in each sequence's cache")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--agreement", type=int, default=0, metavar="N",
                        help="also compare both runners' greedy tokens on N HumanEval prompts")  # fmt: skip
    args = parser.parse_args()
    target, layers = target_and_hidden_layers(args)
    runners = {"plain": TargetRunner(target), "hidden outputs": TargetRunner(target, hidden_layer_ids=layers)}
    blocks_per_seq = -(-(args.past + 1) // runners["plain"].kv_block_size)
    for runner in runners.values():
        runner.allocate_cache(blocks_per_seq * max(args.concurrency))
    rng = np.random.default_rng(0)
    print(f"{'concurrency':>11} {'plain ms':>9} {'hidden ms':>10} {'ratio':>6}")
    for n in args.concurrency:
        seqs = [SequenceSlice(args.past, 1, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(n)]
        step = StepInputs(seqs, rng.integers(100, 1000, n), np.arange(n))
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.steps):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.run(step)
                times[name].append(time.perf_counter() - start)
        plain, hidden = (statistics.median(t[args.steps // 6 :]) * 1e3 for t in times.values())
        print(f"{n:>11} {plain:>9.2f} {hidden:>10.2f} {hidden / plain:>6.3f}")
    if args.agreement:
        greedy_agreement(runners, target, args.agreement)


if __name__ == "__main__":
    main()
