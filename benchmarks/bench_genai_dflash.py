"""DFlash in the dflash engine against openvino-genai's own DFlash path, one request at a time.

The peer is openvino-genai 2026.4.1's ContinuousBatchingPipeline with a DFlash draft: its stateful
SDPA draft runner, which takes one request at a time and a draft exported by optimum-intel 2.2.0.
Both run the same draft checkpoint: dflash exports it in its per-row PagedAttention layout (`dflash
export`), the peer gets optimum-intel's stateful export of the same weights (exporters/genai_draft.py),
both stored fp16. Same target IR, same prompt token ids, greedy, ignore_eos, the same number of
candidates per step (`num_assistant_tokens`), the same max_num_batched_tokens and target KV blocks,
the same OpenVINO properties. Requests run one by one (concurrency 1, the only one the peer supports),
the two engines taking turns prompt by prompt, the first alternating.

Reported per K: generated tokens per second, the ratio ours/peer by wall time and by process CPU time,
mean accepted length (accepted + 1 per verification step, the bonus token included) for each, our
host time per speculative step outside the target's and the draft's infer() calls (its share of the step), how
many prompts accepted exactly the same number of candidates, and how many outputs are identical.
With --exact (f32 inference and KV caches, dynamic quantization off) both compute the same function of
the same weights, so acceptance and outputs must be equal prompt for prompt (exit 1 if not); with the
default bf16 inference they may drift apart.

    python benchmarks/bench_genai_dflash.py                          # the embedded default pair
    python benchmarks/bench_genai_dflash.py --num-assistant-tokens 5 15 --num-prompts 20
    python benchmarks/bench_genai_dflash.py --exact --num-prompts 4  # acceptance equality, f32
    python benchmarks/bench_genai_dflash.py --target T --draft D --draft-checkpoint CKPT
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import openvino as ov

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import DEFAULT_CACHE, environment, first_divergence, humaneval_prompts  # noqa: E402

from dflash.core.config import SamplingParams, compile_properties  # noqa: E402
from dflash.core.engine import EngineConfig, LLMEngine  # noqa: E402


@dataclass
class RequestRun:
    token_ids: list[int]
    seconds: float
    cpu_seconds: float
    num_drafts: int  # verification steps with candidates
    num_accepted: int
    step_seconds: float = 0.0  # ours: inside engine steps
    host_seconds: float = 0.0  # ours: of them, outside the target's and the draft's infer() calls
    num_steps: int = 0


class Ours:
    name = "dflash"

    def __init__(self, target: Path, draft: Path, ov_config: dict[str, str], max_num_batched_tokens: int):
        self.engine = LLMEngine(
            target,
            EngineConfig(
                ov_config=ov_config,
                enable_prefix_caching=False,
                max_num_seqs=1,
                max_num_batched_tokens=max_num_batched_tokens,
            ),
            draft_dir=draft,
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.runner.num_blocks

    def run(self, prompt: list[int], max_new_tokens: int, num_assistant_tokens: int) -> RequestRun:
        # K candidates every step, as the peer drafts (not the adaptive default, which may draft fewer or none)
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, num_assistant_tokens=num_assistant_tokens,
                                num_assistant_tokens_schedule="constant")  # fmt: skip
        times_before = copy.copy(self.engine.times)
        start, cpu_start = time.perf_counter(), time.process_time()
        (result,) = self.engine.generate([prompt], params)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if result.error:
            raise RuntimeError(f"dflash: {result.error}")
        times = self.engine.times - times_before
        return RequestRun(list(result.token_ids), seconds, cpu_seconds, result.spec.num_drafts, result.spec.num_accepted_tokens,
                          times.step_s, times.host_s, times.num_steps)  # fmt: skip


class Peer:
    name = "genai"

    def __init__(self, target: Path, draft: Path, ov_config: dict[str, str], max_num_batched_tokens: int, num_kv_blocks: int):
        import openvino_genai as ov_genai

        self._genai = ov_genai
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_batched_tokens = max_num_batched_tokens
        scheduler.max_num_seqs = 1
        scheduler.enable_prefix_caching = False  # the DFlash path rejects it
        scheduler.num_kv_blocks = num_kv_blocks
        properties = {**ov_config, "draft_model": ov_genai.draft_model(str(draft), "CPU", **ov_config)}
        self.pipeline = ov_genai.ContinuousBatchingPipeline(str(target), scheduler, "CPU", properties)

    def run(self, prompt: list[int], max_new_tokens: int, num_assistant_tokens: int) -> RequestRun:
        config = self._genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.ignore_eos = True
        config.do_sample = False
        config.num_assistant_tokens = num_assistant_tokens
        tensor = ov.Tensor(np.asarray([prompt], dtype=np.int64))
        start, cpu_start = time.perf_counter(), time.process_time()
        (result,) = self.pipeline.generate([tensor], [config])
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        metrics = result.extended_perf_metrics
        # One draft inference per verification step; the peer's own draft-token counter stays 0 on this
        # path, so the draft calls are counted from its raw per-inference durations.
        num_drafts = len(metrics.draft_model_metrics.raw_metrics.m_durations)
        return RequestRun(list(result.m_generation_ids[0]), seconds, cpu_seconds, num_drafts, metrics.get_num_accepted_tokens())


@dataclass
class Row:
    num_assistant_tokens: int
    num_prompts: int
    ours: list[RequestRun] = field(default_factory=list)
    peer: list[RequestRun] = field(default_factory=list)

    @staticmethod
    def _tps(runs: list[RequestRun], cpu: bool = False) -> float:
        return sum(len(r.token_ids) for r in runs) / sum(r.cpu_seconds if cpu else r.seconds for r in runs)

    @staticmethod
    def _tau(runs: list[RequestRun]) -> float:
        drafts = sum(r.num_drafts for r in runs)
        return (sum(r.num_accepted for r in runs) + drafts) / drafts if drafts else float("nan")

    def summary(self) -> dict:
        same_acceptance = sum(a.num_accepted == b.num_accepted and a.num_drafts == b.num_drafts for a, b in zip(self.ours, self.peer))
        divergence = [first_divergence(a.token_ids, b.token_ids) for a, b in zip(self.ours, self.peer)]
        return {
            "num_assistant_tokens": self.num_assistant_tokens,
            "num_prompts": self.num_prompts,
            "dflash_tps": self._tps(self.ours),
            "genai_tps": self._tps(self.peer),
            "ratio_wall": self._tps(self.ours) / self._tps(self.peer),
            "ratio_cpu": self._tps(self.ours, cpu=True) / self._tps(self.peer, cpu=True),
            "median_request_ratio": statistics.median(b.seconds / a.seconds for a, b in zip(self.ours, self.peer)),
            "dflash_tau": self._tau(self.ours),
            "genai_tau": self._tau(self.peer),
            "dflash_host_share": sum(r.host_seconds for r in self.ours) / sum(r.step_seconds for r in self.ours),
            "dflash_host_ms_per_step": 1e3 * sum(r.host_seconds for r in self.ours) / sum(r.num_steps for r in self.ours),
            "same_acceptance": same_acceptance,
            "identical_outputs": sum(d is None for d in divergence),
        }


def format_table(summaries: list[dict]) -> str:
    lines = [
        "| K | prompts | dflash tok/s | genai tok/s | ours/peer (wall) | ours/peer (CPU time) | median per-request ratio | "
        "tau dflash | tau genai | dflash host share of step | dflash host ms/step | same acceptance | identical outputs |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        lines.append(
            f"| {s['num_assistant_tokens']} | {s['num_prompts']} | {s['dflash_tps']:.1f} | {s['genai_tps']:.1f} | "
            f"{s['ratio_wall']:.2f} | {s['ratio_cpu']:.2f} | {s['median_request_ratio']:.2f} | {s['dflash_tau']:.2f} | "
            f"{s['genai_tau']:.2f} | {100 * s['dflash_host_share']:.1f}% | {s['dflash_host_ms_per_step']:.2f} | {s['same_acceptance']}/{s['num_prompts']} | {s['identical_outputs']}/{s['num_prompts']} |"
        )
    return "\n".join(lines)


def resolve_models(args: argparse.Namespace, log) -> tuple[Path, Path, Path]:
    """(target IR, dflash draft IR, peer's stateful draft IR), exporting what is missing."""
    from dflash.exporters.genai_draft import export_genai_stateful_draft

    if args.target:
        if not (args.draft and args.draft_checkpoint):
            raise SystemExit("--target needs --draft (dflash export) and --draft-checkpoint (its source checkpoint)")
        target, draft, checkpoint = args.target, args.draft, args.draft_checkpoint
        name = f"{Path(checkpoint).name}-fp16"
    else:
        from dflash.exporters.default_pair import DRAFTS, DRAFTS_DIR, ensure_default_pair

        pair = ensure_default_pair("dflash", on_step=log)
        target, checkpoint = pair.target_dir, DRAFTS_DIR / DRAFTS["dflash"]
        # Exports named after the default pair's draft folder, which carries the checkpoint's fingerprint:
        # a new shipped checkpoint gets exports of its own (named after the checkpoint alone, a stale
        # export of the previous weights was reused).
        name = pair.draft_dir.name
        # The default pair's draft proposes from a draft vocabulary (docs/draft-format.md); the peer's
        # from the whole vocabulary. Like for like: our export of the same checkpoint without the cut.
        draft = args.cache_dir / "dflash-draft" / f"{name}-whole-vocab"
        if not (draft / "openvino_model.xml").is_file():
            from dflash.exporters.draft import export_draft

            log(f"exporting {checkpoint} with its whole vocabulary into {draft}")
            export_draft(checkpoint, draft, draft_vocab_size=0, overwrite=True)
    stateful = args.cache_dir / "genai-dflash" / f"{name}-stateful"
    if not (stateful / "openvino_model.xml").is_file():
        log(f"exporting {checkpoint} with optimum-intel's stateful DFlash exporter into {stateful}")
        partial = stateful.with_name(stateful.name + ".partial")
        export_genai_stateful_draft(checkpoint, partial)
        partial.replace(stateful)
    return target, draft, stateful


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, help="exported target (default: the embedded default pair)")
    parser.add_argument("--draft", type=Path, help="the draft exported by `dflash export`")
    parser.add_argument("--draft-checkpoint", type=Path, help="the DFlash checkpoint --draft was exported from")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where the peer's draft is exported (default {DEFAULT_CACHE})")
    parser.add_argument("--num-prompts", type=int, default=10, help="the first N HumanEval prompts")
    parser.add_argument("--num-assistant-tokens", type=int, nargs="+", default=[15])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--no-chat", action="store_true", help="tokenize prompts as plain text, not with the chat template")
    parser.add_argument("--exact", action="store_true", help="f32 inference: acceptance and outputs must match")
    parser.add_argument("--ov-config", nargs="*", default=[], metavar="KEY=VALUE", help="OpenVINO properties for both")
    parser.add_argument("--json", type=Path, help="write the per-request measurements here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from dflash.core.tokenization import tokenize_prompt

    target, draft, stateful = resolve_models(args, log)
    ov_config = dict(item.split("=", 1) for item in args.ov_config)
    if args.exact:  # f32 everywhere, the KV caches too (the peer's stateful draft state defaults to less)
        ov_config.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    ov_config = compile_properties(ov_config)  # what our engine compiles with, for the peer too
    ours = Ours(target, draft, ov_config, args.max_num_batched_tokens)
    peer = Peer(target, stateful, ov_config, args.max_num_batched_tokens, ours.num_kv_blocks)
    chat = not args.no_chat and bool(getattr(ours.engine.tokenizer, "chat_template", None))
    prompts = [tokenize_prompt(ours.engine.tokenizer, text, chat=chat)[1] for text in humaneval_prompts(args.num_prompts)]
    log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens (chat template: {chat})")

    for engine in (ours, peer):  # warm-up, not measured
        engine.run(prompts[0], 16, args.num_assistant_tokens[0])
    rows = []
    for k in args.num_assistant_tokens:
        row = Row(k, len(prompts))
        for index, prompt in enumerate(prompts):
            pair = (ours, peer) if index % 2 == 0 else (peer, ours)
            for engine in pair:
                (row.ours if engine is ours else row.peer).append(engine.run(prompt, args.max_new_tokens, k))
            a, b = row.ours[-1], row.peer[-1]
            log(
                f"  K={k} prompt {index}: dflash {len(a.token_ids) / a.seconds:.1f} tok/s, {a.num_accepted} accepted in "
                f"{a.num_drafts} steps; genai {len(b.token_ids) / b.seconds:.1f} tok/s, {b.num_accepted} accepted in {b.num_drafts} steps"
            )
        rows.append(row)
    del ours, peer
    gc.collect()

    env = environment()
    print(f"machine: {env['cpu']}, {env['cores']} cores; openvino {env['openvino']}, genai {env['openvino_genai']}")
    print(
        f"target {target}; dflash draft {draft}; genai draft {stateful}; greedy, ignore_eos, {args.max_new_tokens} new "
        f"tokens, concurrency 1, max_num_batched_tokens {args.max_num_batched_tokens}, ov_config {ov_config or 'defaults'}"
    )
    summaries = [row.summary() for row in rows]
    print(format_table(summaries))
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": [{**s, "ours": [asdict(x) for x in r.ours],
                                                                      "peer": [asdict(x) for x in r.peer]}
                                                                     for s, r in zip(summaries, rows)]}, indent=2))  # fmt: skip
    if args.exact:
        unequal = [s["num_assistant_tokens"] for s in summaries
                   if s["same_acceptance"] != s["num_prompts"] or s["identical_outputs"] != s["num_prompts"]]  # fmt: skip
        if unequal:
            print(f"f32: acceptance or outputs differ from genai at K={unequal}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
