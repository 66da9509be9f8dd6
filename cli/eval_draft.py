"""`dflash eval-draft`: a trained draft checkpoint's acceptance in PyTorch, on any prompts, as the engine counts it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ._errors import handled_errors
from ._options import DebugOpt, JsonOpt, QuietOpt
from ._output import Output

EXAMPLES = """\
Examples:

  dflash eval-draft exporters/default_drafts/smollm2-135m-dflash-b16                   # default target, HumanEval
  dflash eval-draft drafts/smollm2-dflash --dataset benchmarks/chat_prompts.txt --json
  dflash eval-draft drafts/my-draft --target ./my-target --num-prompts 32 --num-candidates 6

  # side by side with the engine on the same prompts:
  dflash bench --dataset benchmarks/chat_prompts.txt --num-prompts 0 --concurrency 1 --json > bench.json
"""


def eval_draft(
    checkpoint: Annotated[Path, typer.Argument(help="A draft checkpoint folder (what `dflash train` writes, z-lab or DeepSpec layout).", show_default=False)],
    target: Annotated[Optional[Path], typer.Option("--target", help="The target's Hugging Face folder (default: the embedded SmolLM2-135M-Instruct, materialized once into the cache).", show_default=False)] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="humaneval (164 prompts) or a prompts file (.txt / .jsonl), as `dflash bench` reads.")] = "humaneval",
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=0, help="The first N prompts (0: all).")] = 0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=2, help="Tokens the target answers per prompt (greedy, EOS ignored, as `dflash bench`).")] = 128,
    num_candidates: Annotated[Optional[int], typer.Option("--num-candidates", min=1, help="Candidates per step (default: all the block yields).", show_default=False)] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the chat template (as `dflash bench` does for chat models).")] = True,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Prompts answered at once.")] = 8,
    draft_vocab_size: Annotated[Optional[int], typer.Option("--draft-vocab-size", min=0, help="Propose only the first N tokens of the checkpoint's draft_vocab.json, as `dflash export --draft-vocab-size N` (default: the size that file gives, as the export; 0: the whole vocabulary).", show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Measure a draft checkpoint's acceptance in PyTorch on a prompts set, counted exactly as the engine counts it.

    The target answers each prompt greedily (f32 on cpu), then the engine's steps are replayed on that answer: tau (mean accepted length, bonus included) and acceptance by draft position, the figures `dflash bench` reports for the exported pair on the same prompts. A draft_vocab.json in the checkpoint is honoured as `dflash export` honours it (only those tokens are proposed). Exit codes: 0 ok, 1 failed, 2 usage, 130 interrupted.
    """
    output = Output(json_mode=json_output, quiet=quiet)
    with handled_errors(output, debug=debug):
        from dflash.bench.datasets import load_dataset
        from dflash.core.tokenization import tokenize_prompt
        from dflash.training.evaluate import evaluate_draft, load_draft_vocab, load_trained_draft
        from dflash.training.target import load_target, resolve_device

        torch_device = resolve_device(device)
        target_dir = target or _default_target(output)
        with output.status(f"Loading {target_dir}"):
            loaded = load_target(target_dir, torch_device)
            draft, config = load_trained_draft(checkpoint, torch_device)
            draft_vocab = load_draft_vocab(checkpoint, draft_vocab_size)
        prompts = load_dataset(dataset, num_prompts or None)
        prompt_ids = [tokenize_prompt(loaded.tokenizer, p, chat=chat and bool(loaded.tokenizer.chat_template))[1] for p in prompts]

        from .train import _progress

        with _progress(output, "Evaluating", len(prompt_ids), "prompts", lines=False) as advance:
            result = evaluate_draft(loaded, draft, config, prompt_ids, max_new_tokens=max_new_tokens,
                                    num_candidates=num_candidates, batch_size=batch_size, draft_vocab=draft_vocab,
                                    on_progress=lambda done, total: advance(done))
        summary: dict[str, Any] = {"checkpoint": str(checkpoint), "target": str(target_dir), "dataset": dataset,
                                   "kind": config.kind, "block_size": config.draft_block_size,
                                   "draft_vocab_size": len(draft_vocab) if draft_vocab is not None else None, **result.to_json()}
        if json_output:
            output.json(summary)
            return
        acceptance = " ".join(f"{a:.2f}" for a in result.acceptance_by_position)
        output.data(f"{config.kind} draft {checkpoint} on {dataset} ({len(prompt_ids)} prompts, {max_new_tokens} new tokens, "
                    f"{result.num_candidates} candidates{_vocab_note(draft_vocab)}): tau {result.mean_accepted_length:.3f} over {result.steps} steps")
        output.data(f"acceptance by position: {acceptance}")


def _vocab_note(draft_vocab: list[int] | None) -> str:
    return f", {len(draft_vocab)}-token draft vocabulary" if draft_vocab is not None else ""


def _default_target(output: Output) -> Path:
    """The embedded SmolLM2 target as a Hugging Face folder in the cache (materialized from the GGUF once)."""
    from dflash.exporters.default_pair import cache_dir
    from dflash.exporters.smollm2 import materialize_smollm2
    from dflash.exporters.staging import quiet_libraries

    folder = cache_dir() / "default" / "smollm2-135m-instruct-hf"
    # quiet_libraries: transformers' GGUF conversion, weight-loading and shard-writing bars went to stderr
    # under --json and -q too
    with output.status(f"Materializing SmolLM2-135M-Instruct into {folder} (once)"), quiet_libraries():
        return materialize_smollm2(folder)


if __name__ == "__main__":
    typer.run(eval_draft)
