"""The draft's inference alone, two exports of the same draft side by side, on typical windows.

Packs the windows an engine step sends to the draft (context rows, then seed + mask rows, per
request) with random hidden rows and times `DraftRunner.run` (median of --runs, rounds interleaved).
Used to measure the block-rows-only export (context rows skip o_proj, the residual and the MLP):

    git stash; git checkout a45f633      # or any commit before the change
    dflash export DRAFT_CHECKPOINT old-draft --weight-format fp16
    git checkout -; git stash pop
    dflash export DRAFT_CHECKPOINT new-draft --weight-format fp16
    python benchmarks/bench_draft_rows.py TARGET_DIR old-draft new-draft
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from dflash.core.draft_runner import DraftInputs, DraftRunner
from dflash.core.paged import SequenceSlice

CASES = {
    "c=1: 3 context + 16 block rows": [(3, 16)],
    "c=1: 3 context + 4 block rows": [(3, 4)],
    "c=8: 3 context + 16 block rows each": [(3, 16)] * 8,
    "c=8: 3 context + 4 block rows each": [(3, 4)] * 8,
    "prefill: 200 context + 16 block rows": [(200, 16)],
    "catch-up at c=8: 64 context + 4 block rows each": [(64, 4)] * 8,
}
PAST = 64  # tokens already in each request's draft KV


def pack(windows: list[tuple[int, int]], width: int, kv_block_size: int, mask_token: int, rng) -> DraftInputs:
    seqs, token_ids, token_types, candidate_rows, row, first_block = [], [], [], [], 0, 0
    for num_context, num_block in windows:
        num_kv_blocks = (PAST + num_context + num_block + kv_block_size - 1) // kv_block_size
        seqs.append(SequenceSlice(PAST, num_context + num_block, list(range(first_block, first_block + num_kv_blocks))))
        first_block += num_kv_blocks
        token_ids += [mask_token] * num_context + [100] + [mask_token] * (num_block - 1)
        token_types += [0] * num_context + [1] * num_block
        candidate_rows += range(row + num_context + 1, row + num_context + num_block)
        row += num_context + num_block
    hidden = rng.standard_normal((row, width)).astype(np.float32)
    return DraftInputs(seqs, np.array(token_ids, np.int64), np.array(token_types, np.int64), hidden,
                       np.array(candidate_rows, np.int64))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target_dir")
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args(argv)
    runners = {name: DraftRunner(path, args.target_dir) for name, path in (("before", args.before), ("after", args.after))}
    for runner in runners.values():
        runner.allocate_cache(256)
    first = runners["before"]
    rng = np.random.default_rng(0)
    print("| window | before ms | after ms | after / before |")
    print("| --- | ---: | ---: | ---: |")
    for name, windows in CASES.items():
        inputs = pack(windows, first.hidden_states_width, first.kv_block_size, first.spec.mask_token_id, rng)
        times: dict[str, list[float]] = {key: [] for key in runners}
        for _ in range(3):
            runner_list = list(runners.items())
            for key, runner in runner_list:
                runner.run(inputs)
            for _ in range(args.runs):
                for key, runner in runner_list:
                    start = time.perf_counter()
                    runner.run(inputs)
                    times[key].append(time.perf_counter() - start)
        before, after = (statistics.median(times[key]) * 1e3 for key in ("before", "after"))
        print(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
