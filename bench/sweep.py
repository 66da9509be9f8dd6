"""Benchmark sweeps: the target alone against speculative settings, on the same prompts, in one run.

    report = run_bench(BenchOptions(target_dir, draft_dir, prompts, concurrencies=(1, 4)))

One sweep:

    engines                      -> the target alone and one draft engine per Markov top-k, loaded at
                                    once and warmed up
    each round, each concurrency -> the prompts in waves of `concurrency` (one prompt at c=1); each
                                    wave through the baseline, then through every speculative setting
                                    (num_assistant_tokens x schedule x top-k), in turn, so a setting
                                    and its baseline see the same machine to within a wave's time
    after every speculative run  -> its outputs compared token for token with the baseline's at the
                                    same concurrency (losslessness); speedup = the median over rounds
                                    of (baseline wall time / setting wall time) in the same round

Every request ignores EOS, so each generates exactly max_new_tokens (a stop can only come from the
model's length limit) and every setting does the same work. Requests are greedy unless
`options.sampling` sets a temperature. Under sampling the greedy settings run too (`greedy_reference`),
so acceptance under sampling is reported next to greedy's, and `draft_proposals` sweeps how the draft
proposes ("argmax" or "sampled": core/verification.py) on the same engines. With a seed and argmax
proposals a sampled output is the target alone's own draws, so it is compared with the baseline's like
a greedy one; sampled proposals give the same distribution but other draws, and are not compared. Concurrency c keeps at
most c requests in the engine: a new one is added as soon as one finishes.

With f32 inference (INFERENCE_PRECISION_HINT=f32; the engine then also turns off dynamic quantization of
activations, see config.compile_properties) outputs do not depend on batch composition, so any
speculative output that differs from the baseline's is a bug. With bf16 they drift with the batch,
and agreement is reported (identical outputs, median first divergence) instead.

Ctrl-C returns the report of the settings that finished, with `status == "interrupted"`.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflash.core.config import DRAFT_PROPOSALS, SamplingParams, is_exact_inference
from dflash.core.errors import InputError
from dflash.core.metrics import SpecDecodingStats, StepTimes
from dflash.core.tokenization import Prompt, tokenize_prompt

from .environment import environment
from .report import SCHEMA_VERSION, BenchReport, SettingResult, compare_outputs


@dataclass(frozen=True)
class BenchOptions:
    """What to sweep. `num_assistant_tokens` and `markov_top_ks` hold None for "the draft's default"."""

    target_dir: Path
    draft_dir: Path
    prompts: Sequence[Prompt]
    engine_config: Any = None  # an EngineConfig (default: EngineConfig()); markov_head_top_k is swept
    max_new_tokens: int = 128
    concurrencies: Sequence[int] = (1,)
    num_assistant_tokens: Sequence[int | None] = (None,)
    schedules: Sequence[str] = ("adaptive",)  # num_assistant_tokens_schedule values
    markov_top_ks: Sequence[int | None] = (None,)
    chat: bool | None = None  # None: when the tokenizer has a chat template
    warmup: int = 2
    rounds: int = 1  # every setting runs every prompt once per round, wave by wave in turn with its baseline
    baseline: bool = True
    dataset: str | None = None  # where the prompts came from, for the report
    # temperature, top_p, top_k and seed of every request (the default: greedy); the other fields are the sweep's
    sampling: SamplingParams = SamplingParams()
    greedy_reference: bool = True  # under sampling, run every setting greedy too (acceptance side by side)
    draft_proposals: Sequence[str | None] = (None,)  # under sampling: "argmax", "sampled"; None = the engine's default


class BenchProgress:
    """Callbacks of a running sweep (the CLI draws a live display from them); all no-ops here."""

    def stage(self, message: str) -> None: ...
    def setting_started(self, name: str, num_requests: int) -> None: ...
    def request_finished(self, num_generated_tokens: int) -> None: ...
    def setting_finished(self, result: SettingResult) -> None: ...
    def report_updated(self, report: BenchReport) -> None: ...  # after every run of a setting
    def warning(self, message: str) -> None: ...


# ---- the sweep -------------------------------------------------------------------------------------------


def run_bench(options: BenchOptions, progress: BenchProgress | None = None) -> BenchReport:
    """Run the baseline and every speculative setting; return the report (partial on Ctrl-C)."""
    from dflash.core.engine import EngineConfig

    progress = progress or BenchProgress()
    config = options.engine_config or EngineConfig()
    _check_options(options)
    report = BenchReport(
        schema_version=SCHEMA_VERSION,
        status="running",
        exact=is_exact_inference(config.ov_config),
        environment=environment(options.target_dir, options.draft_dir),
        options=options_json(options, config),
        prompts=[],
    )
    try:
        _sweep(options, config, report, progress)
        report.status = "complete"
    except KeyboardInterrupt:
        report.status = "interrupted"
    return report


def _check_options(options: BenchOptions) -> None:
    if not options.prompts:
        raise InputError("no prompts to benchmark", "pass --dataset humaneval or a prompts file with prompts")
    if not options.concurrencies or min(options.concurrencies) < 1:
        raise InputError("concurrency values must be >= 1", "e.g. --concurrency 1,4,8")
    if options.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be >= 1", "e.g. --max-new-tokens 128")
    if options.rounds < 1:
        raise InputError("--rounds must be >= 1", "e.g. --rounds 3")
    for proposals in options.draft_proposals:
        if proposals is not None and proposals not in DRAFT_PROPOSALS:
            raise InputError(f"unknown draft proposals {proposals!r}", f"choose from {', '.join(DRAFT_PROPOSALS)}")


@dataclass(frozen=True)
class _Setting:
    """One column of the sweep: the target alone, or the draft with one choice of options."""

    kind: str  # "baseline" or "speculative"
    concurrency: int
    num_assistant_tokens: int | None = None
    top_k: int | None = None  # the engine: markov_head_top_k
    schedule: str | None = None
    sampled: bool = False  # with the sweep's sampling params (else greedy)
    proposals: str | None = None  # sampled speculative settings: the draft's proposals (None: the engine's default)

    @property
    def name(self) -> str:
        mode = " sampled" if self.sampled else ""
        if self.kind == "baseline":
            return f"baseline c={self.concurrency}{mode}"
        k = "auto" if self.num_assistant_tokens is None else self.num_assistant_tokens
        name = f"spec c={self.concurrency} k={k}"
        name += f" {self.schedule}" if self.schedule not in (None, "adaptive") else ""
        name += f" topk={self.top_k}" if self.top_k is not None else ""
        return name + mode + (f" q={self.proposals}" if self.sampled and self.proposals is not None else "")


@dataclass
class _SettingRun:
    """One run of every prompt at one setting: what the summary is made of."""

    results: list  # GenerationResult per prompt
    wall_s: float
    times: StepTimes  # engine time during the run
    decisions: tuple[int, int]  # (request-step decisions, of them drafting)

    @staticmethod
    def joined(waves: list[_SettingRun]) -> _SettingRun:
        """Runs as one (the waves of a round, or the rounds of a setting): results in order, times and
        counts summed."""
        times = StepTimes()
        for wave in waves:
            times = times + wave.times
        return _SettingRun(
            [r for wave in waves for r in wave.results], sum(wave.wall_s for wave in waves), times,
            (sum(wave.decisions[0] for wave in waves), sum(wave.decisions[1] for wave in waves)),
        )  # fmt: skip


def _sweep(options: BenchOptions, config, report: BenchReport, progress: BenchProgress) -> None:
    """Every setting once per round, wave by wave in turn with the baseline at each concurrency, so
    that a setting and its baseline see the same machine (a load that changes during a run changes
    both) and the same cold prefix cache; the speedup is the median of the per-round ratios."""
    engines = _load_engines(options, config, progress)
    first = next(iter(engines.values()))
    report.environment["target_precision"] = first.runner.precision
    encoded = [tokenize_prompt(first.tokenizer, p, chat=_use_chat(first, options.chat)) for p in options.prompts]
    report.prompts = [text for text, _ in encoded]
    token_prompts = [ids for _, ids in encoded]
    for engine in engines.values():
        _warm_up(engine, token_prompts, options, progress)
    runs: dict[_Setting, list[_SettingRun]] = {}
    ratios: dict[_Setting, list[float]] = {}
    for round_index in range(options.rounds):
        for concurrency, sampled in itertools.product(options.concurrencies, _sampling_modes(options)):
            baseline = _Setting("baseline", concurrency, sampled=sampled) if "baseline" in engines else None
            # Greedy requests never draw from the draft; sampled settings name the proposals they ran with.
            proposals = [how or config.draft_proposals for how in options.draft_proposals] if sampled else [None]
            settings = ([baseline] if baseline else []) + [
                _Setting("speculative", concurrency, k, top_k, schedule, sampled, how)
                for top_k in options.markov_top_ks
                for k, schedule, how in itertools.product(options.num_assistant_tokens, options.schedules, proposals)
            ]
            progress.setting_started(_group_name(settings, round_index, options.rounds), len(token_prompts) * len(settings))
            for setting, run in _run_in_turn(engines, settings, token_prompts, options, progress).items():
                runs.setdefault(setting, []).append(run)
                if baseline is not None and setting.kind == "speculative":
                    ratios.setdefault(setting, []).append(runs[baseline][-1].wall_s / runs[setting][-1].wall_s)
                _publish(report, runs, ratios, setting, baseline, progress, last=round_index == options.rounds - 1,
                         compare=_comparable(setting, options))  # fmt: skip
    for engine in engines.values():
        for warning in engine.warnings:
            progress.warning(warning)


def _run_in_turn(engines: dict, settings: list[_Setting], token_prompts: list[list[int]], options: BenchOptions,
                 progress: BenchProgress) -> dict[_Setting, _SettingRun]:  # fmt: skip
    """One round of `settings` (one concurrency): the prompts in waves of that many, each wave through
    every setting in turn; each setting's waves joined into one run."""
    concurrency = settings[0].concurrency
    waves: dict[_Setting, list[_SettingRun]] = {setting: [] for setting in settings}
    for start in range(0, len(token_prompts), concurrency):
        for setting in settings:
            engine = engines["baseline" if setting.kind == "baseline" else setting.top_k]
            if setting.kind == "speculative":  # a plain attribute, read at each draft step
                engine.drafter.proposals = setting.proposals or engine.config.draft_proposals
            wave = token_prompts[start : start + concurrency]
            waves[setting].append(_run_setting(engine, wave, options, setting, progress))
    return {setting: _SettingRun.joined(runs) for setting, runs in waves.items()}


def _group_name(settings: list[_Setting], round_index: int, rounds: int) -> str:
    """What a progress bar runs: the settings that take turns wave by wave, and the round."""
    name = settings[0].name if len(settings) == 1 else f"{settings[0].name} and {len(settings) - 1} in turn"
    return name + (f" (round {round_index + 1}/{rounds})" if rounds > 1 else "")


def _comparable(setting: _Setting, options: BenchOptions) -> bool:
    """Whether the setting's outputs must equal the baseline's: greedy, or sampled with a seed and the
    draft's argmax proposals (verified by the target's own draws: core/verification.py)."""
    return not setting.sampled or (options.sampling.seed is not None and setting.proposals == "argmax")


def _sampling_modes(options: BenchOptions) -> tuple[bool, ...]:
    """False for the greedy settings, True for the sampled ones (with the sweep's sampling params)."""
    if options.sampling.is_greedy:
        return (False,)
    return (False, True) if options.greedy_reference else (True,)


def _load_engines(options: BenchOptions, config, progress: BenchProgress) -> dict:
    """The target alone ("baseline") and one draft engine per Markov top-k, all loaded at once."""
    from dflash.core.engine import LLMEngine

    engines: dict = {}
    if options.baseline:
        progress.stage(f"Loading the target {options.target_dir}")
        engines["baseline"] = LLMEngine(options.target_dir, config)
    for top_k in options.markov_top_ks:
        progress.stage(f"Loading the target with the draft {options.draft_dir}" + (f" (markov top-k {top_k})" if top_k is not None else ""))
        engines[top_k] = LLMEngine(options.target_dir, replace(config, markov_head_top_k=top_k), draft_dir=options.draft_dir)
    return engines


def _publish(report: BenchReport, runs, ratios, setting: _Setting, baseline: _Setting | None, progress, *, last: bool,
             compare: bool = True) -> None:  # fmt: skip
    """Put the setting's summary over its runs so far into the report (in place of an earlier one)."""
    result = _summarize(setting, runs[setting], ratios.get(setting, []))
    if baseline is not None and setting.kind == "speculative" and compare:
        result.agreement = compare_outputs([r.token_ids for r in runs[baseline][0].results], result.token_ids, report.prompts)
    names = [s.name for s in report.settings]
    if result.name in names:
        report.settings[names.index(result.name)] = result
    else:
        report.settings.append(result)
    progress.report_updated(report)
    if last:
        if result.agreement is not None:
            _warn_disagreement(result, report.exact, progress)
        progress.setting_finished(result)


def _use_chat(engine, chat: bool | None) -> bool:
    return chat if chat is not None else bool(getattr(engine.tokenizer, "chat_template", None))


def _warm_up(engine, token_prompts: list[list[int]], options: BenchOptions, progress: BenchProgress) -> None:
    """Run `warmup` requests (cycling through the prompts) whose figures count nowhere."""
    if options.warmup <= 0:
        return
    progress.stage(f"Warming up ({options.warmup} requests)")
    prompts = [token_prompts[i % len(token_prompts)] for i in range(options.warmup)]
    engine.generate(prompts, replace(options.sampling, max_new_tokens=options.max_new_tokens, ignore_eos=True))


def _run_setting(engine, token_prompts: list[list[int]], options: BenchOptions, setting: _Setting,
                 progress: BenchProgress) -> _SettingRun:  # fmt: skip
    """Every prompt (of a wave) through the engine with at most `concurrency` requests in it at once,
    from a cold prefix cache: settings that share an engine run the same prompts one after the other, and
    every one after the first found the prompts cached (at c=1 a HumanEval prompt's prefill is about a
    sixth of its request: the first speculative setting of each wave read 10% slower than the next,
    at the same acceptance)."""
    engine.reset_prefix_cache()
    sampling = options.sampling if setting.sampled else SamplingParams()
    params = replace(sampling, max_new_tokens=options.max_new_tokens, ignore_eos=True,
                     num_assistant_tokens=setting.num_assistant_tokens, num_assistant_tokens_schedule=setting.schedule or "adaptive")
    times_before, stats_before = copy.copy(engine.times), copy.copy(engine.drafter.stats)
    run = run_with_concurrency(engine, token_prompts, params, setting.concurrency, progress.request_finished)
    wall_s = time.perf_counter() - run.started
    stats = engine.drafter.stats
    decisions = (stats.num_decisions - stats_before.num_decisions, stats.num_drafting - stats_before.num_drafting)
    return _SettingRun(run.results, wall_s, engine.times - times_before, decisions)


def _summarize(setting: _Setting, runs: list[_SettingRun], ratios: list[float]) -> SettingResult:
    """One setting's figures over its runs: throughput and latency over every request of every round,
    the speedup as the median of the per-round ratios (with their range)."""
    total_run = _SettingRun.joined(runs)  # every round's results, times and decisions added up
    results, times = total_run.results, total_run.times
    speculative = setting.kind == "speculative"
    spec = None
    if speculative:
        total = SpecDecodingStats()
        for result in results:
            if result.spec is not None:
                total.merge(result.spec)
        spec = total.to_json()
    decisions, drafting = total_run.decisions
    num_tokens = sum(r.num_generated_tokens for r in results)
    wall_s = total_run.wall_s
    return SettingResult(
        name=setting.name,
        kind=setting.kind,
        concurrency=setting.concurrency,
        num_assistant_tokens=setting.num_assistant_tokens,
        num_assistant_tokens_schedule=setting.schedule,
        markov_top_k=setting.top_k,
        sampled=setting.sampled,
        draft_proposals=setting.proposals if speculative and setting.sampled else None,
        num_requests=len(runs[0].results),
        num_generated_tokens=num_tokens // len(runs),
        wall_s=wall_s / len(runs),
        tokens_per_s=num_tokens / wall_s if wall_s > 0 else 0.0,
        speedup=float(statistics.median(ratios)) if ratios else None,
        ttft_s=_percentiles([r.ttft_s for r in results]),
        tpot_s=_percentiles([r.tpot_s for r in results]),
        spec=spec,
        times=times.to_json(),
        target_share=_ratio(times.target_s, times.step_s),
        draft_share=_ratio(times.draft_s, times.step_s) if speculative else None,
        host_share=times.host_share,
        drafting_share=drafting / decisions if speculative and decisions else None,
        agreement=None,
        rounds=len(runs),
        speedup_range=[min(ratios), max(ratios)] if ratios else None,
        errors=[f"prompt {i}: {r.error}" for i, r in enumerate(runs[0].results) if r.error],
        token_ids=[r.token_ids for r in runs[0].results],
    )


@dataclass
class _Run:
    results: list  # GenerationResult per prompt, in prompt order
    started: float


def run_with_concurrency(engine, prompts: Sequence[Prompt], params, concurrency: int,
                         on_finished: Callable[[int], None] | None = None) -> _Run:  # fmt: skip
    """Run `prompts` with at most `concurrency` requests running at once; results in prompt order.

    Every prompt enters the engine's queue at once, as requests reach a server with a backlog: the
    scheduler admits the next one as soon as one ends, and the adaptive schedule knows that a request
    that ends early hands its place on (`core/adaptive.py`: a batch with nothing waiting drafts only
    where that finishes it sooner). A queued prompt's time to first token counts its wait.
    On any failure (Ctrl-C included) the unfinished requests are aborted, so the engine stays usable.
    """
    unfinished: dict[str, int] = {}
    results: list = [None] * len(prompts)
    started = time.perf_counter()
    with engine.running_at_most(concurrency):
        try:
            for index, prompt in enumerate(prompts):
                unfinished[engine.add_request(prompt, params)] = index
            while unfinished:
                for output in engine.step():
                    if output.finished and output.req_id in unfinished:
                        result = engine.result(output.req_id)
                        results[unfinished.pop(output.req_id)] = result
                        if on_finished is not None:
                            on_finished(result.num_generated_tokens)
        except BaseException:
            for req_id in unfinished:
                if engine.abort_request(req_id):
                    engine.result(req_id)  # forget it
            raise
    return _Run(results, started)


def _percentiles(values: list[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return {"p50": None, "p90": None}
    return {"p50": float(np.percentile(present, 50)), "p90": float(np.percentile(present, 90))}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _warn_disagreement(result: SettingResult, exact: bool, progress: BenchProgress) -> None:
    agreement = result.agreement
    if agreement is None or not agreement.mismatches:
        return
    first = agreement.mismatches[0]
    if exact:
        progress.warning(
            f"{result.name}: output of prompt {first.prompt_index} differs from the baseline at token "
            f"{first.first_divergence} with f32 inference (a bug): {_snippet(first.prompt)!r}"
        )
    else:
        progress.warning(
            f"{result.name}: {agreement.identical}/{agreement.compared} outputs identical to the baseline "
            f"(median first divergence at token {agreement.median_first_divergence:g}; outputs drift with the batch "
            "unless inference is f32)"
        )


def _snippet(text: str | None, width: int = 80) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def options_json(options: BenchOptions, config) -> dict:
    return {
        "dataset": options.dataset,
        "num_prompts": len(options.prompts),
        "max_new_tokens": options.max_new_tokens,
        "concurrency": list(options.concurrencies),
        "num_assistant_tokens": list(options.num_assistant_tokens),
        "num_assistant_tokens_schedules": list(options.schedules),
        "rounds": options.rounds,
        "markov_top_k": list(options.markov_top_ks),
        "chat": options.chat,
        "warmup": options.warmup,
        "baseline": options.baseline,
        "greedy": options.sampling.is_greedy,
        "sampling": {name: getattr(options.sampling, name) for name in ("temperature", "top_p", "top_k", "seed")},
        "greedy_reference": options.greedy_reference,
        "draft_proposals": list(options.draft_proposals),
        "ignore_eos": True,
        "engine_config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "markov_head_top_k"},
    }
