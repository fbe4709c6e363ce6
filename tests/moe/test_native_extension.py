"""Building and loading the C++ extension (mhmoe.moe.dispatch.native.extension): the key covers every input, a build
killed half-way never blocks a later one, and a finished build is loaded without ninja."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mhmoe.moe.dispatch.native import extension as nb

CAN_BUILD = bool(shutil.which("c++") or shutil.which("g++")) and bool(shutil.which("ninja") or nb._ninja_dir())


def test_key_follows_sources_headers_flags_and_torch(monkeypatch, tmp_path):
    """A changed header, flag or torch version builds anew (torch itself tracks the sources and flags only, and
    keeps one directory per Python and CUDA version); the same inputs give the same key."""
    header = tmp_path / "h.h"
    header.write_text("// one")
    monkeypatch.setattr(nb, "HEADERS", [header])
    key = nb.source_key("AVX512")
    assert nb.source_key("AVX2") != key
    header.write_text("// two")
    assert nb.source_key("AVX512") != key
    header.write_text("// one")
    assert nb.source_key("AVX512") == key
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert nb.source_key("AVX512") != key


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """build() with the compiler and the library load replaced: records both, and checks that each compile runs
    under our lock with torch's lock file gone."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls = {"compile": 0, "load": []}

    def compile_(name, directory, cap, verbose):
        assert not (directory / "lock").exists(), "torch's stale lock file left in place: its load would wait forever"
        with pytest.raises(TimeoutError):  # our lock is held while compiling
            with nb.exclusive(directory / nb.LOCK_NAME, wait_s=0.1):
                pass
        (directory / f"{name}.so").write_bytes(b"library")
        calls["compile"] += 1

    monkeypatch.setattr(nb, "_compile", compile_)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls["load"].append(path))
    return calls


def test_stale_torch_lock_is_removed_and_a_finished_build_is_loaded_without_ninja(fake_build):
    name = nb.extension_name(nb.capability())
    directory = nb.build_root() / name
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # what a build killed half-way leaves
    library = nb.build()
    assert library == directory / f"{name}.so" and fake_build["compile"] == 1
    assert (directory / nb.BUILT_MARK).is_file() and not (directory / "lock").exists()
    assert nb.build() == library  # marked: loaded as it is
    assert fake_build["compile"] == 1 and fake_build["load"] == [str(library)]


def test_unfinished_build_is_built_again(fake_build):
    """A mark without its library (or a library without its mark: killed before marking) builds again."""
    directory = nb.build_root() / nb.extension_name(nb.capability())
    directory.mkdir(parents=True)
    (directory / nb.BUILT_MARK).touch()
    nb.build()
    (directory / nb.BUILT_MARK).unlink()
    nb.build()
    assert fake_build["compile"] == 2 and fake_build["load"] == []


def test_a_marked_library_that_no_longer_loads_is_built_again(fake_build, monkeypatch):
    name = nb.extension_name(nb.capability())
    directory = nb.build_root() / name
    directory.mkdir(parents=True)
    (directory / nb.BUILT_MARK).touch()
    (directory / f"{name}.so").write_bytes(b"damaged")

    def load_library(path):
        if (directory / f"{name}.so").read_bytes() == b"damaged":
            raise OSError("invalid ELF header")
        fake_build["load"].append(path)

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    nb.build()
    assert fake_build["compile"] == 1 and (directory / f"{name}.so").read_bytes() == b"library"
    nb.build()
    assert fake_build["compile"] == 1 and len(fake_build["load"]) == 1


def test_lock_waits_for_a_live_holder_and_not_for_a_dead_one(tmp_path):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="lock"):
            with nb.exclusive(path, wait_s=0.5):
                pass
        assert time.monotonic() - start >= 0.5
        holder.send_signal(signal.SIGKILL)  # a build killed half-way
        holder.wait(10)
        start = time.monotonic()
        with nb.exclusive(path, wait_s=5):
            pass
        assert time.monotonic() - start < 2
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not CAN_BUILD, reason="no C++ compiler or ninja")
def test_real_build_passes_a_stale_torch_lock(tmp_path):
    """torch's own load() with a tiny source, a stale lock file planted in its directory: the build finishes
    (torch's lock alone waits forever) and the second call loads the marked library without ninja."""
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int mhmoe_build_test() { return 7; }\n')
    script = textwrap.dedent(f"""
        import pathlib, sys
        from mhmoe.moe.dispatch.native import extension as nb
        nb.SOURCES, nb.HEADERS = [pathlib.Path({str(source)!r})], []
        directory = nb.build_root() / nb.extension_name(nb.capability())
        directory.mkdir(parents=True)
        (directory / "lock").touch()
        library = nb.build()
        nb._compile = lambda *a: sys.exit("compiled twice")
        assert nb.build() == library and (directory / nb.BUILT_MARK).is_file()
        print("ok")
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
