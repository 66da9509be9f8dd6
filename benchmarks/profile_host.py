"""Where a speculative step's host time goes: the engine's phases timed with perf_counter wrappers.

    python benchmarks/profile_host.py                                  # HumanEval, 10 prompts at c=1, default schedule
    python benchmarks/profile_host.py --concurrency 8 --num-prompts 16
    python benchmarks/profile_host.py --constant 3                     # the constant 3 instead of the default
    python benchmarks/profile_host.py --target T --draft D             # another pair than the embedded default

cProfile overstates fine-grained Python work several times over (it times every call it makes); this
wraps only the phases below, each once per step, so what it adds is a few microseconds a step. Printed:
ms per engine step for the step, both models' infer() calls, the host time outside them, and each
phase (inclusive: a phase's line counts the phases it calls, named under it with an indent).
"""

from __future__ import annotations

import argparse
import collections
import copy
import time

from bench_hidden_outputs import add_pair_arguments, pair_dirs

from dflash.bench.datasets import load_dataset
from dflash.core import engine as engine_module
from dflash.core import markov, model_runner, scheduler, speculative
from dflash.core.adaptive import AdaptiveSchedule
from dflash.core.config import EngineConfig, SamplingParams
from dflash.core.draft_runner import DraftRunner
from dflash.core.engine import LLMEngine

# (label, owner, attribute): what is timed; an indented label runs inside the one above it.
PHASES = [
    ("schedule", scheduler.Scheduler, "schedule"),
    ("target: pack rows", engine_module, "pack_target_rows"),
    ("target: run (writes, infer, outputs)", model_runner.TargetRunner, "run"),
    ("target: verify", LLMEngine, "_verify"),
    ("scheduler: update", scheduler.Scheduler, "update_from_output"),
    ("commit (stops, outputs)", LLMEngine, "_commit"),
    ("draft step", speculative.DFlashDrafter, "step"),
    ("  observe verdicts", speculative.DFlashDrafter, "_observe"),
    ("  ingest hidden rows", speculative.DFlashDrafter, "_ingest"),
    ("  plan (schedules)", speculative.DFlashDrafter, "_plan"),
    ("    adaptive plan", AdaptiveSchedule, "plan"),
    ("  pack windows", speculative.DFlashDrafter, "_pack"),
    ("  draft run (writes, infer, outputs)", DraftRunner, "run"),
    ("  select candidates", speculative.DFlashDrafter, "_select"),
    ("    Markov bias", markov.MarkovHeadRunner, "markov_bias"),
    ("  observe costs", AdaptiveSchedule, "observe_target"),
]


def timed(totals: dict[str, float], label: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--constant", type=int, help="a constant number of candidates instead of the default schedule")
    add_pair_arguments(parser)
    args = parser.parse_args()
    target_dir, draft_dir = pair_dirs(args)
    prompts = load_dataset(args.dataset, args.num_prompts + 2)
    engine = LLMEngine(target_dir, EngineConfig(max_num_seqs=args.concurrency), draft_dir=draft_dir)
    schedule = {} if args.constant is None else {"num_assistant_tokens": args.constant, "num_assistant_tokens_schedule": "constant"}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, **schedule)
    engine.generate(prompts[:2], params, chat=True)  # warm-up: every shape's first inference

    totals: dict[str, float] = collections.defaultdict(float)
    for label, owner, attribute in PHASES:
        setattr(owner, attribute, timed(totals, label, getattr(owner, attribute)))
    before = copy.copy(engine.times)
    for i in range(0, args.num_prompts, args.concurrency):
        engine.generate(prompts[2 + i : 2 + i + args.concurrency], params, chat=True)
    times = engine.times - before
    steps, step_s, host = times.num_steps, times.step_s, times.host_s
    target_infer, draft_infer = times.target_infer_s, times.draft_infer_s

    def ms(seconds: float) -> str:
        return f"{1e3 * seconds / steps:7.3f} ms"

    print(f"{steps} steps, c={args.concurrency}, {'constant ' + str(args.constant) if schedule else 'default schedule'}")
    print(f"{'step':40s} {ms(step_s)}")
    print(f"{'target infer()':40s} {ms(target_infer)}")
    print(f"{'draft infer()':40s} {ms(draft_infer)}")
    print(f"{'host (outside both infer())':40s} {ms(host)}  {host / step_s:.1%} of the step")
    for label, *_ in PHASES:
        print(f"{label:40s} {ms(totals[label])}")


if __name__ == "__main__":
    main()
