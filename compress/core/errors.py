"""Error types and the exit codes they map to.

Exit codes (stable, documented in the README):

* 0 - the run finished and the gate passed
* 1 - the gate failed (a measured or predicted check is over its limit)
* 2 - usage or input error (bad target, recipe, override, model, data, output path, disk write)
* 3 - the gate could not be completed (a check is NOT_MEASURED)
* 4 - a stage failed while running
* 130 / 143 - stopped by SIGINT / SIGTERM (128 + the signal number); the run is marked failed
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_NOT_MEASURED = 3
EXIT_STAGE_ERROR = 4


class CompressError(Exception):
    """Base class for errors reported to the user as one line."""

    exit_code = EXIT_STAGE_ERROR


class UsageError(CompressError):
    """Bad input from the user: configuration, model files, data, output paths."""

    exit_code = EXIT_USAGE


class ProvenanceError(UsageError):
    """What is on disk is not what the run produced, or was built for another machine."""


class StageError(CompressError):
    """A stage could not complete its work."""

    exit_code = EXIT_STAGE_ERROR


class MissingBackendError(CompressError):
    """An optional heavy backend (TensorRT, cuda-python, ...) is not installed."""

    exit_code = EXIT_STAGE_ERROR


class Interrupted(BaseException):
    """The process was asked to stop by a signal (SIGINT, SIGTERM); exits with 128 + the signal number.

    A ``BaseException`` like ``KeyboardInterrupt``, so that no ``except Exception`` swallows it and
    every staging folder is still cleaned up on the way out.
    """

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        word = "interrupted" if signum == signal.SIGINT else "terminated"
        super().__init__(f"{word} ({signal.Signals(signum).name})")


_PENDING_SIGNALS: list[int] = []
_HOLDING: list[int] = []  # while not empty, signals are remembered and raised when the outermost hold ends


_ARRIVALS: list[int] = []  # the read end of the wakeup pipe while :func:`stop_signals_handled` is active


def raise_interrupted(signum: int, _frame: object) -> None:
    """A signal handler that turns SIGINT/SIGTERM into :class:`Interrupted`, and remembers the signal."""
    arrived = _drain_arrivals() or [signum]
    _PENDING_SIGNALS.extend(arrived)
    if not _HOLDING:
        raise Interrupted(arrived[0])


def _drain_arrivals() -> list[int]:
    """The stop signals written to the wakeup pipe since it was last read, in the order they arrived.

    Python runs the handlers of signals pending together in signal-number order (SIGINT before SIGTERM), whatever
    order they came in; the C-level handler writes each one to the wakeup pipe as it comes."""
    if not _ARRIVALS:
        return []
    try:
        data = os.read(_ARRIVALS[0], 512)
    except BlockingIOError:
        return []
    return [number for number in data if number in (signal.SIGINT, signal.SIGTERM)]


@contextlib.contextmanager
def stop_signals_handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (remembered in the order they arrived) until the
    block ends; the previous handlers come back after it."""
    read_end, write_end = os.pipe()
    for fd in (read_end, write_end):
        os.set_blocking(fd, False)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _ARRIVALS[:] = [read_end]
    previous = {sig: signal.signal(sig, raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        _ARRIVALS.clear()
        os.close(read_end)
        os.close(write_end)


def raise_pending_interrupt() -> None:
    """Raise :class:`Interrupted` again for a signal whose exception Python dropped.

    A signal can arrive while Python runs a weakref callback or a ``__del__`` (torch's exporters
    free thread pools that way), where a raised exception is printed and ignored; the run would
    then go on as if nothing happened. The runner calls this at stage boundaries.
    """
    if _PENDING_SIGNALS:
        raise Interrupted(_PENDING_SIGNALS[-1])


def first_interruption() -> Interrupted | None:
    """The first signal that stopped this command (a second one can land while the first unwinds and replace its
    exception; the run stopped for the first)."""
    return Interrupted(_PENDING_SIGNALS[0]) if _PENDING_SIGNALS else None


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors often run to many lines)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def forget_pending_interrupts() -> None:
    """Clear remembered signals (a new command starts, or an :class:`Interrupted` was handled)."""
    _PENDING_SIGNALS.clear()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends (recording a failure must not be cut short by a second signal); one
    that arrived meanwhile is raised when the block ends.

    Held in the handler rather than with a signal mask: any of torch's threads may take a signal, and Python runs the
    handler in the main thread whichever did.
    """
    _HOLDING.append(len(_PENDING_SIGNALS))
    try:
        yield
    finally:
        arrived = len(_PENDING_SIGNALS) > _HOLDING.pop()
    if arrived and not _HOLDING:
        raise Interrupted(_PENDING_SIGNALS[-1])
