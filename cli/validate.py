"""`dflash validate`: check an exported draft, alone or against its target."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ._errors import handled_errors
from ._options import DebugOpt, JsonOpt, QuietOpt
from ._output import Output

EXAMPLES = """\
Examples:

  dflash validate out/draft --target out/target

  dflash validate ./draft-ov --json | jq '.checks[] | select(.passed | not)'
"""


def validate(
    draft_dir: Annotated[Path, typer.Argument(help="An exported draft folder.", show_default=False)],
    target: Annotated[
        Optional[Path],
        typer.Option("--target", help="The exported target the draft will run with.", show_default=False),
    ] = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check an exported draft and say exactly what is wrong and how to fix it.

    Exit code 0 when every check passes, 1 when any fails, 2 when the folder cannot be read.
    """
    output = Output(json_mode=json_output, quiet=quiet)
    with handled_errors(output, debug=debug):
        from dflash.exporters.validate import validate_draft

        report = validate_draft(draft_dir, target)
        if json_output:
            output.json(report.to_json())
        else:
            print_report(report, output)
    if not report.ok:
        raise typer.Exit(1)


def print_report(report, output: Output) -> None:
    """The check / result / how-to-fix table, then one summary line."""
    table = Table(title=f"Draft {report.draft_dir}", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("details / how to fix", overflow="fold")
    for check in report.checks:
        mark = "[green]pass[/green]" if check.passed else "[red]FAIL[/red]"
        text = check.detail if check.passed or not check.fix else f"{check.detail}\n[bold]fix:[/bold] {check.fix}"
        table.add_row(check.name, mark, text)
    output.data(table)
    failed = [c.name for c in report.checks if not c.passed]
    if failed:
        output.error(f"{len(failed)} of {len(report.checks)} checks failed: {', '.join(failed)}")
    else:
        output.success(f"all {len(report.checks)} checks passed")
