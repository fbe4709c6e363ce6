"""glibc malloc tuning (mhmoe.runtime.cpu_malloc), each check in a fresh interpreter: mallopt is process-wide."""

import subprocess
import sys

import pytest

CHECK = """
import ctypes, sys
from mhmoe.runtime.cpu_malloc import malloc_from_env
applied = malloc_from_env()
print(applied)
if applied:  # a freed 256 MB block comes back from the heap, not a fresh mmap: RSS stays at the peak
    import resource
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(256 << 20); ctypes.memset(p, 1, 256 << 20); libc.free(p)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    q = libc.malloc(256 << 20); ctypes.memset(q, 1, 256 << 20)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
"""


def _run(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_reuses_freed_memory(monkeypatch):
    import os

    env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, "MHMOE_MALLOC": "tuned"}
    got = _run(env)
    if got[0] == "False":
        pytest.skip("not glibc")
    # 256 MB = 65,536 pages: a fresh mmap would fault on every page; the reused heap block on (almost) none
    assert int(got[1]) < 1000, got


def test_malloc_left_alone_by_default():
    import os

    env = {k: v for k, v in os.environ.items() if k != "MHMOE_MALLOC"}
    assert _run(env) == ["False"]
