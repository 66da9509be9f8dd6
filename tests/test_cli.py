"""The command line: help, version, exit codes, error reporting and completions (no models)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash.cli.app import app

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ["export", "validate", "generate", "bench", "train"]

runner = CliRunner()


def test_root_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output
    assert "Exit codes" in result.output


def test_short_help_flag():
    assert runner.invoke(app, ["-h"]).exit_code == 0


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_has_an_example(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert f"dflash {command}" in result.output


def test_version():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"dflash {version('dflash')}"


def test_unknown_option_is_a_usage_error():
    assert runner.invoke(app, ["export", "--no-such-option"]).exit_code == 2


def test_bad_weight_format_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "o"), "--weight-format", "int3"])
    assert result.exit_code == 2


def test_validate_missing_folder_exits_2_with_one_line(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "error:" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_export_folder_without_config_exits_2(tmp_path):
    result = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "config.json" in result.stderr
    assert "hint:" in result.stderr


def test_export_unreachable_hub_id_exits_2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(app, ["export", "no-such-org/no-such-model", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "no-such-org/no-such-model" in result.stderr


def test_malformed_ov_config_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["generate", str(tmp_path), "hi", "--ov-config", "NO_EQUALS_SIGN"])
    assert result.exit_code == 2
    assert "KEY=VALUE" in result.output


def test_debug_shows_the_traceback(tmp_path):
    result = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "out"), "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


def test_json_mode_keeps_stdout_clean_on_error(tmp_path):
    result = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "out"), "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""


def test_help_does_not_import_heavy_libraries():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from dflash.cli.app import app\n"
        "CliRunner().invoke(app, ['--help'])\n"
        "heavy = [m for m in ('openvino', 'torch', 'optimum', 'transformers', 'nncf') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_completion_scripts_are_current():
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_completions.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_completion_offers_commands_and_choices():
    program = Path(sys.executable).with_name("dflash")
    env = {"_DFLASH_COMPLETE": "complete_bash", "COMP_WORDS": "dflash export --weight-format ", "COMP_CWORD": "3"}
    done = subprocess.run([str(program)], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["fp32", "fp16", "int8", "int4"]
    env.update(COMP_WORDS="dflash va", COMP_CWORD="1")
    done = subprocess.run([str(program)], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["validate"]


def test_draft_options_are_checked_as_usage_errors(tmp_path):
    """--draft-proposals takes argmax/sampled (bench: a comma-separated sweep of them); --draft-vocab-size >= 0."""
    assert runner.invoke(app, ["generate", str(tmp_path), "hi", "--draft-proposals", "greedy"]).exit_code == 2
    result = runner.invoke(app, ["bench", str(tmp_path), "--draft-proposals", "argmax,nope"])
    assert result.exit_code == 2 and "nope" in result.output + result.stderr
    assert runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "o"), "--draft-vocab-size", "-1"]).exit_code == 2


def test_the_sweep_and_engine_options_carry_the_draft_proposals():
    from types import SimpleNamespace

    from dflash.cli._options import engine_config
    from dflash.cli.bench import _parse_sweep

    config = engine_config(device="CPU", ov_config=None, kv_cache_size=0.1, draft_kv_cache_size=None,
                           max_num_batched_tokens=64, max_num_seqs=2, draft_proposals="sampled")  # fmt: skip
    assert config.draft_proposals == "sampled"
    sweep = _parse_sweep(SimpleNamespace(concurrency="1", num_assistant_tokens="auto", markov_top_k="auto",
                                         num_assistant_tokens_schedule="adaptive", draft_proposals="argmax,sampled"))  # fmt: skip
    assert sweep.proposals == ["argmax", "sampled"]
