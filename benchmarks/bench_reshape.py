"""What a change of the target's row count costs a step (the adaptive schedule's `reshape` price).

OpenVINO's CPU plugin prepares every node again when an input's shape differs from the previous
inference's. This times decode steps of the target as a draft's engine compiles it (with the hidden
outputs) in row patterns that repeat one shape or change it every step, in turn, round by round:
mean milliseconds per step and mean rows per step. A pattern that changes shape with fewer rows than
a steady one, and still costs more, pays the reshape.

    python benchmarks/bench_reshape.py                  # the embedded default pair, c=1 and c=8
    python benchmarks/bench_reshape.py --target T --draft D --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_hidden_outputs import add_pair_arguments, target_and_hidden_layers

from dflash.core.model_runner import StepInputs, TargetRunner
from dflash.core.paged import SequenceSlice

# name -> the rows of each sequence, step after step (the pattern repeats)
PATTERNS = {
    "c=1, 4 rows every step": [[4]],
    "c=1, 3 and 4 in turn": [[3], [4]],
    "c=1, 1..6 in turn": [[1], [2], [3], [4], [5], [6]],
    "c=1, 5 rows every step": [[5]],
    "c=8, 2 rows each every step": [[2] * 8],
    "c=8, 16 and 17 rows in turn": [[2] * 8, [2] * 7 + [3]],
    "c=8, 3 rows each every step": [[3] * 8],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--past", type=int, default=200, help="tokens already in each sequence's cache")
    parser.add_argument("--steps", type=int, default=30, help="steps per pattern and round (the first 4 are not timed)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    target, layers = target_and_hidden_layers(args)
    runner = TargetRunner(target, hidden_layer_ids=layers)
    blocks_per_seq = -(-(args.past + args.steps * 8) // runner.kv_block_size)
    runner.allocate_cache(blocks_per_seq * 8)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(8)]
    rng = np.random.default_rng(0)

    def step(past: int, rows: list[int]) -> float:
        seqs = [SequenceSlice(past, n, tables[i]) for i, n in enumerate(rows)]
        total = sum(rows)
        inputs = StepInputs(seqs, rng.integers(100, 1000, total), np.arange(total))
        start = time.perf_counter()
        runner.run(inputs)
        return time.perf_counter() - start

    step(0, [args.past] * 8)  # the caches' first rows
    means: dict[str, list[float]] = {name: [] for name in PATTERNS}
    for _ in range(args.rounds):
        for name, pattern in PATTERNS.items():
            times = [step(args.past + i, pattern[i % len(pattern)]) for i in range(args.steps)]
            means[name].append(statistics.mean(times[4:]) * 1e3)
    print(f"{'pattern':<30} {'rows/step':>9} {'ms/step':>8} {'range':>13}")
    for name, pattern in PATTERNS.items():
        rows = statistics.mean(sum(r) for r in pattern)
        ms = statistics.median(means[name])
        print(f"{name:<30} {rows:>9.1f} {ms:>8.2f} {min(means[name]):>6.2f}-{max(means[name]):<6.2f}")


if __name__ == "__main__":
    main()
