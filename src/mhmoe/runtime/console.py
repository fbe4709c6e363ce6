"""Messages for the ``mhmoe`` command: warnings as one line, once, on rank 0.

Python prints a :class:`UserWarning` with its file, line number and source line, every time its
filter lets it through, in every process; under ``torchrun`` that is one copy per rank.
:func:`one_line_warnings` is the context the command runs in: each distinct warning message is
printed once as ``mhmoe: warning: <first line of the message>`` on stderr, and only by rank 0
(``RANK`` unset or ``0``). Library code keeps using :func:`warnings.warn`; nothing changes outside
the context, so importing mhmoe never alters the warning machinery of a program.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

from mhmoe.errors import one_line

PREFIX = "mhmoe: warning: "


def is_rank0() -> bool:
    """True unless torchrun's ``RANK`` names another rank."""
    return os.environ.get("RANK", "0") in ("", "0")


def warn_line(message: str, file: TextIO | None = None) -> None:
    """Print ``mhmoe: warning: MESSAGE`` (first line only) on stderr, on rank 0 only."""
    if is_rank0():
        print(PREFIX + one_line(message), file=file or sys.stderr)


@contextlib.contextmanager
def one_line_warnings(file: TextIO | None = None) -> Iterator[set[str]]:
    """Within the context, show each distinct warning once, as one line, on rank 0 (other ranks: never).

    Yields the set of messages shown so far (for tests). Filters and ``showwarning`` are restored on exit.
    """
    shown: set[str] = set()
    out = file

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:  # warnings.showwarning's signature
        text = one_line(message)
        if text in shown:
            return
        shown.add(text)
        if is_rank0():
            print(f"{PREFIX}{text}", file=out or sys.stderr)  # the context's file, not the caller's

    with warnings.catch_warnings():  # the filters stay as they are (a library's "ignore" still ignores)
        warnings.showwarning = show
        yield shown
