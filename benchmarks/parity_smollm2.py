"""Greedy agreement of the exported SmolLM2 targets with transformers, at f32 inference precision.

For each weight format the engine (f32 compute, f32 KV cache) generates --num-tokens tokens per
prompt; the report gives, per prompt, the first position where it differs from transformers greedy
`generate` on (a) the exact fp32 weights of the materialized folder and (b) those weights rounded to
fp16 (what an fp16 export stores). "=" means identical for all tokens. fp16 weights are expected to
match (b) exactly; int8 weights (NNCF, per-channel asymmetric) can only be compared with (a), and
drift where two candidates are close.

    python benchmarks/parity_smollm2.py                    # fp16 and int8, exported into the bench cache
    python benchmarks/parity_smollm2.py --num-tokens 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import DEFAULT_CACHE, first_divergence, humaneval_prompts, smollm2_targets  # noqa: E402

F32 = EXACT_OV_CONFIG
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain speculative decoding in one sentence.",
    "List three uses of a hash map.",
]


def transformers_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["fp16", "int8"])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--num-humaneval", type=int, default=4)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    targets = smollm2_targets(args.cache_dir, args.formats)
    hf_dir = args.cache_dir / "smollm2-hf"
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in CHAT_PROMPTS
    ]
    texts = chat + humaneval_prompts(args.num_humaneval)
    labels = [f"chat {i}" for i in range(len(chat))] + [f"HumanEval/{i}" for i in range(args.num_humaneval)]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference = {"fp32 weights": transformers_greedy(model, prompts, args.num_tokens)}
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.half().float())
    reference["fp16-rounded weights"] = transformers_greedy(model, prompts, args.num_tokens)

    print(f"first divergence from transformers greedy ({args.num_tokens} tokens; '=' identical), OpenVINO at f32:")
    print("| export | reference | " + " | ".join(labels) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in labels) + " |")
    for target in targets:
        engine = LLMEngine(target, EngineConfig(ov_config=F32, enable_prefix_caching=False))
        results = engine.generate(prompts, SamplingParams(max_new_tokens=args.num_tokens, ignore_eos=True))
        ours = [r.token_ids for r in results]
        for name, expected in reference.items():
            cells = [first_divergence(a, b) for a, b in zip(ours, expected)]
            print(f"| {target.name} | {name} | " + " | ".join("=" if c is None else str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
