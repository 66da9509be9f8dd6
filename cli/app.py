"""The `dflash` program: wires the commands, nothing else."""

from __future__ import annotations

import inspect
import sys
from typing import Annotated, Optional

import click
import typer
from typer.core import TyperCommand

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
    rich_markup_mode=None,  # plain click help: wraps whole option names and defaults at any width
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


class _Command(TyperCommand):
    """A command whose arguments show their help once: click 8.5's Parameter sets `help` to None after
    typer has set it, so it is read back from the function's annotations here; typer lists the
    arguments with the options, so click 8.5's own section of them is left out."""

    def format_arguments(self, ctx, formatter) -> None:
        pass

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from typer.models import ArgumentInfo
        from typer.utils import get_params_from_function

        declared = get_params_from_function(inspect.unwrap(self.callback))
        for param in self.params:
            info = getattr(declared.get(param.name), "default", None)
            if isinstance(param, click.Argument) and not getattr(param, "help", None) and isinstance(info, ArgumentInfo):
                param.help = info.help


for name, module, function in (
    ("export", export_cmd, export_cmd.export),
    ("validate", validate_cmd, validate_cmd.validate),
    ("generate", generate_cmd, generate_cmd.generate),
    ("train", train_cmd, train_cmd.train),
    ("bench", bench_cmd, bench_cmd.bench),
    ("eval-draft", eval_draft_cmd, eval_draft_cmd.eval_draft),
):
    app.command(name, cls=_Command, epilog=module.EXAMPLES)(function)


def main() -> None:
    """Console-script entry point: SIGTERM is handled like Ctrl-C (exporters/interrupts.py)."""
    from dflash.exporters import interrupts

    interrupts.install()
    try:
        app()
    except KeyboardInterrupt:  # outside a command's own handling (while typer parses, say)
        sys.stderr.write("error: interrupted\n")
        sys.exit(interrupts.exit_code())
