"""Checkpoint readers against resource bombs: a crafted ``.metadata``, ``trainer_state.pt`` or DCP item of
a few MB must not crash the interpreter, allocate gigabytes or take minutes (the limits of
``mhmoe.checkpoint.dcp_metadata`` and ``mhmoe.runtime.bounded.check_torch_archive``).

Each bomb runs in a child process under RLIMIT_AS / RLIMIT_CPU (``tests/bombs.py``); the assertions are
the outcome (refused with one bounded line naming the file), the child's peak memory and its time.
Without the limits: the deep key is a SIGSEGV (exit -11), the shared chunk list takes minutes, the
aliased chunks allocate ``copies`` times the data file before refusing (numbers: docs/SAFETY.md)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from bombs import (
    aliased_chunks_metadata,
    colliding_index_keys,
    colliding_int_keys,
    cuda_torch_excess,
    deep_tuple_key,
    deflated_torch_archive,
    empty_sets,
    pickle_of_ops,
    repeated_path,
    run_limited,
    shared_chunks_metadata,
    torch_archive,
)

from mhmoe.checkpoint.dcp_metadata import METADATA_FILE, read_metadata
from mhmoe.checkpoint.dcp_reader import read_dcp_full
from mhmoe.errors import MAX_CHARS, CheckpointError

# torch and mhmoe take ~320 MB (the CPU build of torch; a CUDA build's excess is added); every bomb below would
# need more than 1 GB unbounded
MAX_RSS_MB = 700 + cuda_torch_excess()[1]


def _read_in_child(paths: list, reader: str = "read_metadata"):
    """``reader`` on every path, in one child under the limits; one output line per path."""
    module = "dcp_metadata" if reader == "read_metadata" else "dcp_reader"
    code = (f"from mhmoe.checkpoint.{module} import {reader}\nfrom mhmoe.errors import CheckpointError\n"
            f"for p in {[str(p) for p in paths]!r}:\n    try:\n        {reader}(p)\n"
            "    except CheckpointError as e:\n        print(e, flush=True)\n"
            "    else:\n        print('LOADED', flush=True)\n")
    return run_limited(code, memory=2 << 30, cpu_s=60, timeout=120)


def _assert_refused(out, paths: list, whats: list[str]) -> None:
    assert out.status == 0, (out.status, out.stdout, out.stderr[-2000:])  # not a crash (unbounded: SIGSEGV)
    lines = out.stdout.strip().split("\n")
    assert len(lines) == len(paths), out.stdout
    for msg, path, what in zip(lines, paths, whats, strict=True):
        assert len(msg) <= 2 * MAX_CHARS and str(path) in msg and what in msg, msg
    assert out.max_rss_mb < MAX_RSS_MB and out.seconds < 60, (out.max_rss_mb, out.seconds)


BOMBS = {  # name: (file, what the refusal says)
    "deep-key": (deep_tuple_key, "nested deeper than 64 levels"),  # 3 MB: hashing the key recursed to SIGSEGV
    "path": (repeated_path, "PurePosixPath with arguments beyond the limits"),  # 1 MB: one string 1000 times
    "shared-chunks": (lambda: shared_chunks_metadata(20_000, 20_000),  # 0.3 MB: 4e8 chunk checks
                      "more chunks and items than its 0 storage entries"),
}


COST_BOMBS = {  # name: (file, what the refusal says); unbounded cost measured on this machine (docs/SAFETY.md)
    "int-keys": (lambda: colliding_int_keys(50_000), "a dict key of type int"),  # 0.65 MB: 30 s
    "index-keys": (lambda: colliding_index_keys(4000), "dict keys with one hash"),  # 0.3 MB: 11 s
    "empty-sets": (lambda: empty_sets(20_000_000), "bytes of objects from 20,000,003 bytes"),  # 20 MB: 4.8 GB
    "marks": (lambda: pickle.PROTO + b"\x04" + pickle.MARK * 5_000_000 + pickle.STOP, "bytes of objects"),
    "memo": (lambda: pickle.PROTO + b"\x04" + pickle.NONE + pickle.MEMOIZE * 5_000_000 + pickle.STOP,
             "bytes of objects"),
}


def test_metadata_cost_bombs_are_refused_within_memory_and_time(tmp_path):
    """Colliding keys (CPython hashes ints modulo 2**61 - 1; a MetadataIndex hashes its offsets) and
    stacks of empty containers, marks or memo entries: refused before the work grows beyond linear."""
    paths = []
    for name, (bomb, _) in COST_BOMBS.items():
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / METADATA_FILE)
        paths[-1].write_bytes(bomb())
    out = _read_in_child(paths)
    _assert_refused(out, paths, [what for _, what in COST_BOMBS.values()])
    assert out.seconds < 30, out.seconds


def test_compressed_records_are_refused_before_loading(tmp_path):
    """A deflated record inflates 1000x (torch.load accepts it): a 66 KB trainer_state.pt loaded as 64 MB,
    a 4 MB one as 4 GiB; the same in a DCP item file. torch.save never compresses: refused, one line."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    state = tmp_path / "trainer_state.pt"
    state.write_bytes(deflated_torch_archive(64 << 20))
    item = deflated_torch_archive(64 << 20)  # an item file holding this archive at bytes [0, len)
    d = tmp_path / "dcp"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(item)
    # a bytes item (an optimizer hyper-parameter): a tensor item is refused earlier, its data being
    # shorter than the tensor it claims (checkpoint.dcp_reader._check_extents)
    md = Metadata({"t": BytesStorageMetadata()}, planner_data={"t": ("t",)},
                  storage_data={MetadataIndex("t"): _StorageInfo("__0_0.distcp", 0, len(item))})
    (d / METADATA_FILE).write_bytes(pickle.dumps(md))
    code = ("from mhmoe.checkpoint.read import read_trainer_state\nfrom mhmoe.checkpoint.dcp_reader import "
            "read_dcp_full\nfrom mhmoe.errors import CheckpointError\nfrom pathlib import Path\n"
            f"for f, a in ((read_trainer_state, Path({str(tmp_path)!r})), (read_dcp_full, {str(d)!r})):\n"
            "    try:\n        f(a)\n        print('LOADED')\n    except CheckpointError as e:\n        print(e)\n")
    out = run_limited(code, memory=2 << 30, cpu_s=60, timeout=120)
    assert out.status == 0, (out.status, out.stderr[-2000:])
    lines = out.stdout.strip().split("\n")
    assert len(lines) == 2 and all("data/0' is compressed" in ln for ln in lines), out.stdout
    assert str(state.parent) in lines[0] and str(d) in lines[1]
    assert out.max_rss_mb < MAX_RSS_MB, out.max_rss_mb  # unbounded: + 64 MB each (4 GiB for a 4 MB file)


def test_the_pickle_walk_is_linear_and_fast():
    """The walk before torch.load: time linear in the opcodes and well under the ~5 us per opcode of
    pickletools.genops (a 32 MB pickle of one-byte opcodes: ~25 min before), CPU time."""
    import time

    from mhmoe.runtime.bounded import scan_pickle

    times = []
    for n in (500_000, 2_000_000):
        data = pickle_of_ops(n)
        t0 = time.process_time()
        assert scan_pickle(data) == (0, 4 * n + 8)
        times.append(time.process_time() - t0)
    assert times[1] < 8 * max(times[0], 0.05), times  # linear (4x the opcodes), with room for noise
    assert times[1] / 2_000_000 < 2.5e-6, times  # about 0.15 us of CPU per opcode on an Intel Xeon


def test_metadata_bombs_are_refused_within_memory_and_time(tmp_path):
    paths = []
    for name, (bomb, _) in BOMBS.items():
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / METADATA_FILE)
        paths[-1].write_bytes(bomb())
    _assert_refused(_read_in_child(paths), paths, [what for _, what in BOMBS.values()])


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory):
    """A DCP directory holding one 8 MB tensor and one bytes item."""
    d = tmp_path_factory.mktemp("dcp") / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"model": {"w": torch.arange(2_000_000, dtype=torch.float32)}, "optim": {"step": 3}},
                 checkpoint_id=str(d), no_dist=True)
    return d


def test_aliased_chunks_allocate_nothing_beyond_the_data_files(big_dcp, tmp_path):
    """100 tensors whose entries all point at one 8 MB item (one shared entry, or 100 entries with the
    same bytes): refused before allocating (the unbounded reader allocated 100 x 8 MB first)."""
    dirs = []
    for shared in (True, False):
        d = tmp_path / f"shared-{shared}"
        d.mkdir()
        for f in big_dcp.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        md = aliased_chunks_metadata(read_metadata(big_dcp / METADATA_FILE), copies=100)
        if not shared:
            md.storage_data = {k: copy.copy(v) for k, v in md.storage_data.items()}
        (d / METADATA_FILE).write_bytes(pickle.dumps(md))
        dirs.append(d)
    _assert_refused(_read_in_child(dirs, "read_dcp_full"), dirs, ["share one data item", "data items overlap"])


def test_the_real_checkpoint_still_loads_exactly(big_dcp):
    full = read_dcp_full(big_dcp)
    assert torch.equal(full["model"]["w"], torch.arange(2_000_000, dtype=torch.float32))
    assert full["optim"] == {"step": 3}


def test_limits_leave_room_for_real_metadata(tmp_path):
    """A metadata with thousands of tensors, long names and 64-dim sizes is read (limits are structural,
    not a size cap on honest files)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, storage = {}, {}
    for i in range(3000):
        fqn = f"model.blocks.{i}.ffn.experts." + "w" * 200
        size = torch.Size([1] * 63 + [4])
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                         [ChunkStorageMetadata(torch.Size([0] * 64), size)])
        storage[MetadataIndex(fqn, torch.Size([0] * 64))] = _StorageInfo("__0_0.distcp", 16 * i, 16)
    path = tmp_path / METADATA_FILE
    path.write_bytes(pickle.dumps(Metadata(sdm, planner_data={k: (k,) for k in sdm}, storage_data=storage)))
    assert len(read_metadata(path).state_dict_metadata) == 3000
    path.write_bytes(pickle.dumps(Metadata(sdm, planner_data={k: (k,) * 65 for k in sdm}, storage_data=storage)))
    with pytest.raises(CheckpointError, match="key path of at most 64 parts"):
        read_metadata(path)


def test_a_trainer_state_with_a_deep_key_is_refused_not_a_crash(tmp_path):
    """torch.load(weights_only=True) builds a 300,000-deep tuple key and crashes hashing it (SIGSEGV):
    the archive's pickle is walked first and refused; the checkpoint falls back like a damaged one."""
    import json

    from mhmoe.checkpoint.write import save_checkpoint
    from mhmoe.config.model import ModelConfig
    from mhmoe.config.run import RunConfig
    from mhmoe.config.train import TrainConfig
    from mhmoe.data.tokenizer import ByteTokenizer
    from mhmoe.model.lm import LM

    cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=4, d_ff=32, max_seq_len=16)
    run = RunConfig(model=cfg, train=TrainConfig(seq_len=16))
    ck = save_checkpoint(tmp_path / "run", 1, LM(cfg), run, ByteTokenizer(), {"step": 1})
    bomb = torch_archive(deep_tuple_key(300_000))
    (ck / "trainer_state.pt").write_bytes(bomb)
    meta = json.loads((ck / "meta.json").read_text())
    import hashlib

    meta["files"]["trainer_state.pt"] = {"sha256": hashlib.sha256(bomb).hexdigest(), "bytes": len(bomb)}
    (ck / "meta.json").write_text(json.dumps(meta))
    code = ("from mhmoe.loading.checkpoint import load_checkpoint\nfrom mhmoe.errors import CheckpointError\n"
            f"try:\n    load_checkpoint({str(ck)!r})\nexcept CheckpointError as e:\n    print(e)\n")
    out = run_limited(code, memory=2 << 30, cpu_s=60)
    msg = out.stdout.strip()
    assert out.status == 0, (out.status, out.stderr[-2000:])
    assert "trainer_state.pt cannot be loaded" in msg and "nested deeper than 64 levels" in msg, msg
    assert out.max_rss_mb < MAX_RSS_MB, out.max_rss_mb
