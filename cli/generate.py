"""`dflash generate`: batched generation on the continuous-batching engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ._errors import handled_errors
from ._options import (
    AssistantSchedule,
    DebugOpt,
    DraftKind,
    JsonOpt,
    OvConfigOpt,
    QuietOpt,
    SeedOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    parse_ov_config,
    sampling_params,
)
from ._output import Output

EXAMPLES = """\
Examples:

  dflash generate "Write a function that reverses a list."      # the embedded default pair

  dflash generate out/target "Write a haiku about CPUs."

  dflash generate out/target --prompts-file prompts.jsonl --max-new-tokens 256 --json > results.jsonl

  dflash generate out/target "def fib(n):" --no-chat --ov-config INFERENCE_PRECISION_HINT=f32

  dflash generate out/target --draft out/draft --prompts-file prompts.txt --num-assistant-tokens 8

  dflash generate --prompts-file prompts.txt --num-assistant-tokens-schedule constant   # always the whole block
"""


def generate(
    target_dir: Annotated[
        Optional[str],
        typer.Argument(help="An exported target folder (default: the embedded SmolLM2-135M-Instruct pair).", show_default=False),
    ] = None,
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts to generate from.", show_default=False)] = None,
    default_draft: Annotated[
        DraftKind,
        typer.Option("--default-draft", help="Without TARGET_DIR: which trained default draft runs beside SmolLM2."),
    ] = DraftKind.dflash,
    draft: Annotated[
        Optional[Path],
        typer.Option("--draft", help="An exported DFlash/DSpark draft: speculative decoding, greedy output unchanged.", show_default=False),
    ] = None,
    num_assistant_tokens: Annotated[
        Optional[int],
        typer.Option("--num-assistant-tokens", min=0, help="Candidates per draft step (default: all the draft's block yields; 0: no drafting).", show_default=False),
    ] = None,
    num_assistant_tokens_schedule: Annotated[
        AssistantSchedule,
        typer.Option("--num-assistant-tokens-schedule", help="adaptive: per request, the candidates whose measured acceptance pays for the measured cost of drafting (none if nothing pays); constant: always --num-assistant-tokens; heuristic: +2 candidates after a step that accepted them all, -1 otherwise."),
    ] = AssistantSchedule.adaptive,
    markov_top_k: Annotated[
        Optional[int],
        typer.Option("--markov-top-k", min=0, help="DSpark drafts: candidates per row the Markov head scores (default: the export's K; 0: the dense Markov walk).", show_default=False),
    ] = None,
    draft_kv_cache_size: Annotated[
        Optional[float],
        typer.Option("--draft-kv-cache-size", min=0.001, help="The draft's KV cache in GiB [default: as the target's].", show_default=False),
    ] = None,
    prompts_file: Annotated[
        Optional[Path],
        typer.Option("--prompts-file", help=".txt (one prompt per line) or .jsonl (prompt / messages / turns).", show_default=False),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate per prompt at most.")] = 128,
    chat: Annotated[
        Optional[bool],
        typer.Option("--chat/--no-chat", help="Apply the tokenizer's chat template (default: when it has one).", show_default=False),
    ] = None,
    kv_cache_size: Annotated[Optional[float], typer.Option("--kv-cache-size", min=0.001, help="KV cache size in GiB [default: 0.25].", show_default=False)] = None,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", min=1, help="Token budget of one engine step.")] = 256,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Requests running at once at most.")] = 64,
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching", help="Reuse the KV of shared prompt prefixes.")] = True,
    dynamic_split_fuse: Annotated[bool, typer.Option("--dynamic-split-fuse/--no-dynamic-split-fuse", help="Mix prompt chunks and generation in one step.")] = True,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the end-of-sequence token.")] = False,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    device: Annotated[str, typer.Option("--device", help="OpenVINO device.")] = "CPU",
    ov_config: OvConfigOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text for one or many prompts with continuous batching.

    One prompt streams to the terminal; many show a progress bar, then each result. With --json, one JSON line per request as it finishes (flushed at once): id, prompt, text, token ids, number of generated tokens, finish reason, TTFT and TPOT. SIGINT/SIGTERM stop the run: the running requests get a line with finish reason "abort", a last line says {"status": "interrupted", ...}, exit 130/143.
    """
    output = Output(json_mode=json_output, quiet=quiet)
    run = _Run(output)
    with handled_errors(output, debug=debug):
        from dflash.core.engine import EngineConfig, LLMEngine
        from dflash.core.errors import InputError
        from dflash.core.prompts import read_prompts_file

        properties = parse_ov_config(ov_config)  # usage errors first, before any folder is read
        target_dir, draft, prompts = _resolve_models(target_dir, draft, prompts, default_draft, output)
        all_prompts = list(prompts or []) + (read_prompts_file(prompts_file) if prompts_file else [])
        if not all_prompts:
            raise InputError("no prompts given", "pass PROMPT arguments or --prompts-file FILE")
        _check_prompt_lengths(all_prompts, target_dir)
        params = sampling_params(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos, num_assistant_tokens=num_assistant_tokens,
            num_assistant_tokens_schedule=num_assistant_tokens_schedule.value,
        )  # fmt: skip
        config = EngineConfig(
            device=device,
            ov_config=properties,
            kv_cache_size_gib=kv_cache_size,
            enable_prefix_caching=prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            dynamic_split_fuse=dynamic_split_fuse,
            draft_kv_cache_size_gib=draft_kv_cache_size or kv_cache_size,
            markov_head_top_k=markov_top_k,
        )
        with output.status(f"Loading {target_dir}" + (f" with draft {draft}" if draft else "")):
            engine = LLMEngine(target_dir, config, draft_dir=draft)
        use_chat = chat if chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))
        run.streamed = len(all_prompts) == 1 and not json_output
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
    if run.num_failed:
        raise typer.Exit(1)


class _Run:
    """Where results go: with --json one JSONL line per request as it finishes (flushed, written whole
    under deferred signals); otherwise collected and printed at the end, in prompt order."""

    def __init__(self, output: Output):
        self.output = output
        self.streamed = False
        self.num_requests = 0
        self.num_finished = 0
        self.num_failed = 0
        self.order: dict[str, int] = {}
        self._held: list = []

    def add(self, result) -> None:
        from dflash.exporters import interrupts

        self.num_finished += result.finish_reason != "abort"
        self.num_failed += bool(result.error)
        if not self.output.json_mode:
            self._held.append(result)
            return
        with interrupts.deferred():
            sys.stdout.write(_json_line(result.to_json()))
            sys.stdout.flush()
            if result.error:  # stdout is for data: the failure is said on stderr too
                self.output.error(escape(f"{result.req_id}: {result.error}"))

    def close(self, engine, *, interrupted: bool) -> None:
        """Print what was held, the warnings and the acceptance summary; with --json after an
        interrupt, a last line {"status": "interrupted", "signal": ...}."""
        import signal

        from dflash.exporters import interrupts

        with interrupts.deferred():
            self._held.sort(key=lambda result: self.order.get(result.req_id, len(self.order)))
            _print_results(self._held, self.output, streamed=self.streamed)
            for warning in engine.warnings:
                self.output.warning(warning)
            if engine.has_draft:
                _print_acceptance(engine, self.output)
            if interrupted and self.output.json_mode:
                signum = interrupts.interrupted_by() or signal.SIGINT
                sys.stdout.write(_json_line({
                    "status": "interrupted", "signal": signal.Signals(signum).name,
                    "num_requests": self.num_requests, "num_finished": self.num_finished,
                }))  # fmt: skip
            sys.stdout.flush()


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


def _resolve_models(target_dir, draft, prompts, default_draft, output: Output):
    """TARGET_DIR is optional: a first argument that is not a folder is a prompt, and the models are
    the embedded default pair (exported into the cache on first use). A first argument that looks like
    a path (a separator, `~`, an existing file) but is no folder is an error, never a prompt. The
    folders get the checks of cli/_preflight.py before anything loads."""
    from dflash.core.errors import InputError

    from ._preflight import check_draft_dir, check_target_dir, looks_like_path

    prompts = list(prompts or [])
    if target_dir is not None and not Path(target_dir).is_dir():
        if looks_like_path(target_dir):
            what = "is a file, not a folder" if Path(target_dir).exists() else "does not exist"
            raise InputError(
                f"TARGET_DIR {target_dir} {what}",
                "pass an exported target folder (dflash export); to use this text as a prompt for the "
                "embedded default pair, put it in --prompts-file",
            )
        prompts.insert(0, target_dir)
        target_dir = None
    if target_dir is not None:
        target_dir = Path(target_dir)
        check_target_dir(target_dir)
        if draft is not None:
            check_draft_dir(draft, target_dir)
        return target_dir, draft, prompts
    from dflash.exporters.default_pair import ensure_default_pair

    with output.status("Preparing the default pair (SmolLM2-135M-Instruct)") as on_step:
        pair = ensure_default_pair(default_draft.value, on_step=on_step)
    if draft is not None:
        check_draft_dir(draft, pair.target_dir)
    return pair.target_dir, draft or pair.draft_dir, prompts


def _stream_one(engine, prompt, params, chat: bool, run: _Run) -> None:
    from dflash.exporters import interrupts

    req_id = engine.add_request(prompt, params, chat=chat)
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
    run.order = {req_id: i for i, req_id in enumerate(req_ids)}
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


def _print_results(results: list, output: Output, *, streamed: bool) -> None:
    for result in results:
        if output.json_mode:
            sys.stdout.write(_json_line(result.to_json()))
            continue
        if result.error:
            output.error(escape(f"{result.req_id}: {result.error}"))
            continue
        if not streamed:
            output.data(f"[bold]── {escape(result.req_id)}[/bold] [dim]{escape(_one_line(result.prompt))}[/dim]")
            output.out.print(result.text, markup=False, highlight=False)
        output.info(
            f"[dim]{result.req_id}: {result.num_generated_tokens} tokens, {result.finish_reason}"
            + (f", TTFT {result.ttft_s * 1000:.0f} ms" if result.ttft_s is not None else "")
            + (f", TPOT {result.tpot_s * 1000:.1f} ms" if result.tpot_s is not None else "")
            + "[/dim]"
        )


def _print_acceptance(engine, output: Output) -> None:
    """The acceptance summary: after the results, or as a last JSON line with --json."""
    stats = engine.spec_stats
    if output.json_mode:
        sys.stdout.write(_json_line({"spec_decoding": stats.to_json(), "times": engine.times.to_json()}))
        return
    if not stats.num_drafts:
        output.info("no draft step ran (no greedy request drafted)")
        return
    by_position = " ".join(f"{rate:.2f}" for rate in stats.acceptance_by_position)
    output.data(
        f"draft: {stats.num_drafts} steps, {stats.num_accepted_tokens}/{stats.num_draft_tokens} candidates accepted "
        f"({stats.acceptance_rate:.1%}), mean accepted length {stats.mean_accepted_length:.2f}\n"
        f"acceptance by position: {by_position}"
    )


def _json_line(data: dict) -> str:
    import json

    return json.dumps(data, ensure_ascii=False) + "\n"


def _one_line(prompt: str | None, width: int = 60) -> str:
    text = " ".join((prompt or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"
