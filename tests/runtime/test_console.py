"""Warnings as one line, once, on rank 0 (what the mhmoe command runs in)."""

from __future__ import annotations

import io
import warnings

from mhmoe.runtime.console import one_line_warnings, warn_line


def _emit(n: int = 3) -> None:
    for _ in range(n):
        warnings.warn("something odd happened\nsecond line of detail", UserWarning, stacklevel=1)
    warnings.warn("another thing", RuntimeWarning, stacklevel=1)


def test_each_warning_once_as_one_line_on_rank0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    with one_line_warnings(file=out) as shown:
        _emit()
        _emit()  # from another line: still once
    assert out.getvalue().splitlines() == ["mhmoe: warning: something odd happened", "mhmoe: warning: another thing"]
    assert shown == {"something odd happened", "another thing"}


def test_other_ranks_print_nothing(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    out = io.StringIO()
    with one_line_warnings(file=out):
        _emit()
    warn_line("not on rank 1", file=out)
    assert out.getvalue() == ""


def test_the_warning_machinery_is_restored():
    before = warnings.showwarning
    with one_line_warnings(file=io.StringIO()):
        assert warnings.showwarning is not before
    assert warnings.showwarning is before


def test_filters_that_ignore_still_ignore(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="something odd")
        with one_line_warnings(file=out):
            _emit(1)
    assert out.getvalue().splitlines() == ["mhmoe: warning: another thing"]
