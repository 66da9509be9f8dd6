"""The default schedule's steps at one concurrency, traced: what the draft and the verifying steps cost.

    python benchmarks/trace_adaptive_steps.py                 # HumanEval, 24 prompts in waves of 8
    python benchmarks/trace_adaptive_steps.py --concurrency 8 --num-prompts 24 --dataset benchmarks/chat_prompts.txt
    python benchmarks/trace_adaptive_steps.py --target T --draft D    # another pair than the embedded default

Records every draft step (context rows, block rows, candidate rows, seconds) and every generation step of
the target (rows, seconds, whether it verified candidates) as the adaptive schedule observes them, on the
embedded default pair (DSpark; or `--target` and `--draft`), and prints their sums: where a run that
drafts little loses its time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from bench_hidden_outputs import add_pair_arguments, pair_dirs

from dflash.bench.datasets import load_dataset
from dflash.core import adaptive
from dflash.core.config import EngineConfig, SamplingParams
from dflash.core.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--timeline", action="store_true", help="also print every draft step, in order")
    add_pair_arguments(parser)
    args = parser.parse_args()
    target_dir, draft_dir = pair_dirs(args)
    drafts, targets = [], []
    observe_draft, observe_target = adaptive.AdaptiveSchedule.observe_draft, adaptive.AdaptiveSchedule.observe_target

    def on_draft(self, context_rows, block_rows, candidate_rows, seconds, **kwargs):
        drafts.append((context_rows, block_rows, candidate_rows, seconds))
        return observe_draft(self, context_rows, block_rows, candidate_rows, seconds, **kwargs)

    def on_target(self, rows, seconds, verified_candidates=True, reshaped=False, num_requests=1):
        targets.append((rows, seconds, verified_candidates, num_requests))
        return observe_target(self, rows, seconds, verified_candidates, reshaped, num_requests)

    adaptive.AdaptiveSchedule.observe_draft, adaptive.AdaptiveSchedule.observe_target = on_draft, on_target
    prompts = load_dataset(args.dataset, args.num_prompts)
    engine = LLMEngine(target_dir, EngineConfig(max_num_seqs=args.concurrency), draft_dir=draft_dir)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], params, chat=True)  # warm-up
    drafts.clear()
    targets.clear()
    start = time.perf_counter()
    for first in range(0, len(prompts), args.concurrency):
        engine.generate(prompts[first : first + args.concurrency], params, chat=True)
    total = time.perf_counter() - start
    c = args.concurrency
    print(f"{total:.2f} s in all; target generation steps {len(targets)}, {sum(t[1] for t in targets):.2f} s")
    print(f"draft steps {len(drafts)}, {sum(d[3] for d in drafts):.3f} s, context rows {sum(d[0] for d in drafts)}, "
          f"block rows {sum(d[1] for d in drafts)}")
    print("largest draft steps (context, block, candidates, ms):",
          [(d[0], d[1], d[2], round(d[3] * 1000, 1)) for d in sorted(drafts, key=lambda d: -d[3])[:8]])
    if args.timeline:
        print("draft steps in order (context, block, candidates, ms):",
              [(d[0], d[1], d[2], round(d[3] * 1000, 1)) for d in drafts])
    schedule = engine.drafter.adaptive
    print("fits: draft (fixed, context, block, candidate) =", _ms(schedule.draft_cost.fit()),
          "; target by batch class (fixed, row, reshape) =",
          {k: _ms(cost.fit()) for k, cost in sorted(schedule.target_costs.items())})
    prices = schedule._measured_verify_seconds(c)
    kept = schedule._verify_seconds.get(c, {})
    print(f"row-count prices of verifying steps of {c} requests (rows: ms, steps kept):",
          {rows: (round(prices[rows] * 1000, 1), len(kept[rows][0])) for rows in sorted(prices)})
    for verified, name in ((False, "plain"), (True, "verifying")):
        steps = [t for t in targets if t[2] == verified and t[3] == c]
        if steps:
            print(f"{name} steps of {c} requests: {len(steps)}, median {statistics.median(t[1] for t in steps) * 1000:.2f} ms, "
                  f"{sum(t[1] for t in steps):.2f} s; rows {collections.Counter(t[0] for t in steps).most_common(4)}")


def _ms(fit) -> tuple[float, ...] | None:
    return None if fit is None else tuple(round(c * 1000, 3) for c in fit)


if __name__ == "__main__":
    main()
