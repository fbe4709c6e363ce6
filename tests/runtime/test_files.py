"""The one writer of files and directories (:mod:`mhmoe.runtime.files`): never through a symlink,
atomic, fsync'd before and after the rename that publishes, and running out of space as one error.

Each test plants what a run, export or cache directory prepared by someone else could hold (a symlink
to a file of the user's in place of a file mhmoe writes, a symlinked directory below the root) and
checks that the file the link points to is untouched."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from mhmoe.errors import NoSpaceError, UnsafePathError
from mhmoe.runtime import files
from mhmoe.runtime.files import (
    atomic_write,
    durable_default,
    make_dirs,
    no_space_errno,
    open_append,
    publish_dir,
    sha256_file,
    staging_dir,
)

SECRET = "the user's own file\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    p = tmp_path / "victim.txt"
    p.write_text(SECRET)
    return p


def test_atomic_write_replaces_a_planted_symlink_and_never_writes_through_it(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").symlink_to(victim)
    atomic_write(run / "results.json", '{"step": 3}', root=run)
    assert victim.read_text() == SECRET
    assert not (run / "results.json").is_symlink() and (run / "results.json").read_text() == '{"step": 3}'
    assert sorted(p.name for p in run.iterdir()) == ["results.json"]  # no temporary left


def test_a_symlinked_directory_below_the_root_is_refused_in_one_line(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path)  # RUN/checkpoints -> somewhere else
    for write in (lambda: atomic_write(run / "checkpoints" / "victim.txt", "x", root=run),
                  lambda: make_dirs(run / "checkpoints" / "step_1", root=run),
                  lambda: open_append(run / "checkpoints" / "victim.txt", root=run)):
        with pytest.raises(UnsafePathError, match="checkpoints: is a symlink") as info:
            write()
        assert "\n" not in str(info.value)
    assert victim.read_text() == SECRET and not (tmp_path / "step_1").exists()


def test_the_root_itself_may_be_a_symlink(tmp_path):
    """The user's own --out may be a link (runs -> /scratch/runs); only what lies below it is checked."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    atomic_write(tmp_path / "link" / "sub" / "a.txt", "ok", root=tmp_path / "link")
    assert (real / "sub" / "a.txt").read_text() == "ok"


def test_open_append_refuses_a_symlink(tmp_path, victim):
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="metrics.jsonl: is a symlink"):
        open_append(tmp_path / "metrics.jsonl")
    assert victim.read_text() == SECRET
    with open_append(tmp_path / "new.jsonl") as f:
        f.write(b"{}\n")
    with open_append(tmp_path / "new.jsonl") as f:
        f.write(b"{}\n")
    assert (tmp_path / "new.jsonl").read_text() == "{}\n{}\n"


def test_publish_dir_refuses_a_symlink_at_the_target_and_keeps_the_staging_directory_private(tmp_path, victim):
    out = tmp_path / "export"
    out.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(UnsafePathError, match="export: is a symlink"):
        with staging_dir(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"weights")
            publish_dir(tmp, out)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "export", "victim.txt"]  # staging removed


def test_staging_dir_replaces_a_planted_staging_name(tmp_path, victim):
    """A ``.tmp-NAME-TAG`` planted as a symlink is removed (the link, not its target), never written into."""
    (tmp_path / ".tmp-out-7").symlink_to(tmp_path)
    with staging_dir(tmp_path / "out", tag="7") as tmp:
        assert tmp.is_dir() and not tmp.is_symlink() and list(tmp.iterdir()) == []
        (tmp / "a").write_text("a")
        publish_dir(tmp, tmp_path / "out")
    assert (tmp_path / "out" / "a").read_text() == "a" and victim.read_text() == SECRET


def test_publish_dir_replaces_only_when_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with staging_dir(out) as tmp:
        (tmp / "new").write_text("new")
        with pytest.raises(FileExistsError):
            publish_dir(tmp, out)
        publish_dir(tmp, out, replace=True)
    assert [p.name for p in out.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old one moved aside and removed


def _record_syscalls(monkeypatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, **kw):
        calls.append(("rename", str(dst)))
        return real_rename(src, dst, **kw)

    def replace(src, dst, **kw):
        calls.append(("rename", str(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "rename", rename)
    monkeypatch.setattr(files.os, "replace", replace)
    return calls


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fd paths from /proc")
def test_publish_fsyncs_every_file_and_directory_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    monkeypatch.delenv(files.FSYNC_ENV, raising=False)
    out = tmp_path / "ckpt"
    tmp = files.new_staging_dir(out)
    (tmp / "sub").mkdir()
    (tmp / "a.bin").write_bytes(b"a")
    (tmp / "sub" / "b.bin").write_bytes(b"b")
    calls = _record_syscalls(monkeypatch)
    publish_dir(tmp, out)
    i = calls.index(("rename", "ckpt"))
    before = {p for op, p in calls[:i] if op == "fsync"}
    assert {str(tmp / "a.bin"), str(tmp / "sub" / "b.bin"), str(tmp / "sub"), str(tmp)} <= before
    assert ("fsync", str(tmp_path)) in calls[i + 1:]  # the new directory entry is on disk too


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fd paths from /proc")
def test_atomic_write_fsyncs_file_then_directory_and_mhmoe_fsync_0_skips_it(tmp_path, monkeypatch):
    monkeypatch.delenv(files.FSYNC_ENV, raising=False)
    calls = _record_syscalls(monkeypatch)
    atomic_write(tmp_path / "a.json", "{}")
    assert [op for op, _ in calls] == ["fsync", "rename", "fsync"]
    assert calls[0][1].startswith(str(tmp_path / ".a.json.")) and calls[2] == ("fsync", str(tmp_path))
    calls.clear()
    monkeypatch.setenv(files.FSYNC_ENV, "0")
    assert not durable_default()
    atomic_write(tmp_path / "a.json", "{}")
    publish_dir(files.new_staging_dir(tmp_path / "d"), tmp_path / "d")
    assert [op for op, _ in calls] == ["rename", "rename"]


def test_running_out_of_space_is_one_no_space_error_and_leaves_no_temporary(tmp_path, monkeypatch):
    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(NoSpaceError, match=r"No space left on device while writing .*a\.json") as info:
        atomic_write(tmp_path / "a.json", full)
    assert info.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("exc", "code"), [
    (OSError(errno.EFBIG, "File too large"), errno.EFBIG),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), None),
    (ValueError("Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    (OSError(errno.EACCES, "Permission denied"), None),
])
def test_no_space_errno_reads_the_cause_through_library_wrappers(exc, code):
    assert no_space_errno(exc) == code
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped.__context__ = exc  # how torch.save into a Python file object reports a failed write
    assert no_space_errno(wrapped) == code


def test_sha256_file_matches_hashlib(tmp_path):
    import hashlib

    data = os.urandom(3 << 20)
    (tmp_path / "x").write_bytes(data)
    assert sha256_file(tmp_path / "x") == hashlib.sha256(data).hexdigest()
