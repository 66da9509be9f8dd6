"""The `dflash` program: wires the commands, nothing else."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from . import bench as bench_cmd
from . import eval_draft as eval_draft_cmd
from . import export as export_cmd
from . import generate as generate_cmd
from . import train as train_cmd
from . import validate as validate_cmd

app = typer.Typer(
    name="dflash",
    help=(
        "DFlash and DSpark speculative decoding on OpenVINO.\n\n"
        "Exit codes: 0 ok, 1 the thing checked or run failed, 2 usage or unreadable input, "
        "130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM)."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"dflash {version('dflash')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version and exit."),
    ] = None,
) -> None:
    """DFlash and DSpark speculative decoding on OpenVINO."""


app.command("export", epilog=export_cmd.EXAMPLES)(export_cmd.export)
app.command("validate", epilog=validate_cmd.EXAMPLES)(validate_cmd.validate)
app.command("generate", epilog=generate_cmd.EXAMPLES)(generate_cmd.generate)
app.command("train", epilog=train_cmd.EXAMPLES)(train_cmd.train)
app.command("bench", epilog=bench_cmd.EXAMPLES)(bench_cmd.bench)
app.command("eval-draft", epilog=eval_draft_cmd.EXAMPLES)(eval_draft_cmd.eval_draft)


def main() -> None:
    """Console-script entry point: SIGTERM is handled like Ctrl-C (exporters/interrupts.py)."""
    from dflash.exporters import interrupts

    interrupts.install()
    try:
        app()
    except KeyboardInterrupt:  # outside a command's own handling (while typer parses, say)
        sys.stderr.write("error: interrupted\n")
        sys.exit(interrupts.exit_code())
