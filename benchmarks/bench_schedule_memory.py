"""What the adaptive schedule's memory (EngineConfig.schedule_memory) is worth to short runs.

Two measurements on the embedded default pair (DSpark), one prompt per run, 128 new tokens, EOS ignored:

    python benchmarks/bench_schedule_memory.py --processes 8          # fresh `dflash generate` processes
    python benchmarks/bench_schedule_memory.py --in-process 12 --dataset benchmarks/chat_prompts.txt

--processes N: for each of N prompts, in turn, `dflash generate` with the memory (in the user cache
folder: clear ~/.cache/dflash/schedule first to start it empty), with --no-schedule-memory, and with the
target alone; generation seconds from each run's --json record.
--in-process N: one process, engines loaded once; per prompt, the adaptive schedule fresh (what a new
process had before), restored from the state the previous prompt left (what the memory gives), kept
warm, the constant schedule, and the target alone. Prints each setting's seconds and its ratio to the
target alone measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from dflash.bench.datasets import load_dataset


def fresh_processes(prompts: list[str]) -> dict[str, float]:
    dflash = str(Path(sys.executable).with_name("dflash"))
    settings = {"memory": [], "no memory": ["--no-schedule-memory"], "target alone": ["--num-assistant-tokens", "0"]}
    seconds = dict.fromkeys(settings, 0.0)
    for prompt in prompts:
        for name, extra in settings.items():
            out = subprocess.run([dflash, "generate", prompt, "--max-new-tokens", "128", "--ignore-eos", "--json", *extra],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            record = json.loads(out.splitlines()[-1])
            seconds[name] += record["ttft_s"] + record["tpot_s"] * (record["num_generated_tokens"] - 1)
    return seconds


def in_process(prompts: list[str]) -> dict[str, float]:
    from dflash.core.adaptive import AdaptiveSchedule
    from dflash.core.config import EngineConfig, SamplingParams
    from dflash.core.engine import LLMEngine
    from dflash.exporters.default_pair import ensure_default_pair

    pair = ensure_default_pair("dspark")
    config = EngineConfig(max_num_seqs=1)
    names = ("fresh", "restored", "warm", "constant", "target alone")
    engines = {n: LLMEngine(pair.target_dir, config, draft_dir=None if n == "target alone" else pair.draft_dir) for n in names}
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    per = {n: params for n in names} | {"constant": dataclasses.replace(params, num_assistant_tokens_schedule="constant")}
    for name, engine in engines.items():  # warm-up: compiled shapes, and the state the first restore reads
        engine.generate(prompts[:2], per[name], chat=True)
    state = engines["restored"].drafter.adaptive.state()
    seconds = dict.fromkeys(names, 0.0)
    for prompt in prompts[2:]:
        engines["fresh"].drafter.schedules["adaptive"] = AdaptiveSchedule()
        restored = AdaptiveSchedule()
        restored.restore(json.loads(json.dumps(state)))
        engines["restored"].drafter.schedules["adaptive"] = restored
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            start = time.perf_counter()
            engine.generate([prompt], per[name], chat=True)
            seconds[name] += time.perf_counter() - start
        state = restored.state()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--processes", type=int, default=0, help="prompts, each in fresh processes")
    parser.add_argument("--in-process", type=int, default=0, help="prompts, each with a fresh/restored/warm schedule")
    args = parser.parse_args()
    if args.processes:
        seconds = fresh_processes(load_dataset(args.dataset, args.processes))
        print("fresh processes:", _ratios(seconds))
    if args.in_process:
        seconds = in_process(load_dataset(args.dataset, args.in_process + 2))
        print("in one process:", _ratios(seconds))


def _ratios(seconds: dict[str, float]) -> str:
    base = seconds["target alone"]
    return ", ".join(f"{name} {s:.2f} s ({base / s:.3f}x)" for name, s in seconds.items())


if __name__ == "__main__":
    main()
