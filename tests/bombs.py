"""Resource bombs: small files that cost gigabytes or hours in a reader without limits, and the harness
that runs a reader on one in a child process under a memory and CPU limit (so a bomb that gets through
cannot take the machine down). Used by the tests of every bounded reader and by
``benchmarks/bombs.py`` (before / after measurements, docs/SAFETY.md)."""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 2 << 30  # address space of the child (torch alone maps ~0.7 GiB)
CPU_LIMIT_S = 60


# ---- YAML -------------------------------------------------------------------------------------------------
def billion_laughs(levels: int = 9, width: int = 9) -> str:
    """``name:`` a list of anchored lists, each level ``width`` aliases of the previous one: width**levels
    values in ~1 KB. The run's ``name`` must be a string, so an unbounded reader ``repr``'s the whole
    expansion into its error message."""
    lines = ["name:", f"  - &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels + 1):
        lines.append(f"  - &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def deep_yaml(depth: int = 100_000) -> str:
    """Sequences nested ``depth`` deep in one line (``- - - ... 1``): the loader's composer recurses once
    per level."""
    return "- " * depth + "1\n"


# ---- JSON -------------------------------------------------------------------------------------------------
def deep_json(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


# ---- DCP .metadata pickles (raw opcodes) ------------------------------------------------------------------
def _unicode(s: str) -> bytes:
    b = s.encode("utf-8")
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def deep_tuple_key(depth: int = 3_000_000) -> bytes:
    """A dict whose key is a tuple nested ``depth`` deep: hashing it recurses in C without a limit."""
    return (pickle.PROTO + b"\x04" + pickle.EMPTY_DICT + pickle.EMPTY_TUPLE + pickle.TUPLE1 * depth
            + pickle.NONE + pickle.SETITEM + pickle.STOP)


def torch_archive(data_pkl: bytes) -> bytes:
    """A ``torch.save`` zip archive whose pickle is ``data_pkl`` (what torch.load(weights_only=True) reads)."""
    import zipfile

    import torch

    buf = io.BytesIO()
    torch.save({"step": 1}, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for item in src.infolist():
            z.writestr(item, data_pkl if item.filename.endswith("/data.pkl") else src.read(item.filename))
    return out.getvalue()


def repeated_path(chars: int = 1 << 20, repeats: int = 1000) -> bytes:
    """``PurePosixPath(s, s, ..., s)`` with one memoised ``chars``-long string referenced ``repeats``
    times: a ~1 MB file that joins into a chars * repeats string."""
    out = io.BytesIO()
    out.write(pickle.PROTO + b"\x04")
    out.write(_unicode("pathlib") + pickle.MEMOIZE + _unicode("PurePosixPath") + pickle.MEMOIZE + pickle.STACK_GLOBAL)
    out.write(_unicode("a" * chars) + pickle.MEMOIZE + pickle.POP)  # memo index 2, off the stack
    out.write(pickle.MARK + (pickle.BINGET + b"\x02") * repeats + pickle.TUPLE + pickle.REDUCE + pickle.STOP)
    return out.getvalue()


def shared_chunks_metadata(items: int = 20_000, chunks: int = 20_000) -> bytes:
    """A DCP Metadata whose ``items`` tensors all share one TensorStorageMetadata with one list of
    ``chunks`` references to a single chunk: a few hundred KB that an unbounded check walks
    items * chunks times."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    one = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))
    tsm = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1]), [one] * chunks)
    md = Metadata(state_dict_metadata={f"t{i}": tsm for i in range(items)}, planner_data={}, storage_data={})
    return pickle.dumps(md, protocol=4)


def aliased_chunks_metadata(md, copies: int):
    """``md`` (a real DCP Metadata of one tensor ``t``) with ``copies`` more tensors whose storage entries
    all point at ``t``'s bytes: full tensors of ``copies`` times the data file's size."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    (fqn, tsm), = [(k, v) for k, v in md.state_dict_metadata.items() if type(v) is TensorStorageMetadata]
    infos = {k.offset: v for k, v in md.storage_data.items() if k.fqn == fqn}
    for i in range(copies):
        name = f"{fqn}_alias{i}"
        md.state_dict_metadata[name] = tsm
        for c in tsm.chunks:
            md.storage_data[MetadataIndex(name, c.offsets)] = infos[c.offsets]
        if md.planner_data is not None:
            md.planner_data[name] = (*md.planner_data[fqn][:-1], name.rsplit(".", 1)[-1])
    return md


# ---- compression inside archives and data files ----------------------------------------------------------------
def deflated_torch_archive(tensor_bytes: int = 64 << 20) -> bytes:
    """A ``torch.save`` archive of one uint8 tensor of ``tensor_bytes`` zeros whose records are deflated
    (torch.load accepts them): a few hundred KB that load as ``tensor_bytes`` of memory."""
    import zipfile

    import torch

    buf = io.BytesIO()
    torch.save({"step": 1, "t": torch.zeros(4, dtype=torch.uint8)}, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("/data.pkl"):  # the storage of 4 elements -> tensor_bytes elements
                data = data.replace(b"K\x04", b"J" + struct.pack("<i", tensor_bytes))
            deflate = item.filename.endswith("/data/0")
            if deflate:
                data = bytes(tensor_bytes)
            z.writestr(zipfile.ZipInfo(item.filename), data,
                       compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def gzip_bomb(decompressed: int = 64 << 20) -> bytes:
    """A gzip file of ``decompressed`` bytes of text ('a' repeated): about 1000x smaller."""
    import gzip

    return gzip.compress(b"a" * decompressed, compresslevel=9, mtime=0)


# ---- cost bombs for pickles: containers, memo entries, colliding keys --------------------------------------------
M61 = 2**61 - 1  # CPython hashes an int modulo this prime: k * M61 all hash to 0


def empty_sets(count: int = 2_000_000) -> bytes:
    """``count`` EMPTY_SET opcodes: one byte each, 216 bytes of Python set each (a 2 MB file: 460 MB)."""
    return pickle.PROTO + b"\x04" + pickle.EMPTY_SET * count + pickle.STOP


def _long1(v: int) -> bytes:
    b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(b)]) + b


def colliding_int_keys(count: int = 50_000) -> bytes:
    """A dict of ``count`` int keys ``k * (2**61 - 1)``, which all share one hash: inserting them costs
    count**2 / 2 comparisons (50,000 keys, 0.65 MB: ~30 s)."""
    body = b"".join(_long1(k * M61) + pickle.NONE for k in range(1, count + 1))
    return pickle.PROTO + b"\x04" + pickle.EMPTY_DICT + pickle.MARK + body + pickle.SETITEMS + pickle.STOP


def dict_pickle(pairs) -> bytes:
    """A protocol-4 pickle of a dict filled with ``pairs`` (key, value), written without building the dict."""
    buf = io.BytesIO()
    p = pickle._Pickler(buf, protocol=4)  # the pure-Python pickler: its batching of items is reusable
    p.framer.start_framing()
    p.write(pickle.PROTO + b"\x04" + pickle.EMPTY_DICT)
    p._batch_setitems(iter(pairs))
    p.write(pickle.STOP)
    p.framer.end_framing()
    return buf.getvalue()


def colliding_index_keys(count: int = 4000, dims: int = 8) -> bytes:
    """A dict of ``count`` DCP ``MetadataIndex`` keys (the keys of ``storage_data``) with one hash: their
    offsets are torch.Sizes of multiples of 2**61 - 1, which hash alike (4**dims of them)."""
    import itertools

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    offsets = itertools.islice(itertools.product(range(4), repeat=dims), count)
    return dict_pickle((MetadataIndex("w", torch.Size([k * M61 for k in ks])), None) for ks in offsets)


def pickle_of_ops(count: int) -> bytes:
    """A pickle of ``count`` one-byte opcodes that builds little (NONE then POP, repeated): what the
    pickle walk costs per opcode."""
    return pickle.PROTO + b"\x04" + (pickle.NONE + pickle.POP) * (count // 2) + pickle.NONE + pickle.STOP


# ---- running a reader on a bomb -----------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int  # exit status; negative: killed by that signal
    stderr: str
    stdout: str
    max_rss_mb: float
    seconds: float


# A small launcher process forks the measured child: a child forked from a large parent (pytest with torch
# imported) inherits its resident size in ru_maxrss, even across exec; forked from the launcher, the
# child's peak RSS is its own. The launcher sets the limits in the child and writes its wait4 result.
# A CUDA build of torch maps ~3 GiB of libraries and keeps ~200 MB more resident than the CPU build at import,
# without touching a GPU: the limits below are sized for the CPU build, so that excess is added to them.
TORCH_AS, TORCH_RSS_MB = int(0.7 * 2**30), 320.0  # `import torch, mhmoe.cli` with the CPU build of torch
_PROBE = ("import resource, torch, mhmoe.cli\n"
          "vm = next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmSize:'))\n"
          "print(vm * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")


@functools.cache
def cuda_torch_excess() -> tuple[int, float]:
    """(address-space bytes, resident MB) that importing torch and mhmoe takes beyond the CPU build's (0, 0.0
    with the CPU build; measured once, in a child, with a CUDA build)."""
    import torch

    if torch.version.cuda is None:
        return 0, 0.0
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    vm, rss = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300,
                             check=True).stdout.split()
    return max(0, int(vm) - TORCH_AS), max(0.0, float(rss) - TORCH_RSS_MB)


_LAUNCHER = """
import json, os, resource, sys
memory, cpu_s, result = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[4]])
_, status, usage = os.wait4(pid, 0)
with open(result, "w") as f:
    json.dump({"status": os.waitstatus_to_exitcode(status), "max_rss_kb": usage.ru_maxrss}, f)
"""


def run_limited(code: str, *, memory: int = MEMORY_LIMIT, cpu_s: int = CPU_LIMIT_S, timeout: float = 120,
                src: Path | None = None, env: dict[str, str] | None = None) -> Outcome:
    """Run ``code`` (Python) in a child under RLIMIT_AS = ``memory`` (plus what a CUDA build of torch maps beyond
    the CPU build: :func:`cuda_torch_excess`) and RLIMIT_CPU = ``cpu_s``, with ``src`` (default: this
    checkout's ``src``) first on the path; its exit, output, peak RSS and wall time."""
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": str(src or ROOT / "src"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        t0 = time.perf_counter()
        cap = memory + cuda_torch_excess()[0]
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(cap), str(cpu_s), str(result), code],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env,
                                start_new_session=True)  # its own process group: a timeout ends both processes
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        seconds = time.perf_counter() - t0
        rec = json.loads(result.read_text()) if result.exists() else {"status": -9, "max_rss_kb": float("nan")}
    return Outcome(rec["status"], err, out, rec["max_rss_kb"] / 1024, seconds)


def cli(args: list[str]) -> str:
    """Python code that runs ``mhmoe ARGS`` in the child and exits with its status."""
    return f"import sys\nfrom mhmoe.cli import main\nsys.exit(main({json.dumps(args)}))"
