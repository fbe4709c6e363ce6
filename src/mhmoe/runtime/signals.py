"""Ctrl-C (SIGINT) and SIGTERM as requests to stop at a safe point, instead of exceptions raised in the
middle of whatever the program was doing.

:class:`StopRequests` is a context manager whose handlers only record the first signal; the training
loop reads :attr:`StopRequests.signum` at step boundaries, so an optimizer step is atomic with
respect to signals (the weights, the optimizer and scheduler states and the step counter always move
together). A second signal of either kind aborts at once (:class:`Interrupted` raised from the
handler), for a user who does not want to wait for the checkpoint. :func:`raise_on_sigterm` makes
SIGTERM raise :class:`Interrupted` like Ctrl-C raises :class:`KeyboardInterrupt` (the CLI installs it
for a whole command, so a SIGTERM during start-up ends with one line instead of a silent kill).

Handlers can only be installed from the main thread; elsewhere both are no-ops. A signal that was
ignored when the context was entered (``SIG_IGN``, e.g. SIGINT of a ``nohup``/``&`` background job)
stays ignored.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by signal ``signum``; ``exit_code`` is the shell convention ``128 + signum``
    (130 for SIGINT, 143 for SIGTERM). A :class:`KeyboardInterrupt`, so code that handles Ctrl-C
    handles SIGTERM the same way."""

    def __init__(self, signum: int, message: str = "") -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(message or f"interrupted ({signal_name(signum)})")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _can_install() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install(handler: Any, signals: tuple[signal.Signals, ...]) -> dict[signal.Signals, Any]:
    """Install ``handler`` for every signal in ``signals`` not currently ignored; return the previous
    handlers of those it replaced."""
    previous = {}
    for sig in signals:
        old = signal.getsignal(sig)
        if old is signal.SIG_IGN or old is None:  # ignored (or set from C): leave it alone
            continue
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore(previous: dict[signal.Signals, Any]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)


class StopRequests:
    """Record SIGINT / SIGTERM instead of acting on them (see the module docstring).

    ``with StopRequests(enabled) as stop: ... if stop.signum is not None: <stop cleanly>``. Disabled
    (or off the main thread) it installs nothing and ``signum`` stays None.
    """

    def __init__(self, enabled: bool = True, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.enabled, self.signals = enabled, signals
        self.signum: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def active(self) -> bool:
        """True while the handlers are installed (signals are being deferred)."""
        return bool(self._previous)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second signal: stop waiting
            _restore(self._previous)
            self._previous = {}
            raise Interrupted(signum, f"interrupted again ({signal_name(signum)}): stopped without saving")
        self.signum = signum

    def __enter__(self) -> StopRequests:
        if self.enabled and _can_install():
            self._previous = _install(self._handler, self.signals)
        return self

    def __exit__(self, *exc: object) -> None:
        _restore(self._previous)
        self._previous = {}


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Interrupted` (exit code 143) instead of killing the
    process silently; the previous handler is restored afterwards."""
    previous = _install(_raise_interrupted, (signal.SIGTERM,)) if _can_install() else {}
    try:
        yield
    finally:
        _restore(previous)


@contextmanager
def file_size_limit_as_error() -> Iterator[None]:
    """Within the block, exceeding the file-size limit (``ulimit -f``, RLIMIT_FSIZE) makes the write fail
    with EFBIG instead of killing the process with SIGXFSZ, so a checkpoint save reports it in one line
    (:class:`mhmoe.errors.NoSpaceError`) and the previous checkpoint stays the newest."""
    sig = getattr(signal, "SIGXFSZ", None)
    if sig is None or not _can_install():
        yield
        return
    previous = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, previous)
