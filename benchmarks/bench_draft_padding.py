"""The draft's calls padded to steady shapes, against the same calls unpadded, on one engine.

    python benchmarks/bench_draft_padding.py                            # default pair (DSpark), c=1 and 8
    python benchmarks/bench_draft_padding.py --concurrency 8 --candidates 3 --rounds 4
    python benchmarks/bench_draft_padding.py --target T --draft D       # another pair

A draft call's rows change with every step's acceptance (each request catches up on the tokens the
target committed), and OpenVINO's CPU plugin prepares every node again when an input's shape differs
from the previous call's. The engine pads every draft call to a multiple of `ROW_BUCKET` rows
(`core/draft_runner.py`). This runs the constant schedule on one speculative engine, wave by wave
(`--concurrency` prompts at a time, each wave from a cold prefix cache), with the padding off
(`row_bucket` 1) and on in turn, and prints per setting: the draft's inference seconds per draft step,
how many draft calls kept the previous call's shape, the rows a call carried, and the draft's inference
time and the wall time as ratios to the unpadded run of the same waves.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from bench_hidden_outputs import add_pair_arguments, pair_dirs

from dflash.bench.datasets import load_dataset
from dflash.core.config import EngineConfig, SamplingParams
from dflash.core.draft_runner import ROW_BUCKET
from dflash.core.engine import LLMEngine


@dataclass
class Tally:
    calls: int = 0
    kept_shape: int = 0  # calls whose input shapes were the previous call's
    rows: int = 0
    seconds: float = 0.0  # inside the draft's infer()


def spy_on(runner) -> dict[str, Tally]:
    """Count every call of the runner into `box["now"]` (a spy around `_infer`: the real call runs)."""
    box, last = {"now": Tally()}, [None]
    infer = runner._infer

    def recording_infer(seqs, rows, sample_rows):
        before = runner.infer_seconds
        infer(seqs, rows, sample_rows)
        shape = (len(rows["input_ids"]), len(seqs), len(sample_rows))
        tally = box["now"]
        tally.calls += 1
        tally.kept_shape += shape == last[0]
        tally.rows += shape[0]
        tally.seconds += runner.infer_seconds - before
        last[0] = shape

    runner._infer = recording_infer
    return box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--candidates", type=int, help="the constant schedule's candidates (default: the draft's block)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    add_pair_arguments(parser)
    args = parser.parse_args()
    target, draft = pair_dirs(args)
    prompts = load_dataset(args.dataset, args.num_prompts)
    for concurrency in args.concurrency:
        engine = LLMEngine(target, EngineConfig(max_num_seqs=concurrency), draft_dir=draft)
        runner = engine.drafter.runner
        k = args.candidates or engine.drafter.spec.max_candidates
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                num_assistant_tokens_schedule="constant", num_assistant_tokens=k)  # fmt: skip
        engine.generate(prompts[:concurrency], params, chat=True)  # warm-up
        settings = {"unpadded": 1, f"padded to {ROW_BUCKET}": ROW_BUCKET}
        logs = {name: Tally() for name in settings}
        box = spy_on(runner)
        wall = dict.fromkeys(settings, 0.0)
        waves = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
        for _ in range(args.rounds):
            for w, wave in enumerate(waves):
                names = list(settings)
                for name in names[w % 2 :] + names[: w % 2]:
                    runner.row_bucket = settings[name]
                    engine.reset_prefix_cache()
                    box["now"] = logs[name]
                    start = time.perf_counter()
                    engine.generate(wave, params, chat=True)
                    wall[name] += time.perf_counter() - start
        runner.row_bucket = ROW_BUCKET
        base = logs["unpadded"]
        print(f"\nc={concurrency}, constant {k}, {len(prompts)} prompts x {args.rounds} rounds")
        print("| setting | draft ms per call | calls that kept the shape | rows per call | draft time | wall |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, log in logs.items():
            print(f"| {name} | {1e3 * log.seconds / log.calls:.2f} | {log.kept_shape / log.calls:.0%} | {log.rows / log.calls:.1f} | "
                  f"{log.seconds / base.seconds:.3f} | {wall[name] / wall['unpadded']:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
