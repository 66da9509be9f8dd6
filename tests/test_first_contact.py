"""What a new user meets first: help and tables at 80 columns, input checked before the first-use
export, stdout that holds only data, JSON lines of one shape (issue 18)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import MISSING, fields

import click
import numpy as np
import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from dflash.cli.app import app
from dflash.core.config import SamplingParams
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.target import export_target
from dflash.exporters.tiny import make_tiny_target

COMMANDS = ["export", "validate", "generate", "bench", "train", "eval-draft"]
F32_ARGS = ["--ov-config", "INFERENCE_PRECISION_HINT=f32", "--ov-config", "KV_CACHE_PRECISION=f32"]

runner = CliRunner()


def _collapse(text: str) -> str:
    return " ".join(text.split())


# ---- help at 80 columns ------------------------------------------------------------------------------------


def _expected_default(param: click.Option) -> str | None:
    """What `[default: ...]` must say for an option, or None where no default is shown."""
    if isinstance(param.show_default, str):
        return f"({param.show_default})"
    if param.show_default is False or param.default is None or param.hidden:
        return None
    if param.is_flag and not param.secondary_opts:
        return None  # a plain flag is off unless given
    if param.is_flag:  # --x/--no-x: the name of the side that is on
        return (param.opts if param.default else param.secondary_opts)[0].lstrip("-")
    default = param.default
    if isinstance(default, (list, tuple)):
        return None
    return str(getattr(default, "value", default))


@pytest.mark.parametrize("name", COMMANDS)
def test_help_at_80_columns_shows_every_option_whole_with_its_default(name):
    command = typer.main.get_command(app).commands[name]
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    flat = _collapse(result.output)
    for param in command.params:
        if isinstance(param, click.Argument):
            # An argument is listed with its help on the same line, not as a bare name.
            name = re.escape(param.name.upper())
            assert re.search(rf"^  \[?{name}\]?(\.\.\.)?  +\S", result.output, flags=re.M), f"{param.name} has no help"
            continue
        for opt in param.opts + param.secondary_opts:
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", result.output), f"{opt} is not shown whole"
        default = _expected_default(param)
        if default is not None:
            assert f"default: {default}" in flat, f"{param.opts[0]}: no 'default: {default}'"


def test_generate_and_bench_spell_and_type_shared_options_alike():
    commands = typer.main.get_command(app).commands
    generate = {p.name: p for p in commands["generate"].params}
    bench = {p.name: p for p in commands["bench"].params}
    shared = set(generate) & set(bench) - {"target_dir", "max_new_tokens", "num_assistant_tokens",
                                           "num_assistant_tokens_schedule", "markov_top_k", "draft_proposals", "json_output"}  # fmt: skip
    assert {"temperature", "top_p", "top_k", "seed", "device", "ov_config", "kv_cache_size", "draft_kv_cache_size",
            "max_num_batched_tokens", "prefix_caching", "dynamic_split_fuse", "chat", "draft", "default_draft"} <= shared  # fmt: skip
    for name in shared:
        g, b = generate[name], bench[name]
        assert (g.opts, g.secondary_opts, g.default, g.help) == (b.opts, b.secondary_opts, b.default, b.help), name
        assert type(g.type) is type(b.type), name


def _setting(name: str, **values):
    """A bench SettingResult with every field the tables read, the rest empty."""
    from dflash.bench.report import SettingResult

    given = dict(
        name=name, kind="speculative" if name.startswith("spec") else "baseline", concurrency=8, num_assistant_tokens=None,
        num_assistant_tokens_schedule="constant", markov_top_k=None, num_requests=20, num_generated_tokens=2560,
        wall_s=12.5, tokens_per_s=204.8, speedup=1.23, ttft_s={"p50": 0.1234, "p90": 0.5678}, tpot_s={"p50": 0.0123, "p90": 0.0456},
        spec={"mean_accepted_length": 2.91, "acceptance_rate": 0.456, "acceptance_by_position": [0.9, 0.7, 0.5, 0.3]},
        times={}, target_share=0.71, draft_share=0.22, host_share=0.034, drafting_share=0.97, agreement=None, rounds=2, speedup_range=[1.11, 1.35],
    )  # fmt: skip
    given.update(values)
    for field in fields(SettingResult):
        if field.name not in given and field.default is MISSING and field.default_factory is MISSING:
            given[field.name] = None
    return SettingResult(**given)


def test_bench_tables_fit_80_columns_with_whole_headers():
    from dflash.bench.report import Agreement, BenchReport
    from dflash.cli._output import Output
    from dflash.cli.bench import _print_tables

    report = BenchReport(schema_version=1, status="complete", exact=False, environment={}, options={}, prompts=[])
    report.settings = [
        _setting("baseline c=8", speedup=None, speedup_range=None, spec=None),
        _setting("spec c=8 k=auto constant topk=64", agreement=Agreement(compared=20, identical=17, median_first_divergence=31)),
    ]
    output = Output()
    buffer = io.StringIO()
    output.out = Console(file=buffer, width=80, soft_wrap=False, highlight=False)
    _print_tables(report, output)
    text = "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text  # nothing cut
    for header in ("tok/s", "speedup", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "tau", "acc", "=base", "1st diff", "host"):
        assert header in _collapse(text) or header.replace(" ", "") in text, header
    assert "spec c=8 k=auto constant topk=64" in _collapse(text)  # folded, not cut
    assert "1.23x (1.11-1.35)" in text and "3.4%" in text
    # Each table's legend comes right under it and explains its own columns.
    sections = re.split(r"^(throughput|latency \(ms\)|acceptance|where the time goes|acceptance by draft position)$", text, flags=re.M)
    legends = {title: _collapse(body.split("\n\n")[0].rsplit("┘", 1)[-1]) for title, body in zip(sections[1::2], sections[2::2])}
    assert legends["throughput"].startswith("tok/s:") and "speedup:" in legends["throughput"]
    assert legends["latency (ms)"].startswith("TTFT:") and "TPOT:" in legends["latency (ms)"]
    for word in ("tau:", "acc:", "=base:", "1st diff:", "bf16"):
        assert word in legends["acceptance"]
    for word in ("drafting:", "target, draft:", "host:"):
        assert word in legends["where the time goes"]


# ---- checked before the first-use export ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["generate"],                                   # no prompt
        ["generate", "--prompts-file", "missing.txt"],  # an unreadable prompts file
        ["generate", "hi", "--top-p", "0"],             # a sampling value out of range
        ["generate", "hi", "--ov-config", "NO_EQUALS"],  # a malformed OpenVINO property
        ["bench", "--default-draft", "foo"],            # no such default draft
        ["bench", "--num-assistant-tokens", "0"],       # no drafting is the baseline
        ["bench", "--dataset", "missing.jsonl"],        # an unreadable dataset
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_the_default_pair_is_exported(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    result = runner.invoke(app, args, env={"DFLASH_CACHE_DIR": str(cache)})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not cache.exists()  # nothing was exported


def test_the_old_bench_json_file_spelling_names_the_new_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["bench", "--json", "bench.json"], env={"DFLASH_CACHE_DIR": str(tmp_path / "cache")})
    assert result.exit_code == 2
    assert "--json-file bench.json" in result.stderr
    assert not (tmp_path / "cache").exists()


# ---- stdout holds data only; JSON lines of one shape ----------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-contact")
    target_hf = make_tiny_target(root / "hf-target", "qwen3", seed=3, num_hidden_layers=2, initializer_range=0.2)
    draft_hf = make_tiny_draft(root / "hf-draft", target_hf, kind="dflash", draft_block_size=4, seed=11, num_layers=1)
    return export_target(target_hf, root / "target", weight_format="fp32"), export_draft(draft_hf, root / "draft", weight_format="fp32")


def _generate(pair, *args: str, env: dict | None = None):
    target, draft = pair
    result = runner.invoke(app, ["generate", str(target), "--draft", str(draft), "--max-new-tokens", "12", *F32_ARGS, *args], env=env)
    assert result.exit_code == 0, result.output
    return result


def test_quiet_generate_writes_only_the_generated_text(pair):
    (line,) = _generate(pair, "Tell me a story.", "--json").stdout.splitlines()
    quiet = _generate(pair, "Tell me a story.", "-q")
    assert quiet.stdout == json.loads(line)["text"] + "\n"
    assert "draft:" not in quiet.stdout and "draft:" not in quiet.stderr  # the summary is progress-level, on stderr
    # the constant schedule: the adaptive one, having learned from the runs above that this random draft
    # accepts nothing, drafts nothing (and writes no acceptance figures)
    loud = _generate(pair, "Tell me a story.", "--num-assistant-tokens-schedule", "constant")
    assert loud.stdout == quiet.stdout  # without -q the figures go to stderr, not stdout
    assert "draft:" in loud.stderr and "mean accepted length" in loud.stderr


def test_every_json_line_has_one_shape_and_the_users_prompt(pair):
    prompts = ["Tell me a story.", "Name a color."]
    result = _generate(pair, *prompts, "--json", "--chat")
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 2  # one per request, no summary line
    assert all(set(r) == set(records[0]) for r in records)
    assert {"id", "prompt", "text", "token_ids", "finish_reason", "spec_decoding"} <= set(records[0])
    assert sorted(r["prompt"] for r in records) == sorted(prompts)  # as given, not chat-templated
    target_alone = _generate(pair, *prompts, "--json", "--chat", "--num-assistant-tokens", "0")
    alone = [json.loads(line) for line in target_alone.stdout.splitlines()]
    assert set(alone[0]) == set(records[0]) and all(r["spec_decoding"] is None for r in alone)


def test_several_prompts_print_the_users_prompt_in_each_header(pair):
    result = _generate(pair, "Tell me a story.", "Name a color.", "--chat")
    headers = [line for line in result.stdout.splitlines() if line.startswith("── ")]
    assert headers == ["── req-0 Tell me a story.", "── req-1 Name a color."]


def test_no_candidates_means_no_draft(pair):
    with_draft = _generate(pair, "Tell me a story.", "--json")
    alone = _generate(pair, "Tell me a story.", "--json", "--num-assistant-tokens", "0")
    said = _generate(pair, "Tell me a story.", "--num-assistant-tokens", "0")
    assert "the draft is not loaded" in said.stderr
    assert "draft:" not in said.stderr and "Loading" in said.stderr and "with draft" not in said.stderr
    # f32: the target alone and with its draft give the same greedy tokens.
    assert json.loads(alone.stdout)["token_ids"] == json.loads(with_draft.stdout)["token_ids"]


def test_sampling_options_reach_every_request(pair):
    sampled = [_generate(pair, "Tell me a story.", "--json", "--temperature", "0.8", "--top-k", "20", "--seed", "7")
               for _ in range(2)]  # fmt: skip
    first, second = (json.loads(result.stdout) for result in sampled)
    assert first["token_ids"] == second["token_ids"]  # the same seed, the same sample


def test_bench_json_prints_the_report_alone_on_stdout(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me a story.\nName a color.\n")
    result = runner.invoke(app, ["bench", str(target), "--draft", str(draft), "--dataset", str(prompts), "--concurrency", "1",
                                 "--max-new-tokens", "8", "--warmup", "0", "--temperature", "0.5", "--seed", "3", "--json",
                                 *F32_ARGS])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert report["status"] == "complete"
    assert report["options"]["sampling"] == {"temperature": 0.5, "top_p": 1.0, "top_k": 0, "seed": 3}
    assert report["options"]["greedy"] is False


# ---- the first-use export is quiet ----------------------------------------------------------------------------


def test_quiet_libraries_drops_other_libraries_output_but_not_dflashs(capsys):
    import logging
    import sys
    import warnings

    from tqdm.auto import tqdm

    from dflash.exporters.staging import quiet_libraries

    ours = sys.stderr  # the CLI's console is bound to stderr before the export starts
    level = logging.getLogger("transformers").level
    with quiet_libraries():
        logging.getLogger("transformers.modeling_utils").warning("`torch_dtype` is deprecated! Use `dtype` instead!")
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
        warnings.warn_explicit("Converting a tensor to a Python boolean", UserWarning, "cache_utils.py", 131, module="transformers.cache_utils")
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors"):
            pass
        print("Applying Weight Compression")
        ours.write("  Compressing weights (int8)\n")
        warnings.warn_explicit("openvino_tokenizer.xml was not written", UserWarning, "target.py", 243, module="dflash.exporters.target")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "  Compressing weights (int8)\n" in captured.err
    assert "openvino_tokenizer.xml was not written" in captured.err
    for noise in ("torch_dtype", "CUDA", "Python boolean", "GGUF", "Weight Compression"):
        assert noise not in captured.err
    assert logging.getLogger("transformers").level == level  # restored


def test_export_with_nncf_keeps_stdout_for_json_and_stderr_for_dflash(tmp_path):
    # `dflash export DRAFT OUT --weight-format int8 --json`: NNCF logs its bit-width table through a
    # handler bound to the real stdout, so the JSON document was preceded by it; and torch's CUDA probe
    # wrote to stderr. A subprocess, since no in-process capture reaches that handler.
    import subprocess
    import sys
    from pathlib import Path

    target_hf = make_tiny_target(tmp_path / "hf-target", "qwen3", seed=3, num_hidden_layers=2)
    draft_hf = make_tiny_draft(tmp_path / "hf-draft", target_hf, kind="dflash", draft_block_size=4, seed=11, num_layers=1)
    program = str(Path(sys.executable).with_name("dflash"))
    done = subprocess.run([program, "export", str(draft_hf), str(tmp_path / "json"), "--weight-format", "int8", "--json"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["draft"] == str(tmp_path / "json")  # the whole of stdout is the document
    assert done.stderr == ""
    done = subprocess.run([program, "export", str(draft_hf), str(tmp_path / "text"), "--weight-format", "int8"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "compressing weights to int8 (NNCF)" in done.stderr
    for noise in ("INFO:nncf", "bitwidth", "CUDA", "Applying Weight Compression"):
        assert noise not in done.stderr, done.stderr


# ---- later runs: the adaptive schedule starts from what earlier runs measured ------------------------------


def test_generate_keeps_the_schedules_measurements_for_the_next_run(pair, tmp_path):
    """The first run writes the adaptive schedule's state into the user cache; the next engine of the
    same pair starts from it (priced from its first step, not exploring) and its output is the same;
    --no-schedule-memory keeps nothing; a damaged file is ignored and replaced."""
    from dflash.core.config import EXACT_OV_CONFIG, EngineConfig
    from dflash.core.engine import LLMEngine

    env = {"DFLASH_CACHE_DIR": str(tmp_path / "cache")}
    memory = tmp_path / "cache" / "schedule"
    off = _generate(pair, "Tell me a story.", "--json", "--no-schedule-memory", env=env)
    assert not memory.exists()
    first = _generate(pair, "Tell me a story.", "--json", env=env)
    (state_file,) = memory.iterdir()
    saved = json.loads(state_file.read_text())
    assert saved["target_costs"] and sum(saved["acceptance"]["drafted"]) > 0
    second = _generate(pair, "Tell me a story.", "--json", env=env)
    assert json.loads(off.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]

    config = EngineConfig(ov_config=EXACT_OV_CONFIG, schedule_memory=str(memory))
    fresh = LLMEngine(pair[0], EngineConfig(ov_config=EXACT_OV_CONFIG), draft_dir=pair[1]).drafter.adaptive
    remembered = LLMEngine(pair[0], config, draft_dir=pair[1]).drafter.adaptive
    kept = json.loads(state_file.read_text())  # after the second run: both runs' steps
    assert len(kept["draft_cost"]["observations"]) > len(saved["draft_cost"]["observations"]) > 0
    assert not fresh.draft_cost.observations and fresh.engine_wide.is_empty
    assert len(remembered.draft_cost.observations) == len(kept["draft_cost"]["observations"])
    assert remembered.engine_wide.estimate(3) == pytest.approx(_estimate(kept["acceptance"]))
    other = LLMEngine(pair[0], EngineConfig(ov_config={**EXACT_OV_CONFIG, "NUM_STREAMS": "1"}, schedule_memory=str(memory)),
                      draft_dir=pair[1]).drafter.adaptive  # fmt: skip
    assert not other.draft_cost.observations  # other properties: other step costs, another file

    state_file.write_text("{not json")
    damaged = LLMEngine(pair[0], config, draft_dir=pair[1])
    assert not damaged.drafter.adaptive.draft_cost.observations  # ignored: starts from nothing
    damaged.generate(["Name a color."], SamplingParams(max_new_tokens=8))
    assert json.loads(state_file.read_text())["version"] == saved["version"]  # replaced when it went idle


def _estimate(acceptance: dict) -> list[float]:
    from dflash.core.adaptive import AcceptanceCounts

    counts = AcceptanceCounts(decay=1.0)
    counts.drafted, counts.reached, counts.accepted = (np.asarray(acceptance[k]) for k in ("drafted", "reached", "accepted"))
    return counts.estimate(3)


def test_a_prompt_too_long_to_be_a_file_name_is_a_prompt():
    """Without TARGET_DIR the first argument is a prompt unless it names a folder; asking the file system
    about a text longer than a file name may be failed with "File name too long" (a HumanEval problem as
    the prompt), which is an answer: no such folder."""
    from dflash.cli.generate import _split_target_and_prompts

    long_prompt = "Write a function that " + "checks the numbers " * 20
    assert _split_target_and_prompts(long_prompt, ["second"]) == (None, [long_prompt, "second"])
