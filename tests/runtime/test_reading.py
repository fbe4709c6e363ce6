"""Reading files for what they are, within limits decided before a byte is read
(``mhmoe.runtime.reading``): a FIFO never blocks, ``/dev/zero`` is never read, a directory or a symlink
(inside run directories) is refused in one line naming it, sizes come from ``fstat`` of the opened file,
``.jsonl`` logs stream in bounded memory and a gzip bomb stops at a small multiple of its size."""

from __future__ import annotations

import gzip
import os

import pytest
from bombs import gzip_bomb, run_limited

from mhmoe.runtime.bounded import BoundedLoadError
from mhmoe.runtime.reading import (
    GZIP_MIN_BYTES,
    iter_lines,
    open_regular,
    read_bytes,
    read_gzip,
    read_text,
    regular_or_missing,
)


def _one_line(exc: pytest.ExceptionInfo, path, what: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and what in msg, msg


def test_special_files_are_refused_before_anything_is_read(tmp_path):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)  # no writer: a plain open for reading would block forever
    for path, what in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (tmp_path, "a directory")):
        for reader in (lambda p: read_bytes(p, 1 << 20), lambda p: list(iter_lines(p)), read_gzip,
                       lambda p: os.close(open_regular(p))):
            with pytest.raises(BoundedLoadError) as info:
                reader(path)
            _one_line(info, path, f"is {what}")
    link = tmp_path / "config.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(BoundedLoadError) as info:  # followed: what it points to is checked
        read_bytes(link, 100)
    _one_line(info, link, "a character device")
    with pytest.raises(BoundedLoadError) as info:  # inside a run directory: not followed
        read_bytes(link, 100, follow=False)
    _one_line(info, link, "is a symlink")
    with pytest.raises(BoundedLoadError, match="is a symlink"):
        regular_or_missing(link)
    with pytest.raises(BoundedLoadError, match="is a FIFO"):
        regular_or_missing(fifo)
    assert regular_or_missing(tmp_path / "missing") is False
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "missing", 10)


def test_sizes_come_from_fstat_and_are_checked_before_reading(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_bytes(b"x" * 101)
    assert read_bytes(f, 101) == b"x" * 101
    with pytest.raises(BoundedLoadError) as info:
        read_bytes(f, 100, what="run config")
    _one_line(info, f, "101 bytes, more than the 100 allowed for a run config")
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(BoundedLoadError, match="not UTF-8 text"):
        read_text(f, 100)


def test_jsonl_lines_stream_in_bounded_memory(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3')  # a torn last line, as after a crash
    assert list(iter_lines(log)) == [b'{"step": 1}', b'{"step": 2}', b'{"step": 3']
    log.write_bytes(b'{"step": 1}\n' + b"x" * 100 + b"\n")
    with pytest.raises(BoundedLoadError) as info:
        list(iter_lines(log, max_line=99))
    _one_line(info, f"{log}:2", "a line of more than 99 bytes")
    assert list(iter_lines(log, max_line=100))[1] == b"x" * 100


def test_a_gzip_bomb_stops_at_a_multiple_of_its_size(tmp_path):
    """64 MB of text in 65 KB: refused after at most GZIP_MIN_BYTES (16 MiB) of output, within a few
    hundred MB of memory (unbounded: gzip.decompress held 64 MB, a 4 MB file 4 GiB)."""
    bomb = tmp_path / "corpus.txt.gz"
    bomb.write_bytes(gzip_bomb(64 << 20))
    code = ("from mhmoe.runtime.reading import read_gzip\nfrom mhmoe.runtime.bounded import BoundedLoadError\n"
            f"try:\n    read_gzip({str(bomb)!r})\nexcept BoundedLoadError as e:\n    print(e)\n")
    out = run_limited(code, memory=1 << 30, cpu_s=30)
    assert out.status == 0, out.stderr[-2000:]
    assert str(bomb) in out.stdout and "decompresses to more than" in out.stdout, out.stdout
    assert out.max_rss_mb < 200, out.max_rss_mb
    real = tmp_path / "real.txt.gz"
    real.write_bytes(gzip.compress(b"In the beginning\n" * 1000))
    assert read_gzip(real) == b"In the beginning\n" * 1000
    assert GZIP_MIN_BYTES >= 1 << 20
