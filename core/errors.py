"""Errors the library raises for the CLI to report as one line plus a hint.

Every error carries the exit code the CLI uses for it:
  0  ok
  1  the thing checked or run failed (a failed export, a draft that does not validate)
  2  usage or unreadable input (a missing folder, a malformed config or prompts file)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class DflashError(Exception):
    """A known failure: `message` says what is wrong, `hint` what to do about it."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class InputError(DflashError):
    """Unreadable or malformed input: a missing folder, a bad config.json, a bad option value."""

    exit_code = EXIT_USAGE


class ModelFormatError(InputError):
    """A model folder that is readable but is not what the command expects (wrong role or layout)."""


class ExportError(DflashError):
    """A conversion step failed on a model that looked valid."""


