"""`dflash generate`: batched generation on the continuous-batching engine."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ._errors import handled_errors
from ._options import (
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_PAIR_HELP,
    SCHEDULE_HELP,
    AssistantSchedule,
    ChatOpt,
    DebugOpt,
    DefaultDraftOpt,
    DeviceOpt,
    DraftKind,
    DraftKvCacheSizeOpt,
    DraftOpt,
    DraftProposals,
    DraftProposalsOpt,
    DynamicSplitFuseOpt,
    JsonOpt,
    KvCacheSizeOpt,
    MarkovTopKHelp,
    MaxNumBatchedTokensOpt,
    OvConfigOpt,
    PrefixCachingOpt,
    QuietOpt,
    ScheduleMemoryOpt,
    SeedOpt,
    StateBlocksOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    engine_config,
    sampling_params,
)
from ._output import Output

EXAMPLES = """\
\b
Examples:
  dflash generate "Write a function that reverses a list."  # the default pair
  dflash generate "Write a haiku about CPUs." -q > haiku.txt
  dflash generate out/target --draft out/draft "Write a haiku about CPUs."
  dflash generate out/target --prompts-file prompts.jsonl --json > out.jsonl
  dflash generate out/target "def fib(n):" --no-chat \\
      --ov-config INFERENCE_PRECISION_HINT=f32
  dflash generate --prompts-file prompts.txt --num-assistant-tokens 8 \\
      --num-assistant-tokens-schedule constant       # always 8 candidates
  dflash generate "Tell me a story." --temperature 0.7 --top-p 0.9 --seed 1
"""


ScheduleOpt = Annotated[AssistantSchedule, typer.Option("--num-assistant-tokens-schedule", help=SCHEDULE_HELP)]


def generate(
    target_dir: Annotated[
        Optional[str],
        typer.Argument(help="An exported target folder. " + DEFAULT_PAIR_HELP, show_default=False),
    ] = None,
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts to generate from.", show_default=False)] = None,
    prompts_file: Annotated[
        Optional[Path],
        typer.Option("--prompts-file", help=".txt (one prompt per line) or .jsonl (prompt / messages / turns).", show_default=False),
    ] = None,
    draft: DraftOpt = None,
    default_draft: DefaultDraftOpt = DraftKind.dspark,
    num_assistant_tokens: Annotated[
        Optional[int],
        typer.Option("--num-assistant-tokens", min=0, help="Candidates per draft step at most (0: the target alone, no draft loaded).",
                     show_default="all the draft's block yields"),
    ] = None,
    num_assistant_tokens_schedule: ScheduleOpt = AssistantSchedule.adaptive,
    markov_top_k: Annotated[Optional[int], typer.Option("--markov-top-k", min=0, help=MarkovTopKHelp, show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate per prompt at most.")] = 128,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the end-of-sequence token.")] = False,
    chat: ChatOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    draft_proposals: DraftProposalsOpt = DraftProposals.argmax,
    device: DeviceOpt = "CPU",
    ov_config: OvConfigOpt = None,
    kv_cache_size: KvCacheSizeOpt = DEFAULT_KV_CACHE_GIB,
    draft_kv_cache_size: DraftKvCacheSizeOpt = None,
    state_blocks: StateBlocksOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = 256,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Requests running at once at most.")] = 64,
    prefix_caching: PrefixCachingOpt = None,
    dynamic_split_fuse: DynamicSplitFuseOpt = True,
    schedule_memory: ScheduleMemoryOpt = True,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text for one or many prompts with continuous batching.

    Data goes to stdout: one prompt's text streams there; several prompts' texts follow each other under
    a header line. Timings, warnings and the draft's acceptance go to stderr (not with -q).

    With --json: one JSON line per request as it finishes, all of one shape: id, prompt (as given),
    text, token_ids, num_generated_tokens, finish_reason, stop_reason, error, ttft_s, tpot_s and, with
    a draft, spec_decoding. On SIGINT/SIGTERM the running requests get their line (finish_reason
    "abort") and the exit code is 130/143.
    """
    options = SimpleNamespace(**locals())  # the parsed options, as one value for the helpers below
    output = Output(json_mode=json_output, quiet=quiet)
    run = _Run(output)
    with handled_errors(output, debug=debug):
        engine, all_prompts, params, use_chat = _load(options, output)
        _execute(engine, all_prompts, params, use_chat, run, streamed=len(all_prompts) == 1 and not json_output)
    if run.num_failed:
        raise typer.Exit(1)


def _load(o: SimpleNamespace, output: Output) -> tuple:
    """Check everything a user can get wrong, then load the engine: (engine, prompts, params, chat)."""
    from dflash.core.engine import LLMEngine
    from dflash.core.errors import InputError
    from dflash.core.prompts import read_prompts_file

    # Everything a user can get wrong is checked before the first-use export or any loading.
    config = engine_config(
        device=o.device, ov_config=o.ov_config, kv_cache_size=o.kv_cache_size, draft_kv_cache_size=o.draft_kv_cache_size,
        max_num_batched_tokens=o.max_num_batched_tokens, max_num_seqs=o.max_num_seqs, prefix_caching=o.prefix_caching,
        dynamic_split_fuse=o.dynamic_split_fuse, markov_top_k=o.markov_top_k, draft_proposals=o.draft_proposals.value, state_blocks=o.state_blocks,
        schedule_memory=o.schedule_memory,
    )  # fmt: skip
    params = sampling_params(
        temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=o.seed, max_new_tokens=o.max_new_tokens,
        ignore_eos=o.ignore_eos, num_assistant_tokens=o.num_assistant_tokens,
        num_assistant_tokens_schedule=o.num_assistant_tokens_schedule.value,
    )  # fmt: skip
    target_dir, prompts = _split_target_and_prompts(o.target_dir, o.prompts)
    all_prompts = prompts + (read_prompts_file(o.prompts_file) if o.prompts_file else [])
    if not all_prompts:
        raise InputError("no prompts given", "pass PROMPT arguments or --prompts-file FILE")
    with_draft = o.num_assistant_tokens != 0
    if not with_draft and o.draft is not None:
        output.info("[dim]--num-assistant-tokens 0: the target alone; the draft is not loaded[/dim]")
    target_dir, draft = _resolve_models(target_dir, o.draft if with_draft else None, o.default_draft.value, with_draft, output)
    _check_prompt_lengths(all_prompts, target_dir)
    with output.status(f"Loading {target_dir}" + (f" with draft {draft}" if draft else "")):
        engine = LLMEngine(target_dir, config, draft_dir=draft)
    use_chat = o.chat if o.chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))
    return engine, all_prompts, params, use_chat


def _execute(engine, all_prompts: list, params, use_chat: bool, run: _Run, *, streamed: bool) -> None:
    """Run the prompts: one streams its text, several run together; `run` gets every result."""
    run.streamed = streamed
    run.num_requests = len(all_prompts)
    # SIGINT, SIGTERM or a failure mid-run: what finished is already written (--json) or is printed
    # by close(), so nothing is lost; a signal during close() is recorded, not raised.
    try:
        if run.streamed:
            _stream_one(engine, all_prompts[0], params, use_chat, run)
        else:
            _run_many(engine, all_prompts, params, use_chat, run)
    except KeyboardInterrupt:
        run.close(engine, interrupted=True)
        raise
    except BaseException:
        run.close(engine, interrupted=False)
        raise
    run.close(engine, interrupted=False)


class _Run:
    """Where results go: with --json one JSONL line per request as it finishes (flushed, written whole
    under deferred signals); otherwise collected and printed at the end, in prompt order."""

    def __init__(self, output: Output):
        self.output = output
        self.streamed = False
        self.num_requests = 0
        self.num_finished = 0
        self.num_failed = 0
        self.prompts: dict[str, object] = {}  # request id -> the prompt as the user gave it, in order
        self._held: list = []

    def add(self, result) -> None:
        from dflash.exporters import interrupts

        self.num_finished += result.finish_reason != "abort"
        self.num_failed += bool(result.error)
        if not self.output.json_mode:
            self._held.append(result)
            return
        with interrupts.deferred():
            sys.stdout.write(_json_line(self._record(result)))
            sys.stdout.flush()
            if result.error:  # stdout is for data: the failure is said on stderr too
                self.output.error(escape(f"{result.req_id}: {result.error}"))

    def _record(self, result) -> dict:
        """A result's JSON line: the same keys for every request (spec_decoding null without a draft
        step), the prompt as the user gave it (not the chat-templated text)."""
        record = result.to_json()
        return {**record, "prompt": self.prompts.get(result.req_id, result.prompt), "spec_decoding": record.get("spec_decoding")}

    def close(self, engine, *, interrupted: bool) -> None:
        """Print what was held (stdout), then the warnings and the acceptance summary (stderr)."""
        from dflash.exporters import interrupts

        with interrupts.deferred():
            order = list(self.prompts)
            self._held.sort(key=lambda result: order.index(result.req_id) if result.req_id in order else len(order))
            for result in self._held:
                self._print(result)
            sys.stdout.flush()
            for warning in engine.warnings:
                self.output.warning(warning)
            if engine.has_draft:
                _print_acceptance(engine, self.output)
            if interrupted and self.num_requests > 1:  # said even with -q/--json: the run did not complete
                aborted = ' (the others\' lines have finish_reason "abort")' if self.output.json_mode else ""
                self.output.err.print(f"{self.num_finished} of {self.num_requests} requests finished before the interrupt{aborted}",
                                      markup=False)

    def _print(self, result) -> None:
        """One result: its text on stdout (under a header line when there are several), figures on stderr."""
        if result.error:
            self.output.error(escape(f"{result.req_id}: {result.error}"))
            return
        if not self.streamed:
            prompt = _one_line(_prompt_text(self.prompts.get(result.req_id, result.prompt)))
            self.output.data(f"[bold]── {escape(result.req_id)}[/bold] [dim]{escape(prompt)}[/dim]")
            self.output.out.print(result.text, markup=False, highlight=False)
        self.output.info(
            f"[dim]{result.req_id}: {result.num_generated_tokens} tokens, {result.finish_reason}"
            + (f", TTFT {result.ttft_s * 1000:.0f} ms" if result.ttft_s is not None else "")
            + (f", TPOT {result.tpot_s * 1000:.1f} ms" if result.tpot_s is not None else "")
            + "[/dim]"
        )


# A prompt longer than this many characters per position of the model cannot fit (a token is at least
# one character); refusing it before tokenization spares minutes and the memory of a huge file.
MAX_CHARS_PER_POSITION = 64


def _check_prompt_lengths(prompts: list, target_dir: Path) -> None:
    import json

    from dflash.core.errors import InputError

    try:
        config = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    positions = (config.get("text_config") or config).get("max_position_embeddings")
    if not isinstance(positions, int) or positions <= 0:
        positions = 131072
    limit = positions * MAX_CHARS_PER_POSITION
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            size = len(prompt)
        else:
            size = sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict))
        if size > limit:
            raise InputError(
                f"prompt {index + 1} has {size} characters, more than the model's {positions} positions "
                f"can hold (at most {limit} characters are read)",
                "shorten the prompt or split it",
            )


def _split_target_and_prompts(target_dir: str | None, prompts: list[str] | None) -> tuple[Path | None, list]:
    """TARGET_DIR is optional: a first argument that is not a folder is a prompt (the models are then the
    embedded default pair). One that looks like a path (a separator, `~`, an existing file) but is no
    folder is an error, never a prompt."""
    from dflash.core.errors import InputError

    from ._preflight import is_folder, looks_like_path, path_exists

    prompts = list(prompts or [])
    if target_dir is None or is_folder(target_dir):
        return (Path(target_dir) if target_dir is not None else None), prompts
    if looks_like_path(target_dir):
        what = "is a file, not a folder" if path_exists(Path(target_dir)) else "does not exist"
        raise InputError(
            f"TARGET_DIR {target_dir} {what}",
            "pass an exported target folder (dflash export); to use this text as a prompt for the "
            "embedded default pair, put it in --prompts-file",
        )
    return None, [target_dir, *prompts]


def _resolve_models(target_dir: Path | None, draft: Path | None, default_draft: str, with_draft: bool, output: Output):
    """The folders to load: as given, or the embedded default pair (exported into the cache on first use;
    its draft only `with_draft`). Given folders get the checks of cli/_preflight.py before anything loads."""
    from ._preflight import check_draft_dir, check_target_dir

    if target_dir is not None:
        check_target_dir(target_dir)
        if draft is not None:
            check_draft_dir(draft, target_dir)
        return target_dir, draft
    from dflash.exporters.default_pair import ensure_default_pair

    with output.status("Preparing the default pair (SmolLM2-135M-Instruct)") as on_step:
        pair = ensure_default_pair(default_draft if with_draft and draft is None else None, on_step=on_step)
    if draft is not None:
        check_draft_dir(draft, pair.target_dir)
    return pair.target_dir, draft or pair.draft_dir


def _stream_one(engine, prompt, params, chat: bool, run: _Run) -> None:
    from dflash.exporters import interrupts

    req_id = engine.add_request(prompt, params, chat=chat)
    run.prompts[req_id] = prompt
    try:
        while engine.has_unfinished_requests():
            with interrupts.deferred():  # a signal waits for the end of the step
                for step_output in engine.step():
                    if step_output.new_text:
                        sys.stdout.write(step_output.new_text)
                        sys.stdout.flush()
    finally:
        sys.stdout.write("\n")
        if engine.abort_request(req_id):  # interrupted: the text so far was streamed already
            engine.result(req_id)
    run.add(engine.result(req_id))


def _run_many(engine, prompts, params, chat: bool, run: _Run) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dflash.exporters import interrupts

    output = run.output
    req_ids = [engine.add_request(p, params, chat=chat) for p in prompts]
    run.prompts = dict(zip(req_ids, prompts))
    progress = Progress(
        TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=output.err, disable=output.quiet or not output.err.is_terminal,
    )  # fmt: skip
    with progress:
        task = progress.add_task("generate", total=len(req_ids))
        try:
            while engine.has_unfinished_requests():
                # A signal waits for the end of the step: the engine stays consistent and no finished
                # result is dropped between the step and its line.
                with interrupts.deferred():
                    for step_output in engine.step():
                        if step_output.finished:
                            run.add(engine.result(step_output.req_id))
                            progress.advance(task)
        except BaseException:
            # Interrupted or failed: the requests still running are aborted; with --json their partial
            # text is written too (finish_reason "abort"), so every request has its line.
            with interrupts.deferred():
                for req_id in req_ids:
                    if engine.abort_request(req_id) and output.json_mode:
                        run.add(engine.result(req_id))
            raise


def _print_acceptance(engine, output: Output) -> None:
    """The draft's acceptance over the run, on stderr (every --json line carries its request's own)."""
    stats = engine.spec_stats
    if not stats.num_drafts:
        output.info("[dim]draft: no draft step ran (every request was sampled or drafted nothing)[/dim]")
        return
    by_position = " ".join(f"{rate:.2f}" for rate in stats.acceptance_by_position)
    output.info(
        f"draft: {stats.num_drafts} steps, {stats.num_accepted_tokens}/{stats.num_draft_tokens} candidates accepted "
        f"({stats.acceptance_rate:.1%}), mean accepted length {stats.mean_accepted_length:.2f}\n"
        f"acceptance by position: {by_position}"
    )


def _json_line(data: dict) -> str:
    import json

    return json.dumps(data, ensure_ascii=False) + "\n"


def _prompt_text(prompt) -> str:
    """A prompt as the user gave it: a string, or a conversation (the last message's content)."""
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    messages = [m for m in prompt if isinstance(m, dict)]
    return str(messages[-1].get("content", "")) if messages else ""


def _one_line(prompt: str | None, width: int = 60) -> str:
    text = " ".join((prompt or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"
