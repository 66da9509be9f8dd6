"""The default schedule against never drafting, on one engine: what drafting costs where it should not pay.

    python benchmarks/bench_never_drafting.py                       # HumanEval, 32 prompts, waves of 8, 3 rounds
    python benchmarks/bench_never_drafting.py --dataset benchmarks/chat_prompts.txt --concurrency 16
    python benchmarks/bench_never_drafting.py --constant 3          # also the constant 3
    python benchmarks/bench_never_drafting.py --schedule-memory     # the schedule as `dflash bench` left it
    python benchmarks/bench_never_drafting.py --target T --draft D  # another pair than the embedded default
    python benchmarks/bench_never_drafting.py --variant margin0:min_gain=0 --variant same:  # schedule A/B

One speculative engine on the embedded default pair (DSpark; or `--target` and `--draft`) serves every setting: never drafting
(`SamplingParams(num_assistant_tokens=0)`: the target still emits the hidden states), the default
(adaptive) schedule, and optionally constants and variants of the default (`--variant`: schedule attributes
set while that setting's waves run; a variant with none measures the spread between two identical
settings); the target alone runs on an engine of its own
(`--target-alone`). The settings take turns wave by wave (closed waves of `--concurrency` prompts, as
`dflash bench` runs them), each wave from a cold prefix cache: on one engine, a setting that ran a
prompt second would otherwise skip its prefill. Two engines compiled from the same files run the same
steps 2-5% apart on a small VM, and a setting's prefill steps are a quarter of a wave at c=8, which is
why the comparison that decides is the one on one engine.

Printed: per round the ratio of each setting's wall time to never drafting's (cumulative), then per
setting where its time went (the target's generation steps and prefill steps, the draft's steps, host
work outside both infer() calls; the target's part includes the prompts' prefill) and the share of
(request, step) decisions that drafted, and the batch sizes and candidate counts of the default's plans
that drafted.
"""

from __future__ import annotations

import argparse
import collections
import copy
import time

from bench_hidden_outputs import add_pair_arguments, pair_dirs

from dflash.bench.datasets import load_dataset
from dflash.core import adaptive
from dflash.core.config import EngineConfig, SamplingParams
from dflash.core.engine import LLMEngine
from dflash.core.schedule_memory import ScheduleMemory
from dflash.exporters.default_pair import cache_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--constant", type=int, nargs="*", default=[], help="also these constant candidate counts")
    parser.add_argument("--target-alone", action="store_true", help="also the target alone, on its own engine")
    parser.add_argument("--schedule-memory", action="store_true",
                        help="start from what `dflash bench` and `dflash generate` kept (~/.cache/dflash/schedule), without writing back")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:ATTR=VALUE,...",
                        help="also the default schedule with these AdaptiveSchedule attributes set, e.g. margin0:min_gain=0 (repeatable)")  # fmt: skip
    add_pair_arguments(parser)
    args = parser.parse_args()
    target_dir, draft_dir = pair_dirs(args)
    prompts = load_dataset(args.dataset, args.num_prompts)
    config = EngineConfig(max_num_seqs=args.concurrency)
    engine = LLMEngine(target_dir, config, draft_dir=draft_dir)
    schedule = engine.drafter.adaptive
    if args.schedule_memory:  # read, never written: a benchmark does not change what later runs start from
        memory = ScheduleMemory.for_engine(cache_dir() / "schedule", target_dir, draft_dir, config)
        print(
            f"schedule memory {memory.path}: {'restored' if memory.load(schedule) else 'none that fits, starting from nothing'}"
        )

    def params(**kwargs) -> SamplingParams:
        return SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, **kwargs)

    settings = {"never drafting": (engine, params(num_assistant_tokens=0)), "default": (engine, params())}
    for k in args.constant:
        settings[f"constant {k}"] = (engine, params(num_assistant_tokens=k, num_assistant_tokens_schedule="constant"))
    overrides: dict[str, dict[str, float]] = {}  # setting -> AdaptiveSchedule attributes set while its waves run
    for variant in args.variant:
        name, _, assignments = variant.partition(":")
        overrides[name] = {key: float(value) for key, value in (a.split("=", 1) for a in assignments.split(",") if a)}
        for key in overrides[name]:
            if not hasattr(schedule, key):
                parser.error(f"--variant {variant}: AdaptiveSchedule has no attribute {key!r}")
        settings[name] = (engine, params())
    if args.target_alone:
        settings["target alone"] = (LLMEngine(target_dir, config), params())

    plans: collections.Counter = collections.Counter()  # (requests in the batch, drafting, candidates) of the default's plans
    plan = adaptive.AdaptiveSchedule.plan

    def counting_plan(self, candidates, **kwargs):
        ks = plan(self, candidates, **kwargs)
        if any(ks.values()):
            plans[(kwargs["num_generating"], sum(1 for k in ks.values() if k), sum(ks.values()))] += 1
        return ks

    adaptive.AdaptiveSchedule.plan = counting_plan
    for each, sampling in settings.values():
        each.generate(prompts[:2], sampling, chat=True)  # warm-up
    plans.clear()
    wall = dict.fromkeys(settings, 0.0)
    times, decisions = {}, {name: [0, 0] for name in settings}
    waves = [prompts[i : i + args.concurrency] for i in range(0, len(prompts), args.concurrency)]
    for round_index in range(args.rounds):
        for w, wave in enumerate(waves):
            names = list(settings)
            for name in names[w % len(names) :] + names[: w % len(names)]:
                each, sampling = settings[name]
                each.reset_prefix_cache()
                saved = {key: getattr(schedule, key) for key in overrides.get(name, {})}
                for key, value in overrides.get(name, {}).items():
                    setattr(schedule, key, value)
                before, drafting, decided = copy.copy(each.times), schedule.num_drafting, schedule.num_decisions
                start = time.perf_counter()
                each.generate(wave, sampling, chat=True)
                wall[name] += time.perf_counter() - start
                for key, value in saved.items():
                    setattr(schedule, key, value)
                step = each.times - before
                times[name] = step if name not in times else times[name] + step
                if each is engine:
                    decisions[name][0] += schedule.num_drafting - drafting
                    decisions[name][1] += schedule.num_decisions - decided
        ratios = ", ".join(f"{name} {wall['never drafting'] / seconds:.3f}x" for name, seconds in wall.items())
        print(f"after round {round_index + 1}: {ratios}", flush=True)
    print("\nwhere the time went (seconds; 'host' is the step time outside both models' infer() calls):")
    for name, step in times.items():
        drafted, decided = decisions[name]
        share = f"{drafted / decided:.1%}" if decided else "-"
        print(f"  {name:16s} wall {wall[name]:6.2f}  steps {step.num_steps:5d}  target {step.target_s:6.2f}  "
              f"draft {step.draft_s:5.2f}  host {step.host_s:5.2f}  drafting {share}")  # fmt: skip
    top = ", ".join(f"({n}, {d}, {k}): {count}" for (n, d, k), count in plans.most_common(10))
    print(f"\nthe default's plans that drafted (batch size, requests drafting, candidates: plans): {top or 'none'}")


if __name__ == "__main__":
    main()
