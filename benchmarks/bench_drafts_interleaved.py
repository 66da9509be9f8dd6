"""Several drafts (or exports of one draft) against the target alone, interleaved prompt group by group.

`dflash bench` measures one draft at a time, each setting right after its baseline. To compare two
exports of a draft (e.g. with and without a draft vocabulary) on a machine that other jobs load, this
runs every engine on the same group of `--concurrency` prompts before moving on to the next group
(alternating the order), so that load falls on all of them alike; tokens/s and the ratio to the target
alone are summed over all groups:

    python benchmarks/bench_drafts_interleaved.py TARGET full=DRAFT_A cut=DRAFT_B \\
        --dataset humaneval --num-prompts 20 --concurrency 1 --settings adaptive:auto,constant:7

Each draft's acceptance (tau, the mean accepted length with the bonus, and the acceptance at positions
1-4) is summed over the same prompts: the figure that does not depend on the machine's load.
`--no-baseline` leaves the target alone out (acceptance only: no speed ratio).
"""

from __future__ import annotations

import argparse
import sys
import time

from dflash.bench.datasets import load_dataset
from dflash.core.config import EngineConfig, SamplingParams
from dflash.core.engine import LLMEngine
from dflash.core.metrics import SpecDecodingStats


def params(schedule: str | None, candidates: str | None, max_new_tokens: int) -> SamplingParams:
    extra = {}
    if schedule is not None:
        extra = dict(num_assistant_tokens_schedule=schedule,
                     num_assistant_tokens=None if candidates == "auto" else int(candidates))  # fmt: skip
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target_dir")
    parser.add_argument("drafts", nargs="+", help="NAME=DRAFT_DIR")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--settings", default="adaptive:auto", help="SCHEDULE:CANDIDATES, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-baseline", action="store_true", help="leave out the target alone (acceptance only)")
    args = parser.parse_args(argv)
    prompts = load_dataset(args.dataset, args.num_prompts)
    config = EngineConfig(max_num_seqs=args.concurrency)
    engines = {"alone": LLMEngine(args.target_dir, config)}
    for spec in args.drafts:
        name, path = spec.split("=", 1)
        engines[name] = LLMEngine(args.target_dir, config, draft_dir=path)
    runs = [] if args.no_baseline else [("alone", None, None)]
    runs += [(name, *setting.split(":")) for name in engines if name != "alone" for setting in args.settings.split(",")]
    tokens, seconds = dict.fromkeys(runs, 0), dict.fromkeys(runs, 0.0)
    spec = {run: SpecDecodingStats() for run in runs}
    for run in runs:  # warm-up
        engines[run[0]].generate(prompts[:1], params(run[1], run[2], args.max_new_tokens), chat=True)
    for first in range(0, len(prompts), args.concurrency):
        group = prompts[first : first + args.concurrency]
        for run in runs if (first // args.concurrency) % 2 == 0 else runs[::-1]:
            start = time.perf_counter()
            results = engines[run[0]].generate(group, params(run[1], run[2], args.max_new_tokens), chat=True)
            seconds[run] += time.perf_counter() - start
            tokens[run] += sum(len(result.token_ids) for result in results)
            for result in results:
                if result.spec is not None:
                    spec[run].merge(result.spec)
    baseline = None if args.no_baseline else tokens[runs[0]] / seconds[runs[0]]
    print("| engine | schedule | candidates | tau | acceptance 1-4 | steps | tok/s | vs alone |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | ---: |")
    for run in runs:
        rate = tokens[run] / seconds[run]
        stats = spec[run]
        drafted = run[0] != "alone" and stats.num_drafts > 0
        tau = f"{stats.mean_accepted_length:.3f}" if drafted else "-"
        accept = " ".join(f"{a:.3f}" for a in stats.acceptance_by_position[:4]) if drafted else "-"
        ratio = f"{rate / baseline:.2f}x" if baseline else "-"
        print(f"| {run[0]} | {run[1] or '-'} | {run[2] or '-'} | {tau} | {accept} | {stats.num_drafts if drafted else '-'} "
              f"| {rate:.1f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
