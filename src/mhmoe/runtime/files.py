"""Writing files and directories: atomically, durably, and never through a symlink.

Every file mhmoe writes into a run, export or cache directory is written here, by one of

* :func:`atomic_write` -- a whole file: a fresh temporary file in the same directory (created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``), written, flushed and fsync'd, renamed onto the name with
  ``os.replace`` (which replaces a symlink found there and never writes through it), then the
  directory is fsync'd;
* :func:`open_append` -- a log line appended to ``metrics.jsonl`` / ``eval.jsonl`` (``O_APPEND |
  O_NOFOLLOW``: a symlink in its place is refused);
* :func:`staging_dir` + :func:`publish_dir` -- a whole directory (checkpoints, exports, saved models):
  written into a fresh hidden sibling (``mkdir`` never reuses an existing name), its files and itself
  fsync'd, renamed into place, the parent fsync'd.

Directories are opened one component at a time below a ``root`` the caller names (the run, export or
cache directory: the user's own path, which may itself be a symlink) with ``O_NOFOLLOW``, and the
files are created relative to the opened directory, so a symlink planted anywhere below the root
(``RUN/checkpoints -> /elsewhere``) is refused with :class:`~mhmoe.errors.UnsafePathError` naming it,
in one line. The threat is a directory prepared in advance (downloaded, shared); a process racing
mhmoe under the same account could do anything that account can anyway.

Durability: ``fsync`` of the files and of the directory entry before and after the rename, so a
published file or directory survives a power cut, not only a killed process. ``MHMOE_FSYNC=0`` skips
the fsyncs (faster on slow network file systems; a power cut may then lose the newest writes, and a
checkpoint may be published before its bytes are on disk). Running out of space raises
:class:`~mhmoe.errors.NoSpaceError` (see :func:`no_space_errno`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from mhmoe.errors import NoSpaceError, UnsafePathError

FSYNC_ENV = "MHMOE_FSYNC"
STAGING_PREFIX = ".tmp-"  # a hidden sibling being written: .tmp-NAME-TAG (staging_path)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_NO_SPACE = frozenset({errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)})
_OS_ERROR_CODE = re.compile(r"os error (\d+)")  # how Rust libraries (safetensors) print an io::Error


def durable_default() -> bool:
    """Whether writes are fsync'd: yes unless ``MHMOE_FSYNC=0``."""
    return os.environ.get(FSYNC_ENV, "1").strip() not in ("0", "false", "no", "off")


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in chunks (memory independent of the file's size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- running out of space ---------------------------------------------------------------------------
def no_space_errno(exc: BaseException | None) -> int | None:
    """ENOSPC / EFBIG / EDQUOT when ``exc`` (or an exception it was raised from or during) says the disk,
    the file-size limit or the quota ran out; None otherwise. Libraries that hide the OSError (torch's
    archive writer raises RuntimeError from it; safetensors prints ``os error 28``) are recognised too."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return exc.errno
        match = _OS_ERROR_CODE.search(str(exc)[:2000])
        if match and int(match.group(1)) in _NO_SPACE:
            return int(match.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def no_space_error(exc: BaseException, message: str) -> NoSpaceError | None:
    """A :class:`NoSpaceError` ``"<strerror> <message>"`` if ``exc`` is running out of space, else None."""
    code = no_space_errno(exc)
    if code is None:
        return None
    return NoSpaceError(code, f"{os.strerror(code)} {message}")


# ---- directories ----------------------------------------------------------------------------------------
def _refuse(path: Path) -> UnsafePathError:
    return UnsafePathError(f"{path}: is a symlink; mhmoe does not write through symlinks inside run, export "
                           "and cache directories (remove it, or choose another directory)")


def open_dir(directory: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
             create: bool = False) -> int:
    """A file descriptor of ``directory`` (close it). Every component below ``root`` (default: the
    directory itself) is opened with ``O_NOFOLLOW``: a symlink raises UnsafePathError naming it, a file
    NotADirectoryError. ``create``: missing components are created (``root`` too)."""
    directory = Path(directory)
    base = Path(root) if root is not None else directory
    parts = directory.relative_to(base).parts
    if create:
        base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, _DIR_FLAGS)
    where = base
    try:
        for part in parts:
            where = where / part
            while True:
                try:
                    nfd = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
                    break
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o777, dir_fd=fd)
                        if durable_default():  # the new entry (RUN/checkpoints) survives a power cut too
                            fsync_dir(fd)
                except OSError as exc:
                    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                        mode = os.lstat(part, dir_fd=fd).st_mode
                        if stat.S_ISLNK(mode):
                            raise _refuse(where) from None
                        raise UnsafePathError(f"{where}: is {what_it_is(mode)}, not a directory; mhmoe writes into it "
                                              "(remove it, or choose another directory)") from None
                    raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(directory: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """``mkdir -p directory``, refusing a symlink at or below ``root`` (see :func:`open_dir`)."""
    os.close(open_dir(directory, root, create=True))
    return Path(directory)


def fsync_dir(fd_or_path: int | str | os.PathLike[str]) -> None:
    """fsync a directory (its entries: names created, renamed or removed in it)."""
    fd = fd_or_path if isinstance(fd_or_path, int) else os.open(fd_or_path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory: nothing more to do there
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        if not isinstance(fd_or_path, int):
            os.close(fd)


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """fsync every file and directory below ``directory`` (a fresh staging directory), then itself."""
    for dirpath, _, filenames in os.walk(directory, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


# ---- files ---------------------------------------------------------------------------------------------
Writer = Callable[[BinaryIO], object]


def atomic_write(path: str | os.PathLike[str], data: bytes | str | Writer, root: str | os.PathLike[str] | None = None,
                 durable: bool | None = None, mode: int = 0o644) -> Path:
    """Replace ``path`` atomically with ``data`` (bytes, UTF-8 text, or a function that writes into the
    binary file it is given): readers see the old file or the new one, never a part. The temporary file
    is created in the same directory without following a symlink, fsync'd (``durable``, default
    :func:`durable_default`), renamed onto ``path`` (a symlink there is replaced, not followed), and the
    directory fsync'd. The directory is created if missing; symlinks below ``root`` are refused."""
    path = Path(path)
    durable = durable_default() if durable is None else durable
    dfd = open_dir(path.parent, root if root is not None else path.parent, create=True)
    tmp = None
    try:
        check_target(dfd, path.name, path)
        for _ in range(100):
            tmp = f".{path.name[:100]}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover -- 100 collisions of 32 random bits
            raise FileExistsError(errno.EEXIST, "no free temporary name", str(path.parent))
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = None
        if durable:
            fsync_dir(dfd)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
        err = no_space_error(exc, f"while writing {path}")
        if err is not None:
            raise err from None
        raise
    finally:
        os.close(dfd)
    return path


def open_append(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> BinaryIO:
    """``path`` opened for appending (created if missing) without following a symlink: a symlink in its
    place, or below ``root``, raises UnsafePathError naming it; so does anything but a regular file
    with one link (a FIFO, a device, a directory, a hard link to a file elsewhere), checked with
    ``fstat`` of the opened file before a byte is written (the open never blocks: ``O_NONBLOCK``)."""
    path = Path(path)
    dfd = open_dir(path.parent, root if root is not None else path.parent, create=True)
    try:
        fd = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _NONBLOCK, 0o644,
                     dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):  # a directory; a FIFO without reader, a socket
            raise _not_writable(path, os.lstat(path.name, dir_fd=dfd)) from None
        raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise _not_writable(path, st)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")


def what_it_is(mode: int) -> str:
    """``"a directory"``, ``"a FIFO"``, ... for an ``st_mode``."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _not_writable(path: Path, st: os.stat_result) -> UnsafePathError:
    """The one-line refusal of a write target that is not a regular file of its own (``st``: its stat)."""
    if stat.S_ISREG(st.st_mode):
        return UnsafePathError(f"{path}: has {st.st_nlink} hard links; mhmoe does not write into a file that is also "
                               "another file (remove it)")
    return UnsafePathError(f"{path}: is {what_it_is(st.st_mode)}, not a regular file; mhmoe writes only regular files "
                           "inside run, export and cache directories (remove it)")


def check_target(dfd: int, name: str, path: Path) -> None:
    """A file about to be replaced by rename in the directory ``dfd``: missing, a regular file (hard
    links included: the rename replaces the name, never the other file) or a symlink (replaced, not
    followed); anything else (a directory, a FIFO, a device) raises UnsafePathError naming ``path``."""
    try:
        st = os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise _not_writable(path, st)


# ---- directories written whole -----------------------------------------------------------------------------
def staging_path(final: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The hidden sibling ``.tmp-NAME-TAG`` of ``final`` that :func:`new_staging_dir` creates (``tag``
    default: this process's id)."""
    final = Path(final)
    return final.parent / f"{STAGING_PREFIX}{final.name}-{tag if tag is not None else os.getpid()}"


def new_staging_dir(final: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
                    tag: str | None = None) -> Path:
    """A fresh, empty hidden sibling of ``final`` (``.tmp-NAME-TAG``; created here, so nothing can be
    planted in it); a stale one of the same name (a killed writer's) is removed first. Symlinks below
    ``root`` are refused."""
    final = Path(final)
    parent_fd = open_dir(final.parent, root if root is not None else final.parent, create=True)
    try:
        tmp = staging_path(final, tag)
        remove_tree(tmp)
        os.mkdir(tmp.name, 0o755, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    return tmp


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree, a file or a symlink at ``path`` (never what a symlink points to; shutil's
    rmtree walks by file descriptors)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def publish_dir(tmp: str | os.PathLike[str], final: str | os.PathLike[str], replace: bool = False,
                durable: bool | None = None) -> Path:
    """Rename the finished staging directory ``tmp`` to its sibling ``final``. With ``durable``: every
    file and directory of ``tmp`` is fsync'd before the rename and the parent after it, so ``final``
    exists only complete, also after a power cut. An existing ``final``: an empty directory is
    replaced; otherwise ``replace=True`` moves it aside first and removes it after the rename, and
    ``replace=False`` raises FileExistsError. A symlink at ``final`` is refused (UnsafePathError)."""
    tmp, final = Path(tmp), Path(final)
    durable = durable_default() if durable is None else durable
    if durable:
        fsync_tree(tmp)
    fd = os.open(final.parent, _DIR_FLAGS)
    try:
        old = None
        try:
            st = os.lstat(final.name, dir_fd=fd)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _refuse(final)
        if st is not None and replace:
            old = f".old-{final.name}-{os.getpid()}"
            remove_tree(final.parent / old)
            os.rename(final.name, old, src_dir_fd=fd, dst_dir_fd=fd)
        try:
            os.rename(tmp.name, final.name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(exc.errno, "exists and is not an empty directory", str(final)) from None
            raise
        if durable:
            fsync_dir(fd)
        if old is not None:
            remove_tree(final.parent / old)
    finally:
        os.close(fd)
    return final


@contextlib.contextmanager
def staging_dir(final: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
                tag: str | None = None) -> Iterator[Path]:
    """``with staging_dir(final) as tmp:`` write into ``tmp``, then :func:`publish_dir` it; ``tmp`` is
    removed when the block raises (or does not publish)."""
    tmp = new_staging_dir(final, root, tag)
    try:
        yield tmp
    finally:
        remove_tree(tmp)
