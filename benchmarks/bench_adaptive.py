"""Speculation that never loses: the adaptive schedule against the target alone and constant drafting.

Two constructed situations (tiny checkpoints built from configs, exported with the project's own
exporters; exporters/constructed.py), where what the draft accepts is known in advance:

    nothing    a random tiny target and a random tiny DFlash draft (block 16): nothing is accepted.
               Measured at concurrency 1 and 8; the goal is >= 0.95x the target alone.
    mixed      the chain target with a DFlash "zero" draft (block 16): prompts ending on the constant
               token A accept every candidate, prompts ending on an ordinary token accept none. 32
               requests, alternating, 8 in flight (a new one starts when one ends); the goal is that
               the good half keeps drafting and the batch beats both the target alone and drafting
               everything.

Both at two sizes (`--sizes`): "tiny" (hidden 64, 4 layers: a target step of under a millisecond, so
a draft step with its fixed cost of a few milliseconds costs several target steps) and "small" (hidden
512, 16 layers, the draft of one layer as wide: a target step costs several draft steps, as with every
real pair; SmolLM2-135M is hidden 576, 30 layers).

Per situation, one engine per configuration (target alone, constant 15 candidates, adaptive), each
warmed up once; every round runs each configuration once, in turn, so all see the same machine.
Reported: medians over rounds of generated tokens per second, the ratio to the target alone in the
same round (median and range), the share of (request, step) decisions that drafted, tau, and whether
every output equals the target's own.

    python benchmarks/bench_adaptive.py                 # both situations, 5 rounds
    python benchmarks/bench_adaptive.py --rounds 9 --max-new-tokens 256 --json out.json
    python benchmarks/bench_adaptive.py --sizes small --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.bench.sweep import run_with_concurrency
from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.exporters.constructed import (
    A,
    chain_prompts,
    make_chain_target,
    make_scaled_draft,
)
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.target import export_target
from dflash.exporters.tiny import make_tiny_target

CONFIGS = ("target", "constant", "adaptive")
# f32: outputs do not depend on how many rows share a step, so "= target" is an exact check.
F32 = EXACT_OV_CONFIG


@dataclass
class Situation:
    name: str
    target_dir: Path
    draft_dir: Path
    prompts: list[list[int]]
    concurrency: int


@dataclass
class Measured:
    tokens_per_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # over the target alone in the same round
    drafting_share: float | None = None
    tau: float | None = None
    identical: bool = True


# Config overrides of the targets per size (the drafts follow the target's width).
SIZES = {
    "tiny": {},
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),  # fmt: skip
}


def build(workdir: Path, size: str = "tiny") -> dict[str, tuple[Path, Path, list[list[int]], list[list[int]]]]:
    """The two pairs: (target IR, draft IR, good prompts, bad prompts)."""
    overrides = SIZES[size]
    random_hf = make_tiny_target(workdir / "hf-random", "qwen3", seed=0, **overrides)
    random_draft = make_tiny_draft(workdir / "hf-random-draft", random_hf, kind="dflash", draft_block_size=16, seed=0,
                                   num_layers=1 if overrides else 2)  # fmt: skip
    chain_hf, succ = make_chain_target(workdir / "hf-chain", **overrides)
    zero_draft = make_scaled_draft(workdir / "hf-zero-draft", chain_hf, "dflash", 0.0, draft_block_size=16, num_layers=1)
    cycle, constant = chain_prompts(succ)
    texts = [list(range(10 + i, 40 + 3 * i)) for i in range(8)]  # ordinary ids of the tiny vocabulary
    return {
        "nothing": (export_target(random_hf, workdir / "ov-random", weight_format="fp16"),
                    export_draft(random_draft, workdir / "ov-random-draft", weight_format="fp16"), [], texts),
        "mixed": (export_target(chain_hf, workdir / "ov-chain", weight_format="fp16"),
                  export_draft(zero_draft, workdir / "ov-zero-draft", weight_format="fp16"),
                  constant + [constant[0][:-2] + [A]], cycle),
    }  # fmt: skip


def situations(pairs, size: str = "tiny") -> list[Situation]:
    target, draft, _, bad = pairs["nothing"]
    chain, zero, good, cycle = pairs["mixed"]
    return [
        Situation(f"{size}: nothing accepted, c=1", target, draft, bad[:4], 1),
        Situation(f"{size}: nothing accepted, c=8", target, draft, bad, 8),
        # 32 requests, alternating, 8 in flight: a request that accepts everything ends quickly and
        # makes room for the next one.
        Situation(f"{size}: mixed, half accept all, half none, c=8", chain, zero,
                  [p for pair in zip(good * 4, cycle * 4) for p in pair], 8),  # fmt: skip
    ]


def run_once(engine: LLMEngine, prompts, params: SamplingParams, concurrency: int) -> tuple[float, list]:
    """Every prompt through the engine, a new one as soon as one ends, at most `concurrency` at once;
    (seconds, results)."""
    run = run_with_concurrency(engine, prompts, params, concurrency)
    return time.perf_counter() - run.started, run.results


def measure(situation: Situation, rounds: int, max_new_tokens: int) -> dict[str, Measured]:
    engines = {
        "target": LLMEngine(situation.target_dir, EngineConfig(ov_config=F32)),
        "constant": LLMEngine(situation.target_dir, EngineConfig(ov_config=F32), draft_dir=situation.draft_dir),
        "adaptive": LLMEngine(situation.target_dir, EngineConfig(ov_config=F32), draft_dir=situation.draft_dir),
    }
    params = {name: SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True,
                                   num_assistant_tokens_schedule="constant" if name == "constant" else "adaptive")
              for name in CONFIGS}  # fmt: skip
    for name, engine in engines.items():  # warm-up: compile caches, and the adaptive fits
        run_once(engine, situation.prompts, params[name], situation.concurrency)
    out = {name: Measured() for name in CONFIGS}
    reference = None
    for _ in range(rounds):
        seconds = {}
        for name, engine in engines.items():
            stats_before = (engine.drafter.stats.num_decisions, engine.drafter.stats.num_drafting)
            seconds[name], results = run_once(engine, situation.prompts, params[name], situation.concurrency)
            tokens = sum(r.num_generated_tokens for r in results)
            out[name].tokens_per_s.append(tokens / seconds[name])
            if name == "target":
                reference = [r.token_ids for r in results]
            else:
                out[name].identical &= [r.token_ids for r in results] == reference
                decisions = engine.drafter.stats.num_decisions - stats_before[0]
                drafting = engine.drafter.stats.num_drafting - stats_before[1]
                out[name].drafting_share = drafting / decisions if decisions else None
                spec = [r.spec for r in results if r.spec is not None and r.spec.num_drafts]
                drafts = sum(s.num_drafts for s in spec)
                out[name].tau = (sum(s.num_accepted_tokens for s in spec) + drafts) / drafts if drafts else None
        for name in CONFIGS:
            out[name].ratios.append(seconds["target"] / seconds[name])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated, of: " + ", ".join(SIZES))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    if unknown := set(sizes) - set(SIZES):
        parser.error(f"unknown size(s) {', '.join(sorted(unknown))}; choose from {', '.join(SIZES)}")
    with tempfile.TemporaryDirectory(prefix="dflash-bench-adaptive-") as tmp:
        print("building and exporting the constructed pairs ...", file=sys.stderr, flush=True)
        all_situations = [s for size in sizes for s in situations(build(Path(tmp) / size, size), size)]
        report = {}
        print("| situation | config | tok/s (median) | vs target alone (median, range) | drafting | tau | = target |")
        print("| --- | --- | ---: | ---: | ---: | ---: | :---: |")
        for situation in all_situations:
            measured = measure(situation, args.rounds, args.max_new_tokens)
            report[situation.name] = {name: vars(m) for name, m in measured.items()}
            for name, m in measured.items():
                ratio = f"{statistics.median(m.ratios):.2f}x ({min(m.ratios):.2f}-{max(m.ratios):.2f})"
                share = "-" if m.drafting_share is None else f"{m.drafting_share:.0%}"
                tau = "-" if m.tau is None else f"{m.tau:.2f}"
                same = "-" if name == "target" else ("yes" if m.identical else "NO")
                print(f"| {situation.name} | {name} | {statistics.median(m.tokens_per_s):.0f} | {ratio} | {share} | {tau} | {same} |",
                      flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
