"""`dflash bench` on a tiny random pair: the JSON schema, figures that agree with the engine's own
counters, a planted lossless violation, prompts-file errors, Ctrl-C mid-sweep and the
--min-accepted-length gate.

Inference runs with f32 compute and f32 KV caches, where the speculative outputs must equal the
baseline's token for token; a random draft accepts almost nothing (mean accepted length near 1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import dflash.bench.report as bench_report
import dflash.bench.sweep as bench_sweep
from dflash.cli.bench import bench
from dflash.core.config import EXACT_OV_CONFIG, SamplingParams
from dflash.core.engine import EngineConfig, LLMEngine
from dflash.core.metrics import SpecDecodingStats
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.target import export_target
from dflash.exporters.tiny import make_tiny_target

pytestmark = pytest.mark.slow  # exports models or runs many engines: left out of the fast subset (-m 'not slow')

F32 = EXACT_OV_CONFIG
F32_ARGS = ["--ov-config", "INFERENCE_PRECISION_HINT=f32", "--ov-config", "KV_CACHE_PRECISION=f32"]
PROMPTS = ["Hello, world!", "def add(a, b):", "The quick brown fox jumps over the lazy dog."]
NEW_TOKENS = 8

app = typer.Typer()
app.command()(bench)
runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench")
    target_hf = make_tiny_target(root / "hf-target", "qwen3", seed=3)
    draft_hf = make_tiny_draft(root / "hf-draft", target_hf, kind="dflash", draft_block_size=4, seed=11)
    target = export_target(target_hf, root / "ov-target", weight_format="fp32")
    draft = export_draft(draft_hf, root / "ov-draft", weight_format="fp32")
    return target, draft


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def run_cli(pair, prompts_file, tmp_path, *extra: str):
    target, draft = pair
    json_file = tmp_path / "bench.json"
    args = [str(target), "--draft", str(draft), "--dataset", str(prompts_file), "--max-new-tokens", str(NEW_TOKENS),
            "--warmup", "1", "--json-file", str(json_file), *F32_ARGS, *extra]  # fmt: skip
    result = runner.invoke(app, args)
    data = json.loads(json_file.read_text()) if json_file.exists() else None
    return result, data


@pytest.fixture(scope="module")
def sweep(pair, prompts_file, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sweep")
    # The constant schedule: its counters are deterministic (adaptive decisions follow measured timings).
    result, data = run_cli(pair, prompts_file, workdir, "--concurrency", "1,2", "--plot", str(workdir / "bench.png"),
                           "--num-assistant-tokens-schedule", "constant")  # fmt: skip
    return result, data, workdir / "bench.png"


def test_plot_is_written(sweep):
    result, _, plot = sweep
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 1000


def test_json_schema(sweep):
    result, data, _ = sweep
    assert result.exit_code == 0, result.output
    assert data["schema_version"] == bench_report.SCHEMA_VERSION
    assert data["status"] == "complete" and data["exact"] is True
    env = data["environment"]
    for key in ("dflash_version", "openvino_version", "python_version", "cpu_model", "target_dir", "draft_dir"):
        assert key in env
    assert isinstance(env["python_version"], str) and isinstance(env["openvino_version"], str)
    assert env["target_weight_precisions"] and "f32" in env["target_weight_precisions"]
    assert env["target_precision"] == "f32 inference, f32 KV cache"  # read back from the compiled target
    options = data["options"]
    assert options["concurrency"] == [1, 2] and options["max_new_tokens"] == NEW_TOKENS
    assert options["num_assistant_tokens"] == [None] and options["num_prompts"] == 3
    assert options["engine_config"]["ov_config"] == F32
    assert len(data["prompts"]) == 3 and all(PROMPTS[i] in p for i, p in enumerate(data["prompts"]))
    names = [s["name"] for s in data["settings"]]
    # Interleaved: each concurrency's baseline, then its speculative settings.
    assert names == ["baseline c=1", "spec c=1 k=auto constant", "baseline c=2", "spec c=2 k=auto constant"]
    for s in data["settings"]:
        assert s["num_requests"] == 3 and s["num_generated_tokens"] == 3 * NEW_TOKENS
        assert s["wall_s"] > 0 and s["tokens_per_s"] == pytest.approx(s["num_generated_tokens"] / s["wall_s"])
        assert set(s["ttft_s"]) == {"p50", "p90"} and s["ttft_s"]["p50"] <= s["ttft_s"]["p90"]
        assert s["tpot_s"]["p50"] > 0
        assert set(s["times"]) >= {"target_s", "draft_s", "step_s", "num_steps", "target_infer_s", "draft_infer_s", "host_share"}
        assert 0 < s["target_share"] <= 1
        # Host time: the step outside the infer() calls, which happen inside the target's run and the draft step.
        times = s["times"]
        assert 0 < times["target_infer_s"] < times["target_s"] and 0 <= times["draft_infer_s"] < times["draft_s"] + 1e-9
        assert 0 < s["host_share"] < 1 and s["host_share"] == pytest.approx(times["host_s"] / times["step_s"])
        assert s["errors"] == []
        if s["kind"] == "baseline":
            assert s["spec"] is None and s["agreement"] is None and s["speedup"] is None and s["draft_share"] is None
            assert s["times"]["draft_s"] == 0 and s["times"]["draft_infer_s"] == 0
        else:
            assert s["kind"] == "speculative" and 0 < s["draft_share"] < 1 and s["times"]["draft_infer_s"] > 0
            assert isinstance(s["speedup"], float)
            assert set(s["spec"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_accepted_length",
                                      "acceptance_rate", "acceptance_by_position"}  # fmt: skip
            # f32: every speculative output equals the baseline's.
            assert s["agreement"]["compared"] == 3 and s["agreement"]["identical"] == 3
            assert s["agreement"]["mismatches"] == [] and s["agreement"]["median_first_divergence"] is None
    assert "spec c=2 k=auto" in result.output  # the table on stdout


def test_figures_agree_with_a_direct_engine_run(sweep, pair):
    """The JSON's acceptance totals are what the engine's own counters give for the same prompts."""
    _, data, _ = sweep
    target, draft = pair
    engine = LLMEngine(target, EngineConfig(ov_config=F32), draft_dir=draft)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, num_assistant_tokens_schedule="constant")
    before = SpecDecodingStats()
    before.merge(engine.spec_stats)
    direct = SpecDecodingStats()
    for prompt in PROMPTS:  # one at a time: concurrency 1
        (result,) = engine.generate([prompt], params, chat=True)
        direct.merge(result.spec)
    engine_delta = engine.spec_stats  # the engine-wide counters agree with the per-request ones
    assert engine_delta.num_accepted_tokens - before.num_accepted_tokens == direct.num_accepted_tokens
    for setting in [s for s in data["settings"] if s["kind"] == "speculative"]:
        assert setting["spec"] == direct.to_json()
        # Every verification step commits accepted + 1 tokens; steps without candidates commit one.
        spec = setting["spec"]
        assert 0 < spec["num_accepted_tokens"] + spec["num_drafts"] <= setting["num_generated_tokens"]


def test_a_planted_mismatch_fails_with_the_prompt(pair, prompts_file, tmp_path, monkeypatch):
    verify = LLMEngine._verify

    def corrupt(self, scheduled, logits):
        verdicts = verify(self, scheduled, logits)
        for s, request in scheduled:
            verdict = verdicts.get(s.req_id)
            if verdict is not None and verdict.num_drafted and "fox" in self.tokenizer.decode(request.prompt_token_ids):
                verdict.tokens[-1] = (verdict.tokens[-1] + 1) % 500  # a wrong bonus token for one prompt
        return verdicts

    monkeypatch.setattr(LLMEngine, "_verify", corrupt)  # only the draft engine verifies candidates
    result, data = run_cli(pair, prompts_file, tmp_path, "--concurrency", "1", "--num-assistant-tokens-schedule", "constant")
    assert result.exit_code == 1, result.output
    assert "differ from the baseline" in result.output and "The quick brown fox" in result.output
    agreement = data["settings"][1]["agreement"]
    assert agreement["identical"] == 2 and agreement["mismatches"][0]["prompt_index"] == 2


def test_prompts_file_errors_have_line_numbers(pair, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    target, draft = pair
    result = runner.invoke(app, [str(target), "--draft", str(draft), "--dataset", str(bad)])
    assert result.exit_code == 2
    assert "bad.jsonl:2" in result.output


def test_bad_concurrency_is_a_usage_error(pair, prompts_file):
    target, draft = pair
    result = runner.invoke(app, [str(target), "--draft", str(draft), "--dataset", str(prompts_file), "--concurrency", "1,x"])
    assert result.exit_code == 2 and "--concurrency" in result.output


def test_plot_without_matplotlib_is_a_clear_error(pair, prompts_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    target, draft = pair
    result = runner.invoke(app, [str(target), "--draft", str(draft), "--dataset", str(prompts_file), "--plot", "x.png"])
    assert result.exit_code == 2 and "matplotlib" in result.output


def test_ctrl_c_writes_the_finished_settings(pair, prompts_file, tmp_path, monkeypatch):
    calls = []
    run = bench_sweep.run_with_concurrency

    def interrupted_at_concurrency_2(engine, prompts, params, concurrency, on_finished=None):
        calls.append(concurrency)
        if concurrency == 2:  # the c=1 settings have run every prompt; the c=2 ones are cut off
            raise KeyboardInterrupt
        return run(engine, prompts, params, concurrency, on_finished)

    monkeypatch.setattr(bench_sweep, "run_with_concurrency", interrupted_at_concurrency_2)
    result, data = run_cli(pair, prompts_file, tmp_path, "--concurrency", "1,2")
    assert result.exit_code == 130, result.output
    assert data["status"] == "interrupted"
    assert [s["name"] for s in data["settings"]] == ["baseline c=1", "spec c=1 k=auto"]
    assert calls.count(2) == 1


def test_min_accepted_length_above_a_random_draft_fails(pair, prompts_file, tmp_path):
    result, data = run_cli(pair, prompts_file, tmp_path, "--concurrency", "1", "--min-accepted-length", "2.5")
    assert result.exit_code == 1, result.output
    tau = data["settings"][1]["spec"]["mean_accepted_length"]
    assert tau < 2.5 and "--min-accepted-length" in result.output


def test_schedules_are_swept(pair, prompts_file, tmp_path):
    result, data = run_cli(pair, prompts_file, tmp_path, "--concurrency", "1", "--num-assistant-tokens-schedule",
                           "constant,heuristic,adaptive")  # fmt: skip
    assert result.exit_code == 0, result.output
    speculative = [s for s in data["settings"] if s["kind"] == "speculative"]
    assert [(s["name"], s["num_assistant_tokens_schedule"]) for s in speculative] == [
        ("spec c=1 k=auto constant", "constant"),
        ("spec c=1 k=auto heuristic", "heuristic"),
        ("spec c=1 k=auto", "adaptive"),  # the default schedule goes unnamed
    ]
    assert data["options"]["num_assistant_tokens_schedules"] == ["constant", "heuristic", "adaptive"]
    # The constant and heuristic schedules draft at every step; the adaptive one only where it pays.
    assert [s["drafting_share"] for s in speculative[:2]] == [1.0, 1.0]
    assert 0 <= speculative[2]["drafting_share"] <= 1


def test_rounds_interleave_each_setting_with_its_baseline(pair, prompts_file, tmp_path):
    result, data = run_cli(pair, prompts_file, tmp_path, "--concurrency", "1", "--rounds", "2",
                           "--num-assistant-tokens-schedule", "constant")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert data["options"]["rounds"] == 2
    baseline, spec = data["settings"]
    assert baseline["rounds"] == spec["rounds"] == 2
    # Per round: every prompt once (figures are per round; the speedup is the median of 2 ratios).
    assert spec["num_requests"] == 3 and spec["num_generated_tokens"] == 3 * NEW_TOKENS
    low, high = spec["speedup_range"]
    assert low <= spec["speedup"] <= high and baseline["speedup_range"] is None
    assert spec["spec"]["num_drafts"] > 0 and spec["agreement"]["identical"] == 3


def test_the_baseline_and_each_setting_take_turns_wave_by_wave(pair, monkeypatch):
    """A load that changes during a run must change a setting's time and its baseline's alike: the
    prompts run in waves of `concurrency`, each wave through every setting in turn."""
    target, draft = pair
    calls = []
    real = bench_sweep.run_with_concurrency

    def recorded(engine, prompts, params, concurrency, on_finished=None):
        calls.append(("draft" if engine.has_draft else "target", len(prompts), concurrency))
        return real(engine, prompts, params, concurrency, on_finished)

    monkeypatch.setattr(bench_sweep, "run_with_concurrency", recorded)
    prompts = PROMPTS + PROMPTS[:2]  # 5 prompts: waves of 2, 2 and 1 at c=2
    options = bench_sweep.BenchOptions(target, draft, prompts, engine_config=EngineConfig(ov_config=F32), max_new_tokens=NEW_TOKENS,
                                       concurrencies=(1, 2), schedules=("constant",), warmup=0)  # fmt: skip
    report = bench_sweep.run_bench(options)
    assert calls == [(kind, 1, 1) for _ in prompts for kind in ("target", "draft")] + [
        (kind, n, 2) for n in (2, 2, 1) for kind in ("target", "draft")
    ]
    # Each setting's figures still cover every prompt once, in prompt order.
    for setting in report.settings:
        assert setting.num_requests == len(prompts) and len(setting.token_ids) == len(prompts)
    spec = report.settings[1]
    assert spec.agreement.identical == len(prompts)


def test_every_setting_starts_from_a_cold_prefix_cache(pair, monkeypatch):
    """Settings that share an engine run the same prompts one after the other: without a reset, every
    one after the first found the prompts' blocks cached and skipped their prefill (at c=1 about a
    sixth of a HumanEval request), so the first speculative setting of each wave read slower."""
    target, draft = pair
    cached_at_start = []
    real = bench_sweep.run_with_concurrency

    def recorded(engine, prompts, params, concurrency, on_finished=None):
        pools = [engine.block_pool] + ([engine.drafter.kv_cache_manager.pool] if engine.has_draft else [])
        cached_at_start.append([pool.num_cached_blocks for pool in pools])
        return real(engine, prompts, params, concurrency, on_finished)

    monkeypatch.setattr(bench_sweep, "run_with_concurrency", recorded)
    long_prompt = " ".join(PROMPTS * 6)  # several KV blocks
    options = bench_sweep.BenchOptions(target, draft, [long_prompt], engine_config=EngineConfig(ov_config=F32),
                                       max_new_tokens=NEW_TOKENS, num_assistant_tokens=(2, 3), schedules=("constant",),
                                       rounds=2, warmup=1)  # fmt: skip
    report = bench_sweep.run_bench(options)
    assert len(cached_at_start) == 2 * 3  # rounds x (baseline, k=2, k=3)
    assert cached_at_start == [[0]] + [[0, 0]] * 2 + [[0]] + [[0, 0]] * 2
    engine = LLMEngine(target, EngineConfig(ov_config=F32), draft_dir=draft)  # the prompts are cached after a run
    engine.generate([long_prompt], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert engine.block_pool.num_cached_blocks > 0 and engine.drafter.kv_cache_manager.pool.num_cached_blocks > 0
    assert engine.reset_prefix_cache()
    assert engine.block_pool.num_cached_blocks == engine.drafter.kv_cache_manager.pool.num_cached_blocks == 0
    engine.add_request(long_prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert not engine.reset_prefix_cache()  # a request is running
    engine.run_until_done()
    assert all(setting.agreement is None or setting.agreement.identical == 1 for setting in report.settings)


def test_bad_schedule_is_a_usage_error(pair, prompts_file):
    target, draft = pair
    result = runner.invoke(app, [str(target), "--draft", str(draft), "--dataset", str(prompts_file),
                                 "--num-assistant-tokens-schedule", "fast"])  # fmt: skip
    assert result.exit_code == 2 and "--num-assistant-tokens-schedule" in result.output


def test_the_report_is_handed_over_after_every_run(pair):
    """The CLI rewrites --json from this callback: after each run of each setting, status "running"."""
    target, draft = pair
    seen = []

    class Recorder(bench_sweep.BenchProgress):
        def report_updated(self, report) -> None:
            seen.append((report.status, [s.name for s in report.settings], [s.rounds for s in report.settings]))

    options = bench_sweep.BenchOptions(target, draft, PROMPTS, engine_config=EngineConfig(ov_config=F32),
                                       max_new_tokens=NEW_TOKENS, schedules=("constant",), rounds=2, warmup=0)  # fmt: skip
    report = bench_sweep.run_bench(options, Recorder())
    assert report.status == "complete"
    names = ["baseline c=1", "spec c=1 k=auto constant"]
    assert seen == [("running", names[:1], [1]), ("running", names, [1, 1]), ("running", names, [2, 1]), ("running", names, [2, 2])]
