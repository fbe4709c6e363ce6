"""An exclusive lock on a run directory, so two trainings never write into the same ``--out``.

The lock is :class:`filelock.FileLock` (``fcntl.flock`` on ``RUN/.lock``, opened with ``O_NOFOLLOW``
and never truncated by a contender), held for the whole run without waiting: a second writer gets
:class:`~mhmoe.errors.ConfigError` naming ``--out`` and the holder, at once. The kernel releases the
lock when the holding process ends, however it ends (``kill -9`` included), so a lock is never stale
in the sense of blocking forever. What filelock does not keep is who holds it: the holder writes a
record (pid, host, start time) into the locked file, which a refused writer reports and which a
later run, finding the record of a process that died without releasing, reports once as taken over.
A clean release removes the file while still holding the lock (filelock then sees the unlinked
inode and retries, so no two holders ever share the path).

A ``.lock`` that is not a regular file of its own (a run directory prepared by someone else: a
symlink, a hard link to another file, a FIFO, a device, a directory) is refused in one line, never
followed, truncated or written; so is a file system that refuses locks: a run never trains unlocked.
Under torchrun only rank 0 takes the lock (see :func:`mhmoe.train.loop.train`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path
from types import TracebackType

from filelock import FileLock, Timeout

from mhmoe.checkpoint import layout
from mhmoe.errors import ConfigError, UnsafePathError, one_line
from mhmoe.runtime.files import what_it_is

LOCK_FILE = layout.LOCK_FILE  # RUN/.lock
RECORD_BYTES = 4096  # a holder record is ~80 bytes; more is not a record
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
FILELOCK_MAJOR = 4  # FileLock's on_acquired= and fallback_to_soft= arrived in filelock 4.0


def require_filelock(version: str | None = None) -> None:
    """Refuse, in one line, a filelock older than 4.0 (whose FileLock has no ``on_acquired`` hook): an
    environment that installed mhmoe without its dependencies (``--no-deps``) may hold one."""
    import filelock

    found = str(version if version is not None else getattr(filelock, "__version__", "0"))
    major = found.split(".")[0]
    if not major.isdigit() or int(major) < FILELOCK_MAJOR:
        raise ConfigError("filelock", found, f">= {FILELOCK_MAJOR}.0 (the run-directory lock uses its on_acquired "
                          "hook): pip install 'filelock>=4,<5'")


def _parse(data: bytes) -> dict:
    try:
        rec = json.loads(data.decode("utf-8") or "{}")
    except (ValueError, RecursionError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _read_record(path: Path) -> tuple[int | None, dict]:
    """(inode, holder record) of the lock file, read without following a symlink ((None, {}) if none)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None, {}
    try:
        return os.fstat(fd).st_ino, _parse(os.pread(fd, RECORD_BYTES, 0))
    except OSError:
        return None, {}
    finally:
        os.close(fd)


def _describe(rec: dict) -> str:
    if not rec:
        return "another process"
    return f"process {str(rec.get('pid', '?'))[:20]} on {str(rec.get('host', '?'))[:100]}"


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _symlink(path: Path) -> UnsafePathError:
    return UnsafePathError(f"{path}: is a symlink; mhmoe does not write through symlinks inside run directories "
                           "(remove it)")


def check_lock_file(path: Path, st: os.stat_result | None) -> None:
    """``RUN/.lock`` (of stat ``st``; None: missing) is one the lock may create or write: missing, or a
    regular file with one link. A symlink, a hard link to another file, a FIFO, a device or a directory
    raise UnsafePathError naming it (the lock writes its holder's record into the file)."""
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _symlink(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{path}: is {what_it_is(st.st_mode)}, not a regular file; mhmoe locks a run directory "
                              "with a file of its own (remove it)")
    if st.st_nlink > 1:
        raise UnsafePathError(f"{path}: has {st.st_nlink} hard links; mhmoe does not write its lock record into a file "
                              "that is also another file (remove it)")


class RunDirLock:
    """``with RunDirLock(run_dir): ...`` holds the exclusive lock of ``run_dir`` (created if missing, with
    its missing parents; the directories this lock created that are still empty are removed again on
    release, so a run that fails during start-up leaves nothing behind, not even an empty ``runs/``).
    ``enabled=False`` (torchrun ranks > 0) does nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, warn: bool = True) -> None:
        self.run_dir, self.enabled, self.warn = Path(run_dir), enabled, warn
        self.path = self.run_dir / LOCK_FILE
        self.lock: FileLock | None = None
        self.fd: int | None = None
        self.created: list[Path] = []  # directories this lock created, deepest first
        self.taken_over: dict = {}  # the record of a holder that died without releasing (if any)
        self._before: tuple[int | None, dict] = (None, {})

    def __enter__(self) -> RunDirLock:
        if not self.enabled:
            return self
        require_filelock()
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError("--out", str(self.run_dir), "a directory (this path is a file)")
        missing, p = [], self.run_dir
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--out", str(self.run_dir), f"a directory that can be created ({exc.strerror})") from None
        self.created = missing
        try:
            self._acquire()
        except BaseException:
            self._remove_created_dir()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    # ------------------------------------------------------------------------------------------------
    def _acquire(self) -> None:
        check_lock_file(self.path, _lstat(self.path))
        self._before = _read_record(self.path)  # filelock may empty the file before on_acquired sees it
        lock = FileLock(self.path, timeout=0, fallback_to_soft=False, on_acquired=self._write_record)
        try:
            lock.acquire()
        except Timeout:
            raise ConfigError("--out", str(self.run_dir), f"a run directory no other training is writing (locked by "
                              f"{_describe(_read_record(self.path)[1])}; wait for it or choose another --out)"
                              ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # planted between the check and the open
                raise _symlink(self.path) from None
            # e.g. ENOLCK/EOPNOTSUPP/ENOSYS: a file system without locks. Training unlocked would let a second
            # training into the same directory go undetected: refused
            raise UnsafePathError(f"{self.path}: cannot be locked ({exc.strerror or one_line(exc)}); mhmoe trains "
                                  "only into a run directory it can lock (choose an --out on a local file system)"
                                  ) from None
        self.lock = lock
        if self.taken_over and self.warn:
            print(f"mhmoe: note: {self.run_dir} was locked by {_describe(self.taken_over)}, which ended without "
                  "releasing it (killed?); taking the lock over", file=sys.stderr)

    def _write_record(self, fd: int) -> None:
        """filelock's ``on_acquired`` hook (the flock is held): keep the previous holder's record, if this
        is the file it was written into, then write ours. The opened file must be a regular file with one
        link (a hard link planted at ``.lock`` would be truncated and written through): UnsafePathError
        otherwise, before anything is written (filelock then releases the lock)."""
        check_lock_file(self.path, os.fstat(fd))
        ino, before = self._before
        found = _parse(os.pread(fd, RECORD_BYTES, 0))
        self.taken_over = found or (before if ino == os.fstat(fd).st_ino else {})
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self.lock is not None:
            lock, fd, self.lock, self.fd = self.lock, self.fd, None, None
            try:
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        if os.path.samestat(os.lstat(self.path), os.fstat(fd)):
                            self.path.unlink()  # while still holding it: a waiter sees the unlinked inode
            finally:
                lock.release()
        self._remove_created_dir()

    def _remove_created_dir(self) -> None:
        created, self.created = self.created, []
        for d in created:  # deepest first; rmdir removes only an empty directory
            try:
                d.rmdir()  # nothing but the (removed) lock file was written into it
            except OSError:
                break
