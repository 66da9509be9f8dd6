"""Time to the first byte of `dflash generate` in a fresh process (issue 18, item 10).

Each round starts one process per setting, in turn, so every setting sees the same machine; the
first byte is the first byte the process writes on stdout (the first streamed text). Run it once
before timing so the default pair is exported (the first use is not what this measures).

    python benchmarks/bench_first_byte.py --rounds 5
    python benchmarks/bench_first_byte.py --rounds 3 --setting "target alone=--num-assistant-tokens 0"

Prints, per setting, the median and range of the time to the first byte and of the whole run, and
the ratio of each setting's median to the first setting's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

DFLASH = str(Path(sys.executable).with_name("dflash"))


def time_one(args: list[str]) -> tuple[float, float]:
    """(seconds to the first stdout byte, seconds to exit) of `dflash generate ARGS`."""
    start = time.perf_counter()
    proc = subprocess.Popen([DFLASH, "generate", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = os.read(proc.stdout.fileno(), 1)
    first_byte = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"dflash generate {shlex.join(args)} failed (exit {proc.returncode})")
    return first_byte, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="Write a haiku about CPUs.")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--setting", action="append", default=[],
                        help='"NAME=EXTRA ARGS" (repeatable); the default pair with default options is always first')  # fmt: skip
    args = parser.parse_args()
    settings = {"default pair": []}
    for spec in args.setting:
        name, _, extra = spec.partition("=")
        settings[name] = shlex.split(extra)
    base = [args.prompt, "--max-new-tokens", str(args.max_new_tokens), "-q"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, extra in settings.items():
            times[name].append(time_one(base + extra))
    first_median = statistics.median(t[0] for t in times[next(iter(times))])
    print(f"{'setting':<24} {'first byte s (range)':<24} {'whole run s':<12} ratio")
    for name, runs in times.items():
        first = [t[0] for t in runs]
        whole = statistics.median(t[1] for t in runs)
        span = f"{statistics.median(first):.2f} ({min(first):.2f}-{max(first):.2f})"
        print(f"{name:<24} {span:<24} {whole:<12.2f} {statistics.median(first) / first_median:.2f}x")


if __name__ == "__main__":
    main()
