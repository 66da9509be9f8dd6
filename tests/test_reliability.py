"""Issue 15: nothing lost, nothing misleading.

Signals (SIGINT, SIGTERM) sent to the real `dflash` program at points it announces (a result line, a
stage line), never after a sleep; exports interrupted, refused and run onto a full filesystem; every
cryptic OpenVINO/OS failure mapped to one line with its exit code. `CASES` is the table of
docs/reliability.md: `test_docs_table_matches_the_cases` fails when the two disagree.

The signal and export tests run `dflash` as a subprocess. The one-line error cases run the same CLI
in-process (typer's CliRunner) to share the loaded libraries: each subprocess costs seconds of imports
on a small CI machine, and the code path from argument to exit code is the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash.cli.app import app
from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.exporters.staging import MARKER
from dflash.exporters.target import export_target
from dflash.exporters.tiny import make_tiny_target

REPO = Path(__file__).resolve().parent.parent
DFLASH = str(Path(sys.executable).with_name("dflash"))
DOC = REPO / "docs" / "reliability.md"
runner = CliRunner()


@dataclass(frozen=True)
class Case:
    key: str
    fault: str  # the input or fault, as the docs table shows it
    exit_code: int
    message: str  # a piece of the one error line (a regular expression)


CASES = [
    Case("sigterm_generate", "SIGTERM during `generate --json`", 143, "terminated \\(SIGTERM\\)"),
    Case("sigint_generate", "SIGINT (Ctrl-C) during `generate --json`, twice", 130, "interrupted"),
    Case("sigterm_bench", "SIGTERM during `bench --json-file FILE`", 143, "terminated \\(SIGTERM\\); the finished settings are in"),
    Case("sigint_export_convert", "SIGINT during the draft's conversion", 130, "interrupted"),
    Case("sigterm_export_save", "SIGTERM while the draft is saved", 143, "terminated \\(SIGTERM\\)"),
    Case("sigterm_target_export", "SIGTERM during a target re-export", 143, "terminated \\(SIGTERM\\)"),
    Case("disk_full", "re-export onto a full filesystem", 1, "no space left on the device of"),
    Case("foreign_output_dir", "draft export into a folder holding a target (no --overwrite)", 2,
         "is not empty: it holds a dflash target export, not a previous draft export"),
    Case("source_is_output", "export into the checkpoint's own folder", 2, "is the source model folder"),
    Case("shard_outside", "a shard index naming `../` files", 2, "which is outside the checkpoint folder"),
    Case("missing_target_path", "`generate /tmp/nope \"hi\"` (a path that does not exist)", 2, "TARGET_DIR .* does not exist"),
    Case("truncated_xml", "truncated openvino_model.xml", 2, "openvino_model.xml \\(or its .bin\\) is damaged or incomplete"),
    Case("truncated_bin", "truncated openvino_model.bin", 2, "the target is not a complete export: .*openvino_model.bin is truncated"),
    Case("unknown_property", "`--ov-config NO_SUCH_KEY=1`", 2, "OpenVINO's CPU plugin has no property NO_SUCH_KEY"),
    Case("bad_property_value", "`--ov-config INFERENCE_PRECISION_HINT=f99`", 2, "Wrong value f99 for property key INFERENCE_PRECISION_HINT"),
    Case("unknown_device", "`--device NPU9`", 2, "no OpenVINO device NPU9"),
    Case("kv_cache_too_big", "`--kv-cache-size 100000` (GiB)", 2, "not enough memory for the KV cache and the model"),
    Case("no_tokenizer", "a target folder without tokenizer files", 2, "has no tokenizer files"),
    Case("bad_draft", "`--draft` that fails a `validate` check", 2, "fails the check"),
    Case("json_output_unwritable", "`bench --json-file` into a folder that cannot be created", 2, "cannot create .* for --json-file"),
    Case("huge_prompt", "a prompt longer than the model's context allows, in characters", 2, "characters, more than the model's"),
    Case("failed_request_json", "`generate --json` with a request that fails (prompt too long for the model)", 1,
         "req-0: .*max_model_len"),
    Case("missing_export_source", "`export /tmp/nope OUT` (a path that does not exist)", 2, "no folder /tmp/nope"),
    Case("validate_staging", "`validate` on an export's staging folder", 1, "staging folder of an export that did not finish"),
]
CASE = {case.key: case for case in CASES}


def assert_case(key: str, code: int, stderr: str) -> None:
    """The documented exit code and one error line (no traceback) with the documented message."""
    case = CASE[key]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == case.exit_code, stderr
    assert "Traceback" not in stderr, stderr
    assert len(errors) == 1, stderr
    assert re.search(case.message, errors[0]), errors[0]


# ---- fixtures: one tiny pair for the whole module --------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    target_hf = make_tiny_target(root / "hf-target", "qwen3", seed=3, num_hidden_layers=2)
    draft_hf = make_tiny_draft(root / "hf-draft", target_hf, kind="dflash", draft_block_size=4, seed=11, num_layers=1)
    target = export_target(target_hf, root / "ov-target", weight_format="fp32")
    draft = export_draft(draft_hf, root / "ov-draft", weight_format="fp32")
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"Story {i}: the quick brown fox {'w ' * (i % 5)}\n" for i in range(120)))
    return {"target_hf": target_hf, "draft_hf": draft_hf, "target": target, "draft": draft, "prompts": prompts}


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _siblings(folder: Path) -> list[str]:
    """What an export left beside its output folder (staging or old folders)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


# ---- signals: generate and bench ----------------------------------------------------------------------


def _generate_until(models, tmp_path, lines_before: int, signals: list[int]):
    """`generate --json` over many prompts; after `lines_before` result lines, send `signals`; read
    stdout to the end (line by line: nothing buffered is lost to the test)."""
    stderr_file = tmp_path / "stderr.txt"
    args = [DFLASH, "generate", str(models["target"]), "--draft", str(models["draft"]), "--prompts-file",
            str(models["prompts"]), "--max-new-tokens", "48", "--max-num-seqs", "4", "--ignore-eos", "--json"]  # fmt: skip
    with open(stderr_file, "w") as stderr:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True)
        lines = [proc.stdout.readline() for _ in range(lines_before)]
        for signum in signals:
            proc.send_signal(signum)
        lines += list(proc.stdout)
        code = proc.wait()
    return code, [json.loads(line) for line in lines], stderr_file.read_text()


@pytest.mark.parametrize(
    ("key", "lines_before", "signals"),
    [("sigterm_generate", 1, [signal.SIGTERM]), ("sigint_generate", 5, [signal.SIGINT, signal.SIGINT])],
)
def test_signal_during_generate_keeps_every_finished_result(models, tmp_path, key, lines_before, signals):
    code, records, stderr = _generate_until(models, tmp_path, lines_before, signals)

    assert_case(key, code, stderr)
    results = records  # every line is a request's: one shape, no status line
    assert all(set(r) == set(records[0]) for r in records)
    finished = [r for r in results if r["finish_reason"] == "length"]
    aborted = [r for r in results if r["finish_reason"] == "abort"]
    # Every line parses (above), the lines read before the signal are finished results, every request
    # has exactly one line, and stderr says the run was interrupted (assert_case) and how far it got.
    assert all(r["finish_reason"] == "length" for r in records[:lines_before])
    assert len(finished) >= lines_before
    assert sorted(r["id"] for r in results) == sorted(f"req-{i}" for i in range(120))
    assert len(finished) + len(aborted) == 120 and aborted
    assert all(r["num_generated_tokens"] == 48 for r in finished)
    assert f"{len(finished)} of 120 requests finished before the interrupt" in stderr


def test_sigterm_during_bench_writes_the_finished_settings(models, tmp_path):
    json_file = tmp_path / "out" / "bench.json"
    args = [DFLASH, "bench", str(models["target"]), "--draft", str(models["draft"]), "--dataset", str(models["prompts"]),
            "--num-prompts", "6", "--max-new-tokens", "16", "--concurrency", "1,2", "--warmup", "0", "--json-file", str(json_file)]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # progress lines on stderr (not a terminal): one per finished setting
        seen.append(line)
        if line.startswith("baseline c=1:"):
            proc.send_signal(signal.SIGTERM)
            break
    seen += list(proc.stderr)
    code = proc.wait()

    assert_case("sigterm_bench", code, "".join(seen))
    report = json.loads(json_file.read_text())
    assert report["status"] == "interrupted"
    names = [s["name"] for s in report["settings"]]
    assert names[0] == "baseline c=1" and len(names) < 4  # the finished settings, not the whole sweep
    assert [p.name for p in json_file.parent.iterdir()] == ["bench.json"]  # no temporary file left


# ---- exports: interrupted, refused, onto a full filesystem ------------------------------------------------


def _export_until(args: list[str], marker: str, signum: int):
    """Run `dflash export ...`; when a stderr line contains `marker`, send `signum`."""
    proc = subprocess.Popen([DFLASH, "export", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    sent = False
    for line in proc.stderr:
        seen.append(line)
        if marker in line and not sent:
            proc.send_signal(signum)
            sent = True
    code = proc.wait()
    assert sent, "".join(seen)
    return code, "".join(seen)


@pytest.mark.parametrize(
    ("key", "marker", "signum", "previous"),
    [
        ("sigint_export_convert", "converting the draft to OpenVINO", signal.SIGINT, False),
        ("sigterm_export_save", "saving ", signal.SIGTERM, True),
    ],
)
def test_interrupted_draft_export_leaves_nothing_or_the_previous_model(models, tmp_path, key, marker, signum, previous):
    out = tmp_path / "draft"
    if previous:
        shutil.copytree(models["draft"], out)
    before = _tree(out) if previous else None

    code, stderr = _export_until([str(models["draft_hf"]), str(out), "--weight-format", "fp32"], marker, signum)

    assert_case(key, code, stderr)
    assert "Fatal Python error" not in stderr and "error_already_set" not in stderr
    assert _siblings(out) == []
    if previous:
        assert _tree(out) == before
        done = runner.invoke(app, ["validate", str(out), "--target", str(models["target"]), "--json"])
        assert done.exit_code == 0, done.stdout
    else:
        assert not out.exists()


def test_interrupted_target_reexport_keeps_the_previous_target(models, tmp_path):
    out = tmp_path / "target"
    shutil.copytree(models["target"], out)
    before = _tree(out)

    code, stderr = _export_until([str(models["target_hf"]), str(out), "--weight-format", "fp32"], "Converting to OpenVINO", signal.SIGTERM)

    assert_case("sigterm_target_export", code, stderr)
    assert _tree(out) == before
    assert _siblings(out) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 400 KiB tmpfs: room for one tiny draft export (about 300 KiB), not for a second beside it."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


def test_reexport_onto_a_full_filesystem_keeps_the_previous_draft(models, small_tmpfs):
    out = small_tmpfs / "draft"
    shutil.copytree(models["draft"], out)
    before = _tree(out)

    done = runner.invoke(app, ["export", str(models["draft_hf"]), str(out), "--weight-format", "fp32"])

    assert_case("disk_full", done.exit_code, done.stderr)
    assert "was left as it was" in done.stderr
    assert _tree(out) == before
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["draft"]


def test_draft_export_refuses_a_folder_holding_a_target(models, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(models["target"], out)
    before = _tree(out)

    done = runner.invoke(app, ["export", str(models["draft_hf"]), str(out)])

    assert_case("foreign_output_dir", done.exit_code, done.stderr)
    assert "--overwrite" in done.stderr
    assert _tree(out) == before and _siblings(out) == []


def test_overwrite_replaces_a_foreign_folder_and_reexport_replaces_an_export(models, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    first = runner.invoke(app, ["export", str(models["draft_hf"]), str(out), "--weight-format", "fp32"])
    assert first.exit_code == 2 and "notes.txt" in first.stderr

    second = runner.invoke(app, ["export", str(models["draft_hf"]), str(out), "--weight-format", "fp32", "--overwrite"])
    assert second.exit_code == 0, second.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MARKER, "openvino_model.bin", "openvino_model.xml"]
    # A previous draft export is replaced without --overwrite; nothing is left beside it.
    third = runner.invoke(app, ["export", str(models["draft_hf"]), str(out), "--weight-format", "fp32"])
    assert third.exit_code == 0, third.stderr
    assert _siblings(out) == []
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_into_the_checkpoints_own_folder_is_refused(models, tmp_path):
    checkpoint = shutil.copytree(models["draft_hf"], tmp_path / "ckpt")
    before = _tree(checkpoint)
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, ["export", str(checkpoint), str(checkpoint), *extra])
        assert_case("source_is_output", result.exit_code, result.stderr)
    assert _tree(checkpoint) == before


def test_shard_index_may_not_leave_the_checkpoint_folder(models, tmp_path):
    outside = shutil.copytree(models["draft_hf"], tmp_path / "outside")
    checkpoint = tmp_path / "ckpt" / "draft"
    checkpoint.mkdir(parents=True)
    shutil.copy(outside / "config.json", checkpoint / "config.json")
    index = {"weight_map": {"fc.weight": "../../outside/model.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))

    result = runner.invoke(app, ["export", str(checkpoint), str(tmp_path / "out")])

    assert_case("shard_outside", result.exit_code, result.stderr)


# ---- one line per OpenVINO / OS failure ----------------------------------------------------------------------


def _broken_target(models, tmp_path, key: str) -> Path:
    folder = shutil.copytree(models["target"], tmp_path / key)
    if key == "truncated_xml":
        xml = folder / "openvino_model.xml"
        xml.write_bytes(xml.read_bytes()[: xml.stat().st_size // 2])
    elif key == "truncated_bin":
        weights = folder / "openvino_model.bin"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif key == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (folder / name).unlink(missing_ok=True)
    return folder


@pytest.mark.parametrize(
    ("key", "extra"),
    [
        ("unknown_property", ["--ov-config", "NO_SUCH_KEY=1"]),
        ("bad_property_value", ["--ov-config", "INFERENCE_PRECISION_HINT=f99"]),
        ("unknown_device", ["--device", "NPU9"]),
        ("kv_cache_too_big", ["--kv-cache-size", "100000"]),
        ("truncated_xml", []),
        ("truncated_bin", []),
        ("no_tokenizer", []),
    ],
)
def test_openvino_failures_are_one_line_with_the_cause(models, tmp_path, key, extra):
    target = _broken_target(models, tmp_path, key) if key in ("truncated_xml", "truncated_bin", "no_tokenizer") else models["target"]

    result = runner.invoke(app, ["generate", str(target), "hi", "--max-new-tokens", "2", *extra])

    assert_case(key, result.exit_code, result.stderr)
    assert "hint:" in result.stderr and "core.cpp" not in result.stderr
    if key == "unknown_device":
        assert "available devices: CPU" in result.stderr
    if key == "unknown_property":
        assert "SUPPORTED_PROPERTIES" in result.stderr


def test_a_missing_path_is_never_a_prompt(tmp_path):
    result = runner.invoke(app, ["generate", str(tmp_path / "nope"), "hi"])
    assert_case("missing_target_path", result.exit_code, result.stderr)


def test_generate_runs_the_draft_checks_before_loading(models, tmp_path):
    draft = shutil.copytree(models["draft"], tmp_path / "draft")
    xml = draft / "openvino_model.xml"
    xml.write_text(xml.read_text().replace('<mask_token_id value="', '<mask_token_id value="9999'))

    result = runner.invoke(app, ["generate", str(models["target"]), "--draft", str(draft), "hi"])

    assert_case("bad_draft", result.exit_code, result.stderr)
    assert "mask_token_id" in result.stderr and f"dflash validate {draft}" in result.stderr


def test_bench_checks_its_output_paths_before_running(models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, ["bench", str(models["target"]), "--draft", str(models["draft"]), "--dataset",
                                 str(models["prompts"]), "--json-file", str(blocker / "sub" / "bench.json")])  # fmt: skip
    assert_case("json_output_unwritable", result.exit_code, result.stderr)


def test_prompts_are_capped_by_characters_before_tokenization(models, tmp_path):
    config = json.loads((models["target"] / "config.json").read_text())
    prompts = tmp_path / "huge.txt"
    prompts.write_text("a" * (config["max_position_embeddings"] * 64 + 1) + "\n")

    result = runner.invoke(app, ["generate", str(models["target"]), "--prompts-file", str(prompts)])

    assert_case("huge_prompt", result.exit_code, result.stderr)


def test_a_failed_request_with_json_is_said_on_stderr(models, tmp_path):
    prompts = tmp_path / "long.txt"
    prompts.write_text("w " * 3000 + "\n")  # fewer characters than the cap, more tokens than the model holds

    result = runner.invoke(app, ["generate", str(models["target"]), "--prompts-file", str(prompts), "--json", "--max-new-tokens", "2"])

    assert_case("failed_request_json", result.exit_code, result.stderr)
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["finish_reason"] == "error"


def test_a_missing_export_source_is_not_looked_up_on_the_hub(tmp_path):
    result = runner.invoke(app, ["export", "/tmp/nope", str(tmp_path / "out")])
    assert_case("missing_export_source", result.exit_code, result.stderr)
    assert not (tmp_path / "out").exists()


def test_a_half_written_folder_never_passes_validate(models, tmp_path):
    staging = shutil.copytree(models["draft"], tmp_path / ".draft.partial-abc123")
    result = runner.invoke(app, ["validate", str(staging), "--json"])
    assert result.exit_code == CASE["validate_staging"].exit_code
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert re.search(CASE["validate_staging"].message, checks["ir_reads"]["detail"])
    assert not any(c["passed"] for c in checks.values())

    truncated = shutil.copytree(models["draft"], tmp_path / "draft")
    weights = truncated / "openvino_model.bin"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = runner.invoke(app, ["validate", str(truncated), "--json"])
    assert result.exit_code == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert not checks["ir_reads"]["passed"] and "truncated" in checks["ir_reads"]["detail"]


# ---- the docs table -----------------------------------------------------------------------------------


def test_docs_table_matches_the_cases():
    """docs/reliability.md has one row per case: `key` | fault | exit code | message."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells
    assert sorted(rows) == sorted(CASE), "docs/reliability.md and CASES list different cases"
    for key, cells in rows.items():
        case = CASE[key]
        assert cells[2] == str(case.exit_code), key
        shown = cells[3].replace("`", "")
        position = 0
        for fragment in case.message.split(".*"):  # the literal parts of the pattern, in order
            literal = fragment.replace("\\", "")
            found = shown.find(literal, position)
            assert found >= 0, (key, shown, literal)
            position = found + len(literal)


@pytest.mark.parametrize("keep", [False, True])
def test_openvino_telemetry_is_off_unless_asked_for(keep):
    """Importing dflash declines OpenVINO's telemetry consent before openvino is imported (its forked
    sender hung an interrupted export); DFLASH_OPENVINO_TELEMETRY=1 leaves OpenVINO's own choice."""
    code = ("import dflash.exporters, openvino, openvino_telemetry\n"
            "from openvino_telemetry.utils.opt_in_checker import OptInChecker\n"
            "print(OptInChecker.check.__module__ == 'dflash.core.telemetry', openvino_telemetry.Telemetry().consent)")  # fmt: skip
    env = {**os.environ, "DFLASH_OPENVINO_TELEMETRY": "1" if keep else "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    patched, consent = done.stdout.split()
    assert patched == str(not keep)
    if not keep:
        assert consent == "False"


# ---- loading: one thread in OpenVINO's bindings at a time -------------------------------------------------


def test_loading_prepares_graphs_under_the_bindings_lock_and_compiles_outside_it(models, monkeypatch):
    # The engine prepares the draft on another thread while it prepares the target. Two threads in
    # OpenVINO's Python bindings at once deadlocked a `dflash generate` (both in `_fold_constant`, each
    # waiting for what the other held: the GIL, a C++ static being initialized); it hung until killed.
    # The race is rare, so the test checks the rule that prevents it: every graph transformation and
    # cache allocation runs holding BINDINGS_LOCK, and the compilations (most of the time) do not.
    from dflash.core import draft_runner, loading, model_runner
    from dflash.core.config import EngineConfig

    held: dict[str, list[bool]] = {"transform": [], "allocate": [], "compile": []}

    def recording(name, function):
        def wrapper(*args, **kwargs):
            held[name].append(model_runner.BINDINGS_LOCK.locked())
            return function(*args, **kwargs)
        return wrapper

    for module in (model_runner, draft_runner):
        monkeypatch.setattr(module, "to_paged_attention", recording("transform", module.to_paged_attention))
    monkeypatch.setattr(model_runner, "allocate_kv_caches", recording("allocate", model_runner.allocate_kv_caches))
    monkeypatch.setattr(model_runner, "compile_properties", recording("compile", model_runner.compile_properties))
    pipelines = loading.load_pipelines(models["target"], models["draft"], EngineConfig())
    assert pipelines.drafter.runner is not None
    assert held["transform"] == [True, True] and held["allocate"] == [True, True]
    assert held["compile"] == [False, False]
