"""`dflash bench`: the target alone vs speculative settings, on the same prompts, in one run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ._errors import EXIT_INTERRUPTED, handled_errors
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
    DynamicSplitFuseOpt,
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
from ._preflight import check_writable

EXAMPLES = """\
\b
Examples:
  dflash bench                            # the default pair on HumanEval
  dflash bench --default-draft dflash --num-prompts 10 --concurrency 1
  dflash bench out/target --draft out/draft --concurrency 1,4,8 \\
      --num-assistant-tokens 4,8,15 --json-file bench.json
  dflash bench --concurrency 1,8 --num-assistant-tokens 3,auto \\
      --num-assistant-tokens-schedule constant,adaptive
  dflash bench --concurrency 1,8 --rounds 3   # median ratio of 3 rounds
  dflash bench --json > bench.json           # the report alone, on stdout
  dflash bench out/target --draft out/draft --dataset prompts.jsonl \\
      --plot bench.png --min-accepted-length 2
  dflash bench out/target --draft out/draft \\
      --ov-config INFERENCE_PRECISION_HINT=f32 \\
      --ov-config KV_CACHE_PRECISION=f32    # exact: outputs must match
"""


# Declared here to keep bench()'s signature short: --draft-proposals is a sweep in bench (a str), an enum in generate.
DraftProposalsSweepOpt = Annotated[
    str,
    typer.Option("--draft-proposals", help="Under sampling (--temperature > 0), comma-separated: argmax (the draft's "
                 "deterministic candidates) and/or sampled (drawn from its distributions); both verified by speculative sampling."),
]


def bench(
    target_dir: Annotated[
        Optional[Path], typer.Argument(help="An exported target folder (needs --draft). " + DEFAULT_PAIR_HELP, show_default=False)
    ] = None,
    draft: DraftOpt = None,
    default_draft: DefaultDraftOpt = DraftKind.dspark,
    dataset: Annotated[str, typer.Option("--dataset", help="humaneval (164 prompts) or a prompts file (.txt / .jsonl).")] = "humaneval",
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=0, help="The first N prompts (0: all).")] = 16,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Requests in flight, comma-separated: e.g. 1,4,8.")] = "1,4",
    num_assistant_tokens: Annotated[
        str, typer.Option("--num-assistant-tokens", help="Candidates per draft step at most, comma-separated; auto: all the draft's block yields.")
    ] = "auto",
    num_assistant_tokens_schedule: Annotated[
        str, typer.Option("--num-assistant-tokens-schedule", help="Comma-separated. " + SCHEDULE_HELP)
    ] = "adaptive",
    markov_top_k: Annotated[str, typer.Option("--markov-top-k", help=MarkovTopKHelp[:-1] + "; comma-separated, auto: the export's.")] = "auto",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Runs of every setting, wave by wave in turn with its baseline; the speedup is the median of the per-round ratios, with their range.")] = 1,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Warm-up requests per engine, excluded from the figures.")] = 2,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the target-alone runs (no speedup, no lossless check).")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens each request generates (EOS ignored).")] = 128,
    chat: ChatOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    draft_proposals: DraftProposalsSweepOpt = "argmax",
    device: DeviceOpt = "CPU",
    ov_config: OvConfigOpt = None,
    kv_cache_size: KvCacheSizeOpt = DEFAULT_KV_CACHE_GIB,
    draft_kv_cache_size: DraftKvCacheSizeOpt = None,
    state_blocks: StateBlocksOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = 256,
    prefix_caching: PrefixCachingOpt = None,
    dynamic_split_fuse: DynamicSplitFuseOpt = True,
    schedule_memory: ScheduleMemoryOpt = True,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on any output that differs from the baseline, even with bf16 inference.")] = False,
    min_accepted_length: Annotated[
        Optional[float], typer.Option("--min-accepted-length", min=0.0, help="Exit 1 if a setting's mean accepted length is below X.", show_default=False)
    ] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write acceptance by position, throughput and speedup vs concurrency to FILE.png.", show_default=False)] = None,
    json_file: Annotated[
        Optional[Path],
        typer.Option("--json-file", help="Write every figure and the environment to FILE (schema: docs/bench-json.md), rewritten after every run.", show_default=False),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report (as --json-file writes it) on stdout and nothing else.")] = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Benchmark speculative decoding against the target alone: throughput, latency, acceptance.

    Runs the autoregressive baseline and every setting of the sweep (concurrency x num-assistant-tokens x schedule x markov-top-k) on the same prompts, the baseline and every setting taking turns wave by wave (waves of --concurrency prompts, each run from a cold prefix cache; --rounds N repeats that and takes the median ratio), EOS ignored, and, when greedy, compares every speculative output token for token with the baseline's. Exit codes: 0 ok; 1 an output differs with f32 inference (or with --strict), a request failed, or the mean accepted length is below --min-accepted-length; 2 usage; 130 interrupted (SIGINT), 143 terminated (SIGTERM): the settings of every finished concurrency (and round) are still written to --json-file, with status "interrupted".
    """
    options = SimpleNamespace(**locals())  # the parsed options, as one value for the helpers below
    output = Output(json_mode=json_output, quiet=quiet)
    report = None
    sweep = _parse_sweep(options)  # malformed values are usage errors (exit 2), before anything loads
    with handled_errors(output, debug=debug):
        report = _run_sweep(options, sweep, output)
        _write_report(report, options, output)
    _exit(report, options, output)


def _parse_sweep(o: SimpleNamespace) -> SimpleNamespace:
    """The comma-separated sweep options as lists; malformed values are usage errors that click
    reports (exit 2)."""
    concurrencies = _int_list(o.concurrency, "--concurrency", minimum=1)
    assistant_tokens = _int_list(o.num_assistant_tokens, "--num-assistant-tokens", minimum=0, auto=True)
    if 0 in assistant_tokens:
        raise typer.BadParameter("0 (no drafting) is the baseline, which bench runs at every concurrency", param_hint="--num-assistant-tokens")
    top_ks = _int_list(o.markov_top_k, "--markov-top-k", minimum=0, auto=True)
    schedules = _choice_list(o.num_assistant_tokens_schedule, "--num-assistant-tokens-schedule", tuple(s.value for s in AssistantSchedule))
    proposals = _choice_list(o.draft_proposals, "--draft-proposals", tuple(p.value for p in DraftProposals))
    return SimpleNamespace(concurrencies=concurrencies, assistant_tokens=assistant_tokens, top_ks=top_ks, schedules=schedules,
                           proposals=proposals)  # fmt: skip


def _run_sweep(o: SimpleNamespace, sweep: SimpleNamespace, output: Output):
    """Check the inputs and output files, resolve the pair and run the sweep; return its report."""
    from dflash.bench.datasets import load_dataset
    from dflash.bench.sweep import BenchOptions, run_bench
    from dflash.core.errors import InputError

    config = engine_config(
        device=o.device, ov_config=o.ov_config, kv_cache_size=o.kv_cache_size, draft_kv_cache_size=o.draft_kv_cache_size,
        max_num_batched_tokens=o.max_num_batched_tokens, max_num_seqs=max(sweep.concurrencies),
        prefix_caching=o.prefix_caching, dynamic_split_fuse=o.dynamic_split_fuse, state_blocks=o.state_blocks,
        schedule_memory=o.schedule_memory,
    )  # fmt: skip
    sampling = sampling_params(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=o.seed)
    target_dir = o.target_dir
    if target_dir is not None and o.json_output and target_dir.suffix == ".json" and not target_dir.is_dir():
        raise InputError(f"--json takes no file name (it prints the report on stdout); {target_dir} was read as TARGET_DIR",
                         f"write the report to a file with --json-file {target_dir}")  # fmt: skip
    if o.plot is not None:
        _require_matplotlib()
        check_writable(o.plot, "--plot")
    if o.json_file is not None:  # checked now, not after an hour of benchmarking
        check_writable(o.json_file, "--json-file")
    prompts = load_dataset(o.dataset, o.num_prompts)
    if target_dir is not None and o.draft is None:
        raise InputError("a target needs a draft to benchmark", "pass --draft DRAFT_DIR, or no TARGET_DIR for the embedded pair")
    target_dir, draft = _resolve_pair(target_dir, o.draft, o.default_draft.value, output)
    options = BenchOptions(
        target_dir=target_dir, draft_dir=draft, prompts=prompts, engine_config=config,
        max_new_tokens=o.max_new_tokens, concurrencies=sweep.concurrencies, num_assistant_tokens=sweep.assistant_tokens,
        schedules=sweep.schedules, markov_top_ks=sweep.top_ks, chat=o.chat, warmup=o.warmup, rounds=o.rounds,
        baseline=not o.no_baseline, dataset=o.dataset, sampling=sampling, draft_proposals=tuple(sweep.proposals),
    )  # fmt: skip
    with _LiveProgress(output, o.json_file) as progress:
        return run_bench(options, progress)


def _write_report(report, o: SimpleNamespace, output: Output) -> None:
    """The tables (stdout, or stderr with --json), the JSON report and the plot."""
    from dflash.exporters import interrupts

    with interrupts.deferred():  # a signal now waits until the figures are written
        _print_tables(report, output)
        if o.json_output:
            output.json(report.to_json())
        if o.json_file is not None:
            _write_json(report, o.json_file)
            output.info(f"[dim]wrote {escape(str(o.json_file))}[/dim]")
        if o.plot is not None and report.settings:
            plot_report(report, o.plot)
            output.info(f"[dim]wrote {escape(str(o.plot))}[/dim]")


def _exit(report, o: SimpleNamespace, output: Output) -> None:
    """Exit with the run's verdict: interrupted, or what the outputs and acceptance say."""
    if report.status == "interrupted":
        from dflash.exporters.interrupts import exit_code, interrupted_by

        what = "terminated (SIGTERM)" if interrupted_by() == 15 else "interrupted"
        output.error(what + (f"; the finished settings are in {o.json_file}" if o.json_file else ""))
        raise typer.Exit(exit_code(EXIT_INTERRUPTED))
    raise typer.Exit(_verdict(report, output, strict=o.strict, min_accepted_length=o.min_accepted_length))


# ---- options ----------------------------------------------------------------------------------------------


def _int_list(text: str, option: str, *, minimum: int, auto: bool = False) -> list:
    """"1,4,8" -> [1, 4, 8]; "auto" -> [None] where allowed. Bad values are usage errors (exit 2)."""
    values: list = []
    for item in (part.strip() for part in text.split(",")):
        if auto and item.lower() == "auto":
            values.append(None)
            continue
        try:
            value = int(item)
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not an integer" + (" or auto" if auto else ""), param_hint=option) from None
        if value < minimum:
            raise typer.BadParameter(f"{value} is below {minimum}", param_hint=option)
        values.append(value)
    return list(dict.fromkeys(values))


def _choice_list(text: str, option: str, choices: tuple[str, ...]) -> list[str]:
    """"constant,heuristic" -> ["constant", "heuristic"]; anything else is a usage error (exit 2)."""
    values = [part.strip().lower() for part in text.split(",")]
    for value in values:
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=option)
    return list(dict.fromkeys(values))


def _resolve_pair(target_dir: Path | None, draft: Path | None, default_draft: str, output: Output):
    """The folders to benchmark: as given, or the embedded default pair (exported on first use); given
    folders get the checks of cli/_preflight.py (the draft: those of `dflash validate`) before loading."""
    from ._preflight import check_draft_dir, check_target_dir

    if target_dir is not None:
        check_target_dir(target_dir)
        check_draft_dir(draft, target_dir)
        return target_dir, draft
    from dflash.exporters.default_pair import ensure_default_pair

    with output.status(f"Preparing the embedded default pair ({default_draft})") as step:
        pair = ensure_default_pair(default_draft, on_step=step)
    if draft is not None:
        check_draft_dir(draft, pair.target_dir)
    return pair.target_dir, draft or pair.draft_dir


def _require_matplotlib() -> None:
    from dflash.core.errors import InputError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed", "pip install matplotlib, or drop --plot") from None


# ---- the verdict --------------------------------------------------------------------------------------------


def _verdict(report, output: Output, *, strict: bool, min_accepted_length: float | None) -> int:
    """The exit code: 1 for a lossless violation, a failed request or too short accepted lengths."""
    failed = False
    for error in report.errors:
        output.error(escape(error))
        failed = True
    mismatches = report.mismatches
    if mismatches and (report.exact or strict):
        setting, first = mismatches[0]
        why = "with f32 inference this is a bug" if report.exact else "--strict"
        output.error(escape(
            f"{len(mismatches)} speculative output(s) differ from the baseline ({why}); first: {setting.name}, "
            f"prompt {first.prompt_index} {first.prompt!r}, first divergence at token {first.first_divergence}"
        ))  # fmt: skip
        failed = True
    if min_accepted_length is not None:
        for setting in report.speculative:
            tau = (setting.spec or {}).get("mean_accepted_length")
            if tau is None or tau < min_accepted_length:
                shown = "none" if tau is None else f"{tau:.2f}"
                output.error(f"{escape(setting.name)}: mean accepted length {shown} < --min-accepted-length {min_accepted_length:g}")
                failed = True
    return 1 if failed else 0


# ---- the live display -----------------------------------------------------------------------------------------


class _LiveProgress:
    """A rich progress bar per setting on stderr (only on a terminal and without --quiet); with --json,
    the file is rewritten after every run of a setting."""

    def __init__(self, output: Output, json_file: Path | None = None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from dflash.bench.sweep import BenchProgress

        self.output = output
        self.enabled = not output.quiet and output.err.is_terminal
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(), console=output.err, disable=not self.enabled,
        )  # fmt: skip
        self.task = None
        self.tokens = 0
        self.started = 0.0
        outer = self

        class _Callbacks(BenchProgress):
            def stage(self, message: str) -> None:
                outer.output.info(f"[dim]{escape(message)}[/dim]")

            def setting_started(self, name: str, num_requests: int) -> None:
                import time

                outer.tokens, outer.started = 0, time.perf_counter()
                outer.task = outer.progress.add_task(name, total=num_requests, rate="")

            def request_finished(self, num_generated_tokens: int) -> None:
                import time

                outer.tokens += num_generated_tokens
                elapsed = time.perf_counter() - outer.started
                rate = f"{outer.tokens / elapsed:.1f} tok/s" if elapsed > 0 else ""
                outer.progress.update(outer.task, advance=1, rate=rate)

            def setting_finished(self, result) -> None:
                line = f"{result.name}: {result.tokens_per_s:.1f} tok/s"
                if result.speedup is not None:
                    line += f", {result.speedup:.2f}x"
                if result.spec and result.spec.get("mean_accepted_length") is not None:
                    line += f", tau {result.spec['mean_accepted_length']:.2f}"
                if not outer.enabled:
                    outer.output.info(f"[dim]{escape(line)}[/dim]")

            def report_updated(self, report) -> None:
                if json_file is not None:  # the figures so far, status "running": a kill loses at most one run
                    _write_json(report, json_file)

            def warning(self, message: str) -> None:
                outer.output.warning(escape(message))

        self.callbacks = _Callbacks()

    def __enter__(self):
        self.progress.__enter__()
        return self.callbacks

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)


# ---- tables, JSON, plot -----------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def _table(title: str, columns: tuple[str, ...]):
    """A table whose figures never wrap or get cut; the setting column folds if 80 columns are short."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column(columns[0], overflow="fold", ratio=1)
    for column in columns[1:]:
        table.add_column(column, justify="right", no_wrap=True)
    return table


def _print_tables(report, output: Output) -> None:
    """Narrow tables that fit 80 columns, each with a legend of its own columns: throughput, latency,
    acceptance and agreement with the baseline, time shares, acceptance by draft position."""
    if not report.settings:
        return
    suffix = "" if report.status == "complete" else f" ({report.status})"
    speed = _table("throughput" + suffix, ("setting", "tok/s", "speedup"))
    latency = _table("latency (ms)" + suffix, ("setting", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"))
    for s in report.settings:
        speedup = "-" if s.speedup is None else f"{s.speedup:.2f}x"
        if s.speedup_range is not None and s.rounds > 1:
            speedup += f" ({s.speedup_range[0]:.2f}-{s.speedup_range[1]:.2f})"
        speed.add_row(s.name, f"{s.tokens_per_s:.1f}", speedup)
        latency.add_row(s.name, _ms(s.ttft_s["p50"]), _ms(s.ttft_s["p90"]), _ms(s.tpot_s["p50"]), _ms(s.tpot_s["p90"]))
    rounds = f"median and range over {report.settings[0].rounds} rounds" if report.settings[0].rounds > 1 else "one round"
    output.data(speed)
    output.data(f"[dim]tok/s: generated tokens per second over all requests; speedup: over the baseline at the same "
                f"concurrency, the two taking turns wave by wave ({rounds})[/dim]\n")  # fmt: skip
    output.data(latency)
    output.data("[dim]TTFT: time to the first token; TPOT: time per output token after it; p50/p90: median and "
                "90th percentile over the requests[/dim]\n")  # fmt: skip
    if not report.speculative:
        return
    acceptance = _table("acceptance" + suffix, ("setting", "tau", "acc", "=base", "1st diff"))
    shares = _table("where the time goes" + suffix, ("setting", "drafting", "target", "draft", "host"))
    positions = _table("acceptance by draft position", ("setting", "positions 1..k"))
    positions.columns[1].no_wrap, positions.columns[1].justify = False, "left"
    for s in report.speculative:
        spec = s.spec or {}
        agreement = f"{s.agreement.identical}/{s.agreement.compared}" if s.agreement else "-"
        divergence = _fmt(s.agreement.median_first_divergence, "g") if s.agreement else "-"
        acceptance.add_row(s.name, _fmt(spec.get("mean_accepted_length"), ".2f"), _fmt(spec.get("acceptance_rate"), ".1%"),
                           agreement, divergence)  # fmt: skip
        shares.add_row(s.name, _fmt(s.drafting_share, ".0%"), _fmt(s.target_share, ".0%"), _fmt(s.draft_share, ".0%"),
                       _fmt(s.host_share, ".1%"))  # fmt: skip
        rates = spec.get("acceptance_by_position") or []
        positions.add_row(s.name, " ".join(f"{r:.2f}" for r in rates) or "-")
    output.data(acceptance)
    output.data("[dim]tau: mean accepted length (tokens per draft step, the target's own token included); acc: share "
                "of candidates accepted; =base: outputs identical to the baseline's; 1st diff: median index of the "
                f"first differing token of those that differ. {_agreement_note(report)}[/dim]\n")  # fmt: skip
    output.data(shares)
    output.data("[dim]drafting: share of request steps that drafted; target, draft: share of the step time in the "
                "target's run and in the draft step (packing, inference, outputs); host: share outside the two models' "
                "infer() calls (scheduling, packing, verification, bookkeeping; a DSpark draft's Markov head)[/dim]\n")  # fmt: skip
    output.data(positions)


def _agreement_note(report) -> str:
    """What agreement with the baseline means at the precision the target was compiled with."""
    if report.exact:
        return "f32 inference: every output must equal the baseline's."
    compiled = report.environment.get("target_precision") or "the CPU's default precisions"
    return (
        f"Compiled as {compiled} (OpenVINO's defaults on this CPU; bf16 where it has bf16 units): outputs can part "
        "from the baseline's at a near-tie, because a row's logits depend on how many rows share a step "
        "(verification adds the candidates as rows; quantized KV cache and activations, bf16); a single row "
        "computes exactly what the target alone does. With --ov-config INFERENCE_PRECISION_HINT=f32 --ov-config "
        "KV_CACHE_PRECISION=f32 they are identical."
    )


def _write_json(report, path: Path) -> None:
    """Written whole or not at all: a temporary file beside `path`, renamed over it; signals wait."""
    import os
    import tempfile

    from dflash.exporters import interrupts

    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report.to_json(), indent=2, default=str) + "\n"
    with interrupts.deferred():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would become the file's mode
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def plot_report(report, path: Path) -> None:
    """Three panels under a title naming the models and the date: acceptance by draft position per
    setting, tokens/s vs concurrency (one line per setting, the baseline included), and the speedup
    over the baseline vs concurrency. Concurrency ticks are the measured values only."""
    import datetime

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8))
    markers = "osD^vP*X"
    for i, s in enumerate(report.speculative):
        rates = (s.spec or {}).get("acceptance_by_position") or []
        if rates:  # settings at several concurrencies overlap: dashed lines and their own markers keep each visible
            left.plot(range(1, len(rates) + 1), rates, marker=markers[i % len(markers)], linestyle="--" if i % 2 else "-",
                      alpha=0.85, label=s.name)  # fmt: skip
    left.set(title="acceptance by draft position", xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05))
    if left.lines:
        left.legend(fontsize="small")
        left.xaxis.get_major_locator().set_params(integer=True)
    series: dict[str, list] = {}
    for s in report.settings:
        key = "baseline" if s.kind == "baseline" else s.name.replace(f" c={s.concurrency}", "")  # one line per k/top-k
        series.setdefault(key, []).append(s)
    for label, settings in series.items():
        settings.sort(key=lambda s: s.concurrency)
        concurrency = [s.concurrency for s in settings]
        middle.plot(concurrency, [s.tokens_per_s for s in settings], marker="o", label=label,
                    color="black" if label == "baseline" else None)  # fmt: skip
        if label != "baseline" and any(s.speedup is not None for s in settings):
            measured = [s for s in settings if s.speedup is not None]
            speedups = [s.speedup for s in measured]
            low = [s.speedup - (s.speedup_range or [s.speedup])[0] for s in measured]
            high = [(s.speedup_range or [0, s.speedup])[1] - s.speedup for s in measured]
            right.errorbar([s.concurrency for s in measured], speedups, yerr=[low, high], marker="o", capsize=3, label=label)
    concurrencies = sorted({s.concurrency for s in report.settings})
    for axis in (middle, right):
        if len(concurrencies) > 2 and concurrencies[-1] / concurrencies[0] >= 8:
            axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.minorticks_off()
    middle.set(title="throughput vs concurrency", xlabel="concurrency (requests in flight)", ylabel="tokens/s")
    middle.legend(fontsize="small")
    right.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    right.set(title="speedup over the target alone", xlabel="concurrency (requests in flight)", ylabel="speedup (x)")
    if right.lines:
        right.legend(fontsize="small")
    env = report.environment or {}
    models = " + ".join(Path(env[key]).name for key in ("target_dir", "draft_dir") if env.get(key))
    precision = "f32" if report.exact else "bf16"
    fig.suptitle(f"{models}  ({precision}, {env.get('cpu_model') or 'CPU'}, {datetime.date.today().isoformat()})", fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
