"""Errors are reported once, at the top: one line, a hint, and a documented exit code.

Exit codes (also in the README):
  0  ok
  1  the thing checked or run failed
  2  usage or unreadable input
  130 interrupted (SIGINT, Ctrl-C)
  143 terminated (SIGTERM)

OpenVINO reports failures as a RuntimeError whose first lines are C++ source locations; the reason is
further down. `describe_openvino_error` finds it and names the cause and the fix (docs/reliability.md
lists every case with its message and exit code).
"""

from __future__ import annotations

import os
import re
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
        from dflash.exporters.interrupts import exit_code, interrupted_by

        signum = getattr(exc, "signum", None) or interrupted_by()
        output.error("terminated (SIGTERM)" if signum == 15 else "interrupted")
        return exit_code() if signum is None else 128 + signum
    described = describe_os_or_openvino_error(exc)
    if described is not None:
        message, hint, code = described
        output.error(message)
        output.hint(hint)
        return code
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


# OpenVINO's reasons (the last meaningful line of its message) -> (message, hint, exit code).
_OV_PATTERNS: list[tuple[re.Pattern, object]] = []


def _ov_pattern(regex: str):
    def register(fn):
        _OV_PATTERNS.append((re.compile(regex), fn))
        return fn

    return register


@_ov_pattern(r"Unsupported property (\S+) by (\S+) plugin")
def _unknown_property(match, reason):
    key, device = match.group(1), match.group(2)
    return (
        f"OpenVINO's {device} plugin has no property {key} (from --ov-config)",
        f"the valid keys are listed by `python -c \"import openvino as ov; print(ov.Core().get_property('{device}', "
        "'SUPPORTED_PROPERTIES'))\"`; check the spelling",
        EXIT_USAGE,
    )


@_ov_pattern(r"Wrong value (.*) for property key (\S+?)\.")
def _bad_property_value(match, reason):
    return (f"--ov-config: {reason}", "pass one of the supported values", EXIT_USAGE)


@_ov_pattern(r'Device with "([^"]*)" name is not registered')
def _unknown_device(match, reason):
    return (
        f"no OpenVINO device {match.group(1)}",
        f"available devices: {', '.join(_available_devices()) or 'none'} (pass one with --device)",
        EXIT_USAGE,
    )


@_ov_pattern(r"std::bad_alloc|Failed to allocate|allocator\.cpp")
def _out_of_memory(match, reason):
    return (
        "not enough memory for the KV cache and the model",
        "lower --kv-cache-size (and --draft-kv-cache-size), or --max-num-seqs",
        EXIT_USAGE,
    )


@_ov_pattern(r"Incorrect weights in bin file|Error parsing|pugi|Empty weights data|Could not open the file|"
             r"Unable to read|weights file")  # fmt: skip
def _corrupt_ir(match, reason):
    return (
        f"an OpenVINO model file is damaged or incomplete ({reason})",
        "re-export the model (dflash export), or run `dflash validate` on the draft to see which file",
        EXIT_USAGE,
    )


@_ov_pattern(r"iostream error|No space left")
def _write_failed(match, reason):
    return ("a write failed: no space left on the device, or the folder is not writable", "free some space or choose another folder", EXIT_FAILED)


def _available_devices() -> list[str]:
    try:
        import openvino as ov

        return list(ov.Core().available_devices)
    except Exception:  # noqa: BLE001 - only a hint
        return []


def openvino_reason(exc: BaseException) -> str:
    """The line of an OpenVINO message that says why: not a source location, not a failed check's text."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [
        line
        for line in lines
        if not line.startswith("Exception from ") and not re.match(r"Check '.*' failed at ", line)
        and not line.startswith("FrontEnd API failed")
    ]  # fmt: skip
    return (useful or lines or [type(exc).__name__])[-1]


def describe_os_or_openvino_error(exc: BaseException) -> tuple[str, str, int] | None:
    """(message, hint, exit code) for a failure OpenVINO or the OS reports cryptically; None otherwise."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {exc.filename}" if exc.filename else ""
        return (f"no space left on the device{where}", "free some space or choose another folder", EXIT_FAILED)
    if isinstance(exc, MemoryError):
        return _out_of_memory(None, "")
    if type(exc) is not RuntimeError or "Exception from src/" not in str(exc) and "bad_alloc" not in str(exc):
        return None
    reason = openvino_reason(exc)
    for pattern, describe in _OV_PATTERNS:
        match = pattern.search(reason) or pattern.search(str(exc))
        if match:
            return describe(match, reason)
    return (f"OpenVINO: {reason}", f"run with --debug (or {DEBUG_ENV}=1) for the full traceback", EXIT_FAILED)


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
