"""SIGINT and SIGTERM as one exception, raised only where it is safe.

A Python signal handler runs between bytecodes of the main thread. When that bytecode is a Python
callback called from C++ (PyTorch tracing inside `openvino.convert_model`, NNCF, optimum-intel), the
exception it raises crosses a C++ frame: pybind11 aborts the process (SIGABRT) or the converter turns it
into an unrelated error. And a handler that raises in the middle of writing a result line leaves half a
line. So:

- `install()` (the CLI calls it first) makes SIGTERM behave like Ctrl-C: both raise `Interrupted`, a
  KeyboardInterrupt that remembers its signal (exit code 128 + signal: 130 for SIGINT, 143 for SIGTERM).
  Everything that already handles Ctrl-C (partial results, staging folders removed) handles SIGTERM too.
- `deferred()` is a block where a signal is only recorded; it is raised when the block ends (a safe
  point). Conversions, saves, publishing a folder and writing one result line run inside one.
- After the first signal raised, further signals are recorded, not raised, so the clean-up that writes
  what finished is not cut short (a second Ctrl-C still leaves valid output). A third one exits at once
  (`os._exit`), for a clean-up that hangs.

Signals can only be handled in the main thread; elsewhere `deferred()` does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM; `exit_code` is 128 + the signal number (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    depth = 0  # nested deferred() blocks
    pending: int | None = None  # a signal recorded inside a deferred block, or after the first one
    raised: int | None = None  # the signal that was raised (the process is stopping)
    count = 0  # signals received since the first one was raised
    installed = False  # by install(): our handler is the process's for good


_state = _State()


def _on_signal(signum: int, frame) -> None:  # noqa: ARG001 - the signal module's signature
    if _state.raised is not None:
        _state.count += 1
        if _state.count >= 2:  # a third signal: the clean-up hangs, leave now
            os.write(2, b"error: interrupted again; exiting without clean-up\n")
            os._exit(128 + _state.raised)
        os.write(2, b"note: already stopping; writing what finished (signal again to exit at once)\n")
        return
    if _state.depth > 0:
        if _state.pending is None:
            os.write(2, b"note: stopping at the next safe point\n")
        _state.pending = _state.pending or signum
        return
    _state.raised = signum
    raise Interrupted(signum)


def install() -> None:
    """Handle SIGINT and SIGTERM with `Interrupted` for the rest of the process (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    _state.installed = True


def interrupted_by() -> int | None:
    """The signal that stopped the process, if one did."""
    return _state.raised


def exit_code(default: int = 130) -> int:
    """128 + the signal that stopped the process (130 without one: a KeyboardInterrupt from elsewhere)."""
    return 128 + _state.raised if _state.raised is not None else default


@contextmanager
def deferred() -> Iterator[None]:
    """Run a block that a signal must not cut; a signal received in it is raised when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = None
    if not _state.installed and _state.depth == 0:
        # Used as a library: borrow the handlers for the block, give them back after.
        previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
        for signum in SIGNALS:
            signal.signal(signum, _on_signal)
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if previous is not None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if _state.depth == 0 and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            if _state.raised is None:
                if _state.installed:
                    _state.raised = signum
                    raise Interrupted(signum)
                # Library use: deliver the signal to the handler the caller had (default: the usual
                # KeyboardInterrupt for SIGINT, termination for SIGTERM).
                if previous is not None and previous.get(signum) is signal.default_int_handler:
                    raise Interrupted(signum)
                signal.raise_signal(signum)
