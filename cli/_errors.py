"""Errors are reported once, at the top: one line, a hint, and a documented exit code.

Exit codes (also in the README):
  0  ok
  1  the thing checked or run failed
  2  usage or unreadable input
  130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from typing import Iterator

from dflash.core.errors import EXIT_FAILED, EXIT_USAGE, DflashError

from ._output import Output

DEBUG_ENV = "DFLASH_DEBUG"
EXIT_INTERRUPTED = 130


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "False")


def report_exception(exc: BaseException, output: Output, *, debug: bool) -> int:
    """Print `exc` for a person and return the exit code to use."""
    if debug:
        output.err.print(traceback.format_exc(), markup=False, highlight=False)
    if isinstance(exc, KeyboardInterrupt):
        output.error("interrupted")
        return EXIT_INTERRUPTED
    if isinstance(exc, DflashError):
        output.error(exc.message)
        if exc.hint:
            output.hint(exc.hint)
        code = exc.exit_code
    elif isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        output.error(str(exc))
        code = EXIT_USAGE
    else:
        # An unexpected failure inside a library we call: still one line, the traceback on request.
        output.error(f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__)
        code = EXIT_FAILED
        if not debug:
            output.hint(f"run with --debug (or {DEBUG_ENV}=1) for the full traceback")
    return code


@contextmanager
def handled_errors(output: Output, *, debug: bool) -> Iterator[None]:
    """Run a command body; turn any failure into its message and exit code (typer.Exit)."""
    import typer

    try:
        yield
    except (typer.Exit, typer.BadParameter):
        raise  # typer reports a bad option value itself, as a usage error (exit 2)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - this is the one place that reports
        raise typer.Exit(report_exception(exc, output, debug=debug_enabled(debug))) from None
