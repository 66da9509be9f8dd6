"""`dflash train`: train a DFlash or DSpark draft for a target on the target's own greedy answers."""

from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer

from ._errors import handled_errors
from ._options import DebugOpt, DraftKind, JsonOpt, QuietOpt
from ._output import Output

EXAMPLES = """\
Examples:

  dflash train ./SmolLM2-135M-Instruct drafts/smollm2-dflash --generate-data 2000 --device cuda

  dflash train ./SmolLM2-135M-Instruct drafts/smollm2-dspark --kind dspark --data drafts/smollm2-dflash/train_data.jsonl

  dflash train ./my-target ./my-draft --num-layers 2 --block-size 8 --steps 3000 --time-limit 1800

  dflash export ./SmolLM2-135M-Instruct out/ --draft drafts/smollm2-dflash
"""

DATA_FILE = "train_data.jsonl"
DEFAULT_PROMPTS = 1000


class Device(str, Enum):
    cuda = "cuda"
    cpu = "cpu"


class SaveDtype(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


def train(
    target: Annotated[Path, typer.Argument(help="The target: a local Hugging Face causal LM folder (chat model).", show_default=False)],
    output_dir: Annotated[Path, typer.Argument(help="Folder for the draft checkpoint (what `dflash export` reads).", show_default=False)],
    kind: Annotated[DraftKind, typer.Option("--kind", help="dflash: z-lab layout, the seed row predicts nothing. dspark: DeepSpec layout, the anchor row predicts, Markov head.")] = DraftKind.dflash,
    block_size: Annotated[Optional[int], typer.Option("--block-size", help="Rows per block, seed/anchor included (default: 16 for dflash, 7 for dspark).", show_default=False)] = None,
    num_layers: Annotated[int, typer.Option("--num-layers", help="Draft decoder layers.")] = 1,
    markov_rank: Annotated[Optional[int], typer.Option("--markov-rank", help="Rank of the DSpark Markov head, 0 for none (default: 32 for dspark).", show_default=False)] = None,
    target_layer_ids: Annotated[Optional[str], typer.Option("--target-layer-ids", help="Target layers the draft reads, e.g. 1,15,27 (default: z-lab's rule for the draft depth).", show_default=False)] = None,
    mask_token_id: Annotated[Optional[int], typer.Option("--mask-token-id", help="Token id of the block's mask rows (default: chosen from the tokenizer, see docs).", show_default=False)] = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="Training data: JSONL of token ids with prompt_len (as --generate-data writes).", show_default=False)] = None,
    generate_data: Annotated[Optional[int], typer.Option("--generate-data", help=f"Answer N built-in (or --prompts) prompts with the target first (default: {DEFAULT_PROMPTS} when --data is not given).", show_default=False)] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompts for --generate-data: a text file (one per line) or JSONL with \"prompt\".", show_default=False)] = None,
    save_data: Annotated[Optional[Path], typer.Option("--save-data", help=f"Where generated data goes (default: OUTPUT_DIR/{DATA_FILE}).", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest generated response.")] = 256,
    gen_batch_size: Annotated[Optional[int], typer.Option("--gen-batch-size", help="Prompts per generate call (default: 256 on cuda, 8 on cpu).", show_default=False)] = None,
    data_only: Annotated[bool, typer.Option("--data-only", help="Generate the training data and stop (train later with --data).")] = False,
    gen_time_limit: Annotated[Optional[float], typer.Option("--gen-time-limit", help="Stop generating after about this many seconds (keeps what is done).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (default: --epochs passes over the data).", show_default=False)] = None,
    epochs: Annotated[float, typer.Option("--epochs", help="Passes over the data when --steps is not given.")] = 1.0,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 8,
    num_anchors: Annotated[int, typer.Option("--num-anchors", help="Blocks drawn per sequence and step.")] = 64,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, warmup then cosine).")] = 6e-4,
    max_length: Annotated[int, typer.Option("--max-length", help="Longest training sequence in tokens (longer ones are cut).")] = 2048,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="Train for about this many seconds at most; the schedule ends on time.", show_default=False)] = None,
    eval_sequences: Annotated[int, typer.Option("--eval-sequences", help="Sequences held out to measure the draft before and after (at most a tenth).")] = 64,
    save_dtype: Annotated[SaveDtype, typer.Option("--save-dtype", help="Precision of the saved weights.")] = SaveDtype.float16,
    max_shard_mb: Annotated[Optional[float], typer.Option("--max-shard-mb", help="Split the weights into safetensors shards of at most this size.", show_default=False)] = None,
    log_every: Annotated[int, typer.Option("--log-every", help="Print loss, accuracy and tau every this many steps.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed for initialisation, anchors and batches.")] = 0,
    device: Annotated[Optional[Device], typer.Option("--device", help="cuda or cpu (default: cuda when available).", show_default=False)] = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Train a DFlash or DSpark draft for TARGET and save it in OUTPUT_DIR.

    The data are the target's own greedy answers (chat template applied) to built-in prompts (coding and general instructions, no benchmark set) or to --prompts; --data reuses a file written earlier. Training follows DFlash: random anchors in each response, blocks of the anchor and mask tokens that read the target's hidden states, cross-entropy with position decay; --kind dspark predicts from the anchor row and adds the Markov head. The checkpoint is in the z-lab (dflash) or DeepSpec (dspark) format that `dflash export` reads.
    """
    output = Output(json_mode=json_output, quiet=quiet)
    with handled_errors(output, debug=debug):
        from dflash.core.errors import InputError
        from dflash.training.data import builtin_prompts, generate_dataset, read_dataset, read_prompts
        from dflash.training.target import load_target, resolve_device
        from dflash.training.trainer import TrainOptions, split_examples, train_draft

        if data is not None and (generate_data is not None or prompts is not None):
            raise InputError("--data cannot be combined with --generate-data or --prompts", hint="pick one data source")
        if data_only and data is not None:
            raise InputError("--data-only generates data; it cannot be combined with --data", hint="drop --data")
        if generate_data is not None and generate_data < 1:
            raise InputError("--generate-data needs a positive number of prompts", hint="e.g. --generate-data 1000")
        options = TrainOptions(
            kind=kind.value,
            block_size=block_size,
            num_layers=num_layers,
            markov_rank=markov_rank,
            target_layer_ids=_parse_layer_ids(target_layer_ids),
            mask_token_id=mask_token_id,
            num_anchors=num_anchors,
            batch_size=batch_size,
            steps=steps,
            epochs=epochs,
            lr=lr,
            max_length=max_length,
            time_limit_s=time_limit,
            seed=seed,
            log_every=log_every,
            save_dtype=save_dtype.value,
            max_shard_mb=max_shard_mb,
        ).resolved()

        torch_device = resolve_device(device.value if device else None)
        with output.status(f"Loading {target} on {torch_device}"):
            loaded = load_target(target, torch_device)
        summary: dict[str, Any] = {"target": str(target), "device": str(torch_device)}

        if data is None:
            data = save_data or output_dir / DATA_FILE
            prompt_list = read_prompts(prompts) if prompts else builtin_prompts()
            prompt_list = prompt_list[: generate_data or DEFAULT_PROMPTS]
            with _progress(output, "Generating answers", len(prompt_list), "prompts", lines=True) as advance:
                stats = generate_dataset(
                    loaded,
                    prompt_list,
                    data,
                    max_new_tokens=max_new_tokens,
                    batch_size=gen_batch_size or (256 if torch_device.type == "cuda" else 8),
                    time_limit_s=gen_time_limit,
                    on_progress=lambda done, total, tokens: advance(done, f"{tokens} tokens"),
                )
            output.success(
                f"{stats.sequences} answers, {stats.response_tokens} response tokens "
                f"({stats.tokens_per_second:.0f} tokens/s) written to {data}"
            )
            summary["generation"] = stats.to_json()
        summary["data"] = str(data)
        if data_only:
            if json_output:
                output.json(summary)
            return

        examples = read_dataset(data, max_length=options.max_length)
        train_set, eval_set = split_examples(examples, eval_sequences, seed=options.seed)
        output.info(f"training a {options.kind} draft on {len(train_set)} sequences ({len(eval_set)} held out)")
        with _progress(output, f"Training {options.kind}", options.steps, "steps") as advance:
            result = train_draft(
                loaded,
                train_set,
                output_dir,
                options,
                eval_examples=eval_set or None,
                on_step=lambda step, total, loss: advance(step, f"loss {loss:.3f}", total),
                on_log=lambda entry: _log_line(output, entry),
                extra_info={"data": str(data), **({"generation": summary["generation"]} if "generation" in summary else {})},
            )
        summary["training"] = result.to_json()
        if json_output:
            output.json(summary)
        else:
            after = result.eval_after
            detail = f"; held-out tau {after.tau:.2f}, first-position accuracy {after.accuracy[0]:.1%}" if after else ""
            output.success(f"{options.kind} draft written to {output_dir} after {result.steps} steps{detail}")
            output.info(f"next: dflash export {target} <out> --draft {output_dir}")


def _parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of layer indices", param_hint="--target-layer-ids") from None


def _log_line(output: Output, entry) -> None:
    """One line per log window: on a terminal the progress bar shows it too, elsewhere it is the progress."""
    m = entry.metrics
    accuracy = " ".join(f"{a:.2f}" for a in m.accuracy[:8])
    output.info(f"step {entry.step}: loss {m.loss:.4f}  tau {m.tau:.2f}  lr {entry.lr:.2e}  acc[{accuracy}{' ...' if len(m.accuracy) > 8 else ''}]")


@contextmanager
def _progress(output: Output, description: str, total: int | None, unit: str, *, lines: bool = False) -> Iterator[Any]:
    """A rich progress bar on a terminal; `advance(done, note, total=None)` updates it.

    Off a terminal (logs, CI, the device machine) each update is a plain line when `lines` is set,
    else nothing (training logs its own lines every few steps).
    """
    if output.quiet or not output.err.is_terminal:

        def plain(done: int, note: str = "", new_total: int | None = None) -> None:
            if lines:
                output.info(f"{description}: {done}/{new_total or total} {unit} {note}")

        yield plain
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TextColumn("{task.fields[note]}"), TimeElapsedColumn())
    with Progress(*columns, console=output.err, transient=False) as progress:
        task = progress.add_task(description, total=total, note="")

        def advance(done: int, note: str = "", new_total: int | None = None) -> None:
            progress.update(task, completed=done, note=note, **({"total": new_total} if new_total else {}))

        yield advance


if __name__ == "__main__":  # `python -m dflash.cli.train` where the console script is not installed
    typer.run(train)
