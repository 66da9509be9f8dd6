"""What a checkpoint per verified row costs a hybrid (Qwen3.5) target's verification.

Speculative verification of n rows on a hybrid target writes the linear-attention state after every
row into its own checkpoint block (`la.cache_interval` 1), so the accepted row's state can be kept
(core/hybrid_cache.py). The alternative docs/hybrid-targets.md §5.6 names: verify writing only the
final state (interval 0, into a scratch block), and re-run the accepted rows on partial acceptance.
This times one verification call of n rows both ways on the same target and context, in turn, with
the engine's own runner and state tables:

    python benchmarks/bench_hybrid_checkpoints.py                     # the "small" Qwen3.5 of bench_engine.py
    python benchmarks/bench_hybrid_checkpoints.py --target OUT/target --rows 4 8 16

The figures: milliseconds per call (median), the checkpoints' share of a call, the state bytes one
checkpoint holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dflash.core.model_runner import StepInputs, TargetRunner
from dflash.core.paged import SequenceSlice


def run_call(runner: TargetRunner, tokens: np.ndarray, past: int, blocks: list[int], la_blocks: list[int], interval: int) -> float:
    seqs = [SequenceSlice(past, len(tokens), blocks)]
    state = {
        "la.block_indices": np.array(la_blocks, dtype=np.int32),
        "la.block_indices_begins": np.array([0, len(la_blocks)], dtype=np.int32),
        "la.past_lens": np.array([past], dtype=np.int32),
        "la.cache_interval": np.array([interval], dtype=np.int32),
    }
    start = time.perf_counter()
    runner.run(StepInputs(seqs, tokens.astype(np.int64), np.arange(len(tokens), dtype=np.int64), state))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, help="an exported hybrid target (default: bench_engine.py's small Qwen3.5)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "dflash" / "bench")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16], help="verified rows (seed + candidates)")
    parser.add_argument("--context", type=int, default=256, help="tokens before the verification")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.target is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_engine import qwen35_targets

        args.target = qwen35_targets(args.cache_dir, ["small"])[0]

    runner = TargetRunner(args.target)
    num_blocks = -(-(args.context + max(args.rows)) // runner.kv_block_size)
    runner.allocate_cache(num_blocks)
    runner.allocate_state(2 + max(args.rows))
    blocks = list(range(num_blocks))
    rng = np.random.default_rng(0)
    run_call(runner, rng.integers(4, 500, args.context), 0, blocks, [0, 0], 0)  # the context's state in block 0
    print(f"{args.target}: a checkpoint holds {runner.state_tables.bytes_per_block / 2**20:.2f} MiB of state; "
          f"context {args.context} tokens, median of {args.repeats} calls each")  # fmt: skip
    print("| rows | checkpoints (interval 1) ms | final state only (interval 0) ms | checkpoints' share |")
    print("| ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        tokens = rng.integers(4, 500, rows)
        with_ckpt, without = [], []
        for i in range(args.repeats + 2):  # in turn; the first two of each are warm-up
            a = run_call(runner, tokens, args.context, blocks, [0, *range(2, 2 + rows)], 1)
            b = run_call(runner, tokens, args.context, blocks, [0, 1], 0)  # reads 0, writes the scratch block 1
            if i >= 2:
                with_ckpt.append(a)
                without.append(b)
        ms_a, ms_b = 1e3 * statistics.median(with_ckpt), 1e3 * statistics.median(without)
        print(f"| {rows} | {ms_a:.2f} | {ms_b:.2f} | {100 * (ms_a - ms_b) / ms_a:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
