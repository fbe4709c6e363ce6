"""Building and loading the C++ extension: once per machine, ISA, torch, Python and source version, safe against builds
that were killed half-way.

:func:`torch.utils.cpp_extension.load` compiles with ninja into a build directory and serialises concurrent builds
with a lock *file* that it deletes when it is done; a build killed half-way (a job that ends, Ctrl-C, the
OOM killer) leaves that file behind and every later ``load`` of that directory waits for it forever. So the build
here runs under a lock of its own instead (:class:`filelock.FileLock`, as the run directories: an ``flock`` on
POSIX, which the kernel releases when the holder dies), removes torch's stale lock file while holding it, waits at
most :data:`BUILD_WAIT_S` for another process's build, and marks a finished build (``built``): a marked build is
loaded with :func:`torch.ops.load_library` without ninja, so checkouts at other paths (whose sources ninja sees as
new files) load it instead of rebuilding it.

The directory is ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py<ver>_cpu``) /
``mhmoe_native_<isa>_<key>``, the key a digest of the sources, headers, compiler flags, torch and Python versions.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch
from filelock import FileLock

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("expert_loop.cpp", "slot_grads.cpp", "router_topk.cpp", "token_xent.cpp",
                                    "gathered_ffn.cpp", "group_rows.cpp")]
# included by the sources; part of the build's key
HEADERS = [HERE / name for name in ("vec_io.h", "swiglu.h", "dot_gemm.h", "amx_gemm.h", "expert_gemm.h")]
# ATen's vector classes follow these macros; the flags let the compiler emit the ISA torch itself runs
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
               "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}
BUILD_WAIT_S = 600.0  # the longest wait for another process's build of the same directory
BUILT_MARK = "built"  # written into the build directory once its library loaded
LOCK_NAME = "mhmoe.lock"  # our flock; torch's own lock file is "lock"


def capability() -> str:
    """The vector ISA torch dispatches its CPU kernels to here (``AVX512``, ``AVX2``, ``DEFAULT``, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cflags(cap: str) -> list[str]:
    """The compiler flags for ISA ``cap``."""
    return ["-O3", "-fopenmp", *ISA_FLAGS.get(cap, [])]


def source_key(cap: str) -> str:
    """A digest of the sources, headers, flags, torch and Python versions: every input of the library (torch
    itself rebuilds on source and flag changes, not on headers, and keeps one build per Python and CUDA only)."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join([*cflags(cap), torch.__version__, sys.version]).encode())
    return digest.hexdigest()[:12]


def extension_name(cap: str) -> str:
    """The library's name (and its build directory's): ``mhmoe_native_<isa>_<key>``."""
    return f"mhmoe_native_{cap.lower()}_{source_key(cap)}"


def build_root() -> Path:
    """Where torch keeps CPU extensions for this Python: ``$TORCH_EXTENSIONS_DIR`` as given, else torch's default
    root / ``py<major><minor>_cpu``."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_cpu"


def exclusive(path: Path, wait_s: float = BUILD_WAIT_S) -> FileLock:
    """An exclusive lock on ``path`` (:class:`filelock.FileLock`: ``flock`` on POSIX, created if absent) to hold
    with ``with``; :class:`TimeoutError` (filelock's ``Timeout``) after ``wait_s`` seconds of another holder. The
    kernel releases a dead holder's lock: it is never left behind."""
    return FileLock(str(path), timeout=wait_s)


def _ninja_dir() -> str | None:
    """Where the ``ninja`` package put its executable when it is not on PATH (a venv run without activation)."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja
    except ImportError:
        return None
    return getattr(ninja, "BIN_DIR", None)


def _compile(name: str, directory: Path, cap: str, verbose: bool) -> None:
    """Compile (ninja; up-to-date objects are kept) and load the library with torch's JIT extension builder."""
    from torch.utils.cpp_extension import load

    extra = _ninja_dir()
    path = os.environ.get("PATH", "")
    if extra:  # torch runs `ninja` from PATH: the package's copy for the duration of the build
        os.environ["PATH"] = extra + os.pathsep + path
    try:
        load(name=name, sources=[str(p) for p in SOURCES], is_python_module=False, extra_cflags=cflags(cap),
             build_directory=str(directory), verbose=verbose)
    finally:
        if extra:
            os.environ["PATH"] = path


def _load_built(directory: Path, library: Path) -> bool:
    """Load the library if its build finished (marked); False where there is none or it does not load (a file
    damaged since: the caller builds it again)."""
    if not ((directory / BUILT_MARK).is_file() and library.is_file()):
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def build(verbose: bool = False) -> Path:
    """Load this machine's build of the extension, compiling it first where there is none (or it no longer
    loads); returns the library's path. Raises where that fails (no compiler, no ninja, another build running for
    over :data:`BUILD_WAIT_S`)."""
    cap = capability()
    name = extension_name(cap)
    directory = build_root() / name
    library = directory / f"{name}.so"
    if _load_built(directory, library):
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive(directory / LOCK_NAME):
        if _load_built(directory, library):  # built while this process waited
            return library
        for stale in (directory / BUILT_MARK, library, directory / "lock"):  # torch's lock file: none is running
            stale.unlink(missing_ok=True)
        _compile(name, directory, cap, verbose)
        (directory / BUILT_MARK).write_text(f"{name}\n")
    return library
