"""One output object per command: data to stdout, everything else to stderr.

Modes:
  human  tables and messages for a person; progress shown on a terminal
  json   only machine-readable JSON on stdout; no progress, no colour
  quiet  data only, no progress or informational messages (warnings and errors still go to stderr)
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console


class Output:
    def __init__(self, *, json_mode: bool = False, quiet: bool = False):
        self.json_mode = json_mode
        self.quiet = quiet or json_mode
        self.out = Console(file=sys.stdout, soft_wrap=True, highlight=False)
        # Hints and progress go to stderr so they never pollute parsed stdout.
        self.err = Console(file=sys.stderr, soft_wrap=True, highlight=False)

    # -- data (stdout) -------------------------------------------------------------------------
    def json(self, data: Any) -> None:
        """Print one JSON document on stdout (no markup, no wrapping), whole: a signal waits for it."""
        from dflash.exporters import interrupts

        text = json.dumps(data, indent=2, default=str) + "\n"
        with interrupts.deferred():
            sys.stdout.write(text)
            sys.stdout.flush()

    def data(self, renderable: Any) -> None:
        """A human-readable result (a table, a line) on stdout."""
        if not self.json_mode:
            self.out.print(renderable)

    # -- diagnostics (stderr) ------------------------------------------------------------------
    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message)

    def success(self, message: str) -> None:
        if not self.quiet:
            self.err.print(f"[green]✓[/green] {message}")

    def warning(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {message}")

    def error(self, message: str) -> None:
        self.err.print(f"[bold red]error:[/bold red] {message}")

    def hint(self, message: str) -> None:
        self.err.print(f"[dim]hint:[/dim] {message}")

    @contextmanager
    def status(self, message: str) -> Iterator["StepReporter"]:
        """A spinner with a changing description on a terminal; plain step lines otherwise."""
        reporter = StepReporter(self)
        if self.quiet:
            yield reporter
            return
        if self.err.is_terminal:
            with self.err.status(message) as status:
                reporter._status = status
                yield reporter
        else:
            self.err.print(message)
            yield reporter


class StepReporter:
    """Passed to library code as its `on_step` callback."""

    def __init__(self, output: Output):
        self._output = output
        self._status = None

    def __call__(self, description: str) -> None:
        if self._output.quiet:
            return
        if self._status is not None:
            self._status.update(description)
            self._output.err.print(f"[dim]·[/dim] {description}")
        else:
            self._output.err.print(f"  {description}")
