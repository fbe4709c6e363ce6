"""Opening files mhmoe did not write for what they are, and reading them within limits decided before
a byte is read.

A path in a run or checkpoint directory, a ``--config`` or a data file may be anything: a FIFO (an
``open`` for reading blocks until someone writes), ``/dev/zero`` or a link to it (endless), a
directory, a symlink to another user file, a gzip of a few MB that inflates to gigabytes. Every reader
of such files goes through here:

* :func:`open_regular`: ``open(O_RDONLY | O_NONBLOCK [| O_NOFOLLOW])``, then ``fstat`` of the opened
  file: anything but a regular file is refused in one line naming it and saying what it is. The
  ``O_NONBLOCK`` open returns at once for a FIFO, so nothing ever blocks before the check;
  ``follow=False`` (files inside run and checkpoint directories) refuses a symlink too.
* :func:`read_bytes` / :func:`read_text` / :func:`read_json`: the size comes from ``fstat`` of the opened
  file and is checked against the limit before reading; at most ``limit + 1`` bytes are ever read (a file
  that grows meanwhile is refused too).
* :func:`iter_lines`: a ``.jsonl`` log streamed line by line, each line at most ``max_line`` bytes, so
  memory stays bounded whatever the file's size.
* :func:`read_gzip`: a ``.gz`` file decompressed in a stream that stops at
  ``max(GZIP_MIN_BYTES, GZIP_RATIO x its size)`` (text compresses 3-5x; a bomb 1000x).

Errors are :class:`~mhmoe.runtime.bounded.BoundedLoadError` (a ``ValueError``: exit status 2 in the
CLI) naming the file; a missing or unreadable file raises the ``OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from mhmoe.runtime.bounded import MAX_JSON_CHARS, BoundedLoadError, check_torch_archive, load_json
from mhmoe.runtime.files import what_it_is

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
MAX_LINE_BYTES = 1 << 20  # one line of a .jsonl log (mhmoe's are ~1 KB)
GZIP_RATIO = 32  # decompressed bytes per compressed byte a .gz data file may hold (text: 3-5)
GZIP_MIN_BYTES = 16 << 20  # ... and at least this many, whatever its size


def not_regular(path: str | os.PathLike[str], mode: int) -> BoundedLoadError:
    """The one-line refusal of ``path`` (of ``st_mode`` ``mode``) where a regular file is needed."""
    return BoundedLoadError(f"{path}: is {what_it_is(mode)}, not a regular file")


def symlink_refused(path: str | os.PathLike[str]) -> BoundedLoadError:
    return BoundedLoadError(f"{path}: is a symlink; mhmoe does not read or write through symlinks inside run and "
                            "checkpoint directories (remove it)")


def open_regular(path: str | os.PathLike[str], follow: bool = True) -> int:
    """A read-only file descriptor of ``path`` (close it), which :func:`os.fstat` showed to be a regular
    file; BoundedLoadError naming it otherwise (``follow=False``: a symlink too). Never blocks (a FIFO
    is opened with ``O_NONBLOCK`` and refused)."""
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):  # a symlink (O_NOFOLLOW), a socket
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode if not follow else os.stat(path).st_mode
                raise (symlink_refused(path) if stat.S_ISLNK(mode) else not_regular(path, mode)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike[str], limit: int, follow: bool = True, what: str = "file") -> bytes:
    """The bytes of the regular file ``path`` if it holds at most ``limit`` of them (its size from
    ``fstat``, checked before reading); BoundedLoadError naming it otherwise."""
    fd = open_regular(path, follow)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise BoundedLoadError(f"{path}: {size:,} bytes, more than the {limit:,} allowed for a {what}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BoundedLoadError(f"{path}: more than the {limit:,} bytes allowed for a {what} (it grew while read)")
    return data


def read_text(path: str | os.PathLike[str], limit: int, follow: bool = True, what: str = "file") -> str:
    """:func:`read_bytes` decoded as UTF-8; BoundedLoadError naming the file for other bytes."""
    data = read_bytes(path, limit, follow, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BoundedLoadError(f"{path}: not UTF-8 text (byte 0x{data[exc.start:exc.start + 1].hex()} at offset "
                               f"{exc.start})") from None


def read_json(path: str | os.PathLike[str], limit: int = MAX_JSON_CHARS, follow: bool = True,
              what: str = "JSON file") -> Any:
    """The JSON value of the regular file ``path`` of at most ``limit`` bytes (:func:`read_text`, then
    :func:`mhmoe.runtime.bounded.load_json`); BoundedLoadError naming it otherwise."""
    return load_json(read_text(path, limit, follow, what), str(path), limit)


def iter_lines(path: str | os.PathLike[str], follow: bool = True, max_line: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of the regular file ``path`` (without their newline), streamed: memory is bounded by
    ``max_line`` whatever the file's size; a longer line raises BoundedLoadError naming the file and
    the line number."""
    fd = open_regular(path, follow)
    with os.fdopen(fd, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(max_line + 1), b""), 1):
            if len(line) > max_line and not line.endswith(b"\n"):
                raise BoundedLoadError(f"{path}:{number}: a line of more than {max_line:,} bytes (not a log line "
                                       "mhmoe writes)")
            yield line.rstrip(b"\n")


def gzip_limit(compressed: int) -> int:
    """Bytes a ``.gz`` file of ``compressed`` bytes may decompress to."""
    return max(GZIP_MIN_BYTES, GZIP_RATIO * compressed)


def read_gzip(path: str | os.PathLike[str], follow: bool = True) -> bytes:
    """The decompressed bytes of the regular ``.gz`` file ``path``, decompressed in a stream that stops
    at :func:`gzip_limit` of its size (BoundedLoadError naming it beyond); damaged data raises the
    ``OSError`` / ``EOFError`` of :mod:`gzip`."""
    fd = open_regular(path, follow)
    with os.fdopen(fd, "rb") as raw:
        limit = gzip_limit(os.fstat(fd).st_size)
        with gzip.GzipFile(fileobj=io.BufferedReader(raw)) as z:
            data = z.read(limit + 1)  # bounded: decompresses at most this much
    if len(data) > limit:
        raise BoundedLoadError(f"{path}: decompresses to more than {limit:,} bytes ({GZIP_RATIO}x its size; a gzip "
                               "bomb? decompress it yourself if it is real text)")
    return data


def regular_or_missing(path: str | os.PathLike[str], follow: bool = False) -> bool:
    """Whether ``path`` exists (False if not); BoundedLoadError if it is not a regular file (``follow``
    False: a symlink too). For a path about to be read or replaced in a run directory."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise symlink_refused(path)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    return True


def open_checked_torch_archive(path: str | os.PathLike[str], where: str | None = None) -> BinaryIO:
    """``path`` (a regular file: a FIFO or a device is refused, never read) opened for ``torch.load``
    after :func:`mhmoe.runtime.bounded.check_torch_archive` (the caller closes it)."""
    f = os.fdopen(open_regular(path), "rb")
    try:
        check_torch_archive(f, where or str(path))
    except BaseException:
        f.close()
        raise
    return f


__all__ = ["GZIP_MIN_BYTES", "GZIP_RATIO", "MAX_LINE_BYTES", "gzip_limit", "iter_lines", "not_regular",
           "open_checked_torch_archive", "open_regular", "read_bytes", "read_gzip", "read_json", "read_text",
           "regular_or_missing", "symlink_refused", "what_it_is"]

