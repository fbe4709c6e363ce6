"""Loading a checkpoint never executes code from it and never reads outside it.

Every attack is first shown to be live (the crafted payload creates a marker file when the stock
unpickler / torch loader reads it, or the crafted name really leads outside the checkpoint), then
shown to be refused by mhmoe's loaders with a one-line CheckpointError and without the marker
appearing: a crafted DCP ``.metadata`` pickle (library calls, ``mhmoe eval`` / ``generate`` /
``train --resume`` with exit status 2, and a 2-process ``dcp.load`` resume), a crafted ``.distcp``
bytes item and tensor item, a crafted ``trainer_state.pt``, DCP data-file names that leave the directory
(``../``, absolute, symlinks), and pickles that would modify the DCP classes themselves. Legitimate DCP
checkpoints read exactly as torch's own converter reads them. (meta.json names and symlinks out of a
checkpoint: test_names.py.)
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import rehash
from torch.distributed.checkpoint import CheckpointException

import mhmoe
from mhmoe.checkpoint.dcp_metadata import ALLOWED_GLOBALS, read_metadata
from mhmoe.checkpoint.dcp_reader import SafeFileSystemReader, read_dcp_full
from mhmoe.checkpoint.format import list_checkpoints, verify_checkpoint
from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.cli import main
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import ByteTokenizer
from mhmoe.errors import CheckpointError
from mhmoe.loading.checkpoint import load_checkpoint, load_latest
from mhmoe.model.lm import LM
from mhmoe.parallel.checkpoint import load_dcp_into, open_latest_dcp, save_dcp_checkpoint
from mhmoe.train.optim import build_optimizer
from mhmoe.train.resume import load_for_resume, load_latest_for_resume

MOE = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True)
MODEL = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, d_ff=32, max_seq_len=32, moe=MOE)
STEP_DIR = "checkpoints/step_00000001"


class Payload:
    """Creates ``marker`` when unpickled by an unrestricted unpickler (``pickle.load``,
    ``torch.load(weights_only=False)``): arbitrary code, harmless here."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return Path.write_text, (self.marker, "code ran")


# ---- helpers ---------------------------------------------------------------------------------------------
def _run() -> RunConfig:
    return RunConfig(model=MODEL, train=TrainConfig(seq_len=16, batch_size=2, max_steps=2),
                     data=DataConfig(tokenizer="byte", val_sets=()))


def _trained(seed: int = 0) -> tuple[LM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LM(MODEL)
    opt = build_optimizer(model, _run().train)
    model(torch.randint(0, 257, (2, 8))).logits.float().square().mean().backward()
    opt.step()
    return model, opt


def _trainer_state(opt: torch.optim.Optimizer, step: int = 1) -> dict:
    """A complete trainer state at ``step`` (what a resume needs; mhmoe.train.loop writes the same keys)."""
    twin = torch.optim.AdamW([{"params": [torch.zeros(1)]} for _ in opt.param_groups], lr=opt.defaults["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(twin, lambda s: 1.0)  # leaves ``opt`` as it is
    for _ in range(step):
        twin.step()
        sched.step()
    return {"step": step, "nan_total": 0, "tokens_seen": 0, "train_s": 0.0, "scheduler": sched.state_dict(),
            "rng_cpu": torch.get_rng_state()}


@pytest.fixture(scope="module")
def legit(tmp_path_factory) -> Path:
    """A legitimate single-process DCP run directory (step 1), plus the model it holds (``model.pt``)."""
    root = tmp_path_factory.mktemp("legit")
    model, opt = _trained()
    save_dcp_checkpoint(root / "run", 1, model, opt, _run(), ByteTokenizer(), _trainer_state(opt), no_dist=True)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, root / "reference.pt")
    return root


@pytest.fixture
def run(legit, tmp_path) -> Path:
    """A private copy of the legitimate DCP run, free to tamper with."""
    shutil.copytree(legit / "run", tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "PWNED"


def _refused(fn, marker: Path, match: str = "") -> str:
    """``fn()`` raises a one-line CheckpointError and no code ran."""
    with pytest.raises(CheckpointError, match=match) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert not marker.exists(), "the payload ran"
    return msg


def _live(load, marker: Path) -> None:
    """The payload is real: ``load()`` (a stock, unrestricted loader) runs it. Then forget it ran."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load()
        except Exception:  # noqa: BLE001, S110 -- only the side effect matters
            pass
    assert marker.read_text() == "code ran"
    marker.unlink()


def _loaders(run: Path, model_only: bool = True):
    """Every way mhmoe reads a DCP checkpoint in one process (``model_only``: also those that read only
    the model's items)."""
    ck = run / STEP_DIR

    def into():
        model, opt = _trained(seed=1)
        load_dcp_into(ck, model, opt)

    loaders = {"load_for_resume": lambda: load_for_resume(ck),
               "load_latest_for_resume": lambda: load_latest_for_resume(run, warn=False),
               "read_dcp_full": lambda: read_dcp_full(ck / "dcp"), "load_dcp_into": into}
    if model_only:
        loaders.update({"load_checkpoint": lambda: load_checkpoint(ck),
                        "load_latest": lambda: load_latest(run, warn=False),
                        "mhmoe.load": lambda: mhmoe.load(run, "cpu", warn=False),
                        "LM.from_pretrained": lambda: LM.from_pretrained(run, warn=False)})
    return loaders


def _dcp_save(state: dict, path: Path) -> None:
    """What an attacker runs: ``dcp.save`` of a state dict holding a payload (a non-tensor "bytes" item)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _payload_pickle(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker), protocol=pickle.DEFAULT_PROTOCOL)


# ---- 1. a crafted .metadata pickle -------------------------------------------------------------------------
def test_crafted_metadata_runs_no_code(run, marker):
    meta_file = run / STEP_DIR / "dcp" / ".metadata"
    meta_file.write_bytes(_payload_pickle(marker))
    rehash(run / STEP_DIR)
    _live(lambda: pickle.loads(meta_file.read_bytes()), marker)  # what FileSystemReader.read_metadata does
    verify_checkpoint(run / STEP_DIR)  # hashes match: only the reader stands between the payload and the user
    for name, load in _loaders(run).items():
        msg = _refused(load, marker, "refused DCP metadata|no valid checkpoint")
        assert "pathlib.Path.write_text" in msg, (name, msg)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="no valid checkpoint.*refused DCP metadata"):
        open_latest_dcp(run)  # the multi-process resume: refused when choosing the checkpoint
    # the per-rank metadata file that dcp.load falls back to is read the same way
    (meta_file.parent / "__0.metadata").write_bytes(_payload_pickle(marker))
    _refused(lambda: SafeFileSystemReader(meta_file.parent).read_metadata(rank=0), marker, "refused")


def test_cli_refuses_crafted_metadata_with_exit_status_2(run, marker, capsys):
    meta_file = run / STEP_DIR / "dcp" / ".metadata"
    meta_file.write_bytes(_payload_pickle(marker))
    rehash(run / STEP_DIR)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mhmoe", "eval", "--checkpoint", str(run)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mhmoe eval: error:") and "refused DCP metadata" in last, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    cfg = run / "run.yaml"
    shutil.copy(run / STEP_DIR / "config.yaml", cfg)
    assert main(["train", "--config", str(cfg), "--out", str(run), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("mhmoe generate: error:") == 1 and err.count("mhmoe train: error:") == 1, err
    assert not marker.exists()


def test_unpickler_refuses_to_modify_classes(tmp_path):
    """A pickle that only names allowed classes but uses BUILD to set an attribute on one of them
    (here Metadata.pwned = torch.Size), or calls a dataclass through REDUCE, is refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    def text(s: str) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(s)]) + s.encode()

    glob = text("torch.distributed.checkpoint.metadata") + text("Metadata") + b"\x93"  # STACK_GLOBAL
    # PROTO 4, Metadata, (None, {"pwned": torch.Size}), BUILD: setattr(Metadata, "pwned", torch.Size)
    setattr_on_class = b"\x80\x04" + glob + b"N}" + text("pwned") + text("torch") + text("Size") + b"\x93s\x86b."
    reduce_call = b"\x80\x04" + glob + b"}\x85R."  # Metadata({})
    f = tmp_path / ".metadata"
    try:
        pickle.loads(setattr_on_class)
        assert Metadata.pwned is torch.Size  # live: the stock unpickler patches the class
    finally:
        del Metadata.pwned
    f.write_bytes(setattr_on_class)
    with pytest.raises(CheckpointError, match="BUILD on type"):
        read_metadata(f)
    assert not hasattr(Metadata, "pwned")
    f.write_bytes(reduce_call)
    with pytest.raises(CheckpointError, match="REDUCE on type"):
        read_metadata(f)
    # an instance given its own __setstate__ (a later BUILD would call it): dunder field names are refused
    new_md = glob + b")\x81"  # EMPTY_TUPLE, NEWOBJ: Metadata.__new__(Metadata)
    f.write_bytes(b"\x80\x04" + new_md + b"}" + text("__setstate__") + text("torch") + text("Size") + b"\x93sb.")
    with pytest.raises(CheckpointError, match="BUILD of Metadata with a dict state"):
        read_metadata(f)


@pytest.mark.parametrize("obj", ["dict", "os.system", "no-storage", "chunk-outside", "transform", "eval-global",
                                 "huge-tensor"])
def test_malformed_or_foreign_metadata_is_refused(run, obj):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    meta_file = run / STEP_DIR / "dcp" / ".metadata"
    md = read_metadata(meta_file)
    if obj == "dict":
        data = pickle.dumps({"state_dict_metadata": {}})
    elif obj == "os.system":
        data = pickle.dumps(os.system)
    elif obj == "eval-global":
        data = b"\x80\x04cbuiltins\neval\n\x8c\x031+1\x85R."
    else:
        if obj == "no-storage":
            md.storage_data = None
        elif obj == "huge-tensor":  # 4 TB claimed: refused before anything is allocated
            t = md.state_dict_metadata["model.embed.weight"]
            t.size = t.chunks[0].sizes = torch.Size([10**6, 10**6])
        elif obj == "chunk-outside":
            t = md.state_dict_metadata["model.embed.weight"]
            t.chunks[0] = ChunkStorageMetadata(offsets=torch.Size([5, 0]), sizes=t.chunks[0].sizes)
        else:
            next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]
        data = pickle.dumps(md)
    meta_file.write_bytes(data)
    with pytest.raises(CheckpointError, match="refused DCP metadata") as info:
        read_dcp_full(meta_file.parent)
    assert "\n" not in str(info.value)


def test_allowed_globals_are_data_classes_only():
    """The allow-list: DCP metadata dataclasses, torch.Size, dtypes / layouts / memory formats, pure paths."""
    from torch.distributed.checkpoint import metadata as m

    allowed = set(ALLOWED_GLOBALS.values())
    assert {m.Metadata, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata, m.TensorProperties,
            m.MetadataIndex, m.StorageMeta, m._MEM_FORMAT_ENCODING, torch.Size, torch.float32,
            torch.bfloat16} <= allowed
    for (module, _), v in ALLOWED_GLOBALS.items():
        assert module in ("torch", "torch.serialization", "pathlib", "pathlib._local", m.__name__,
                          "torch.distributed.checkpoint.filesystem")
        assert not (callable(v) and module == "torch" and not isinstance(v, type)), v  # no torch functions
    assert ("builtins", "eval") not in ALLOWED_GLOBALS and ("torch", "load") not in ALLOWED_GLOBALS


# ---- 2. crafted .distcp items ----------------------------------------------------------------------------
def test_crafted_bytes_item_runs_no_code(run, marker):
    """A non-tensor item (an optimizer hyper-parameter) whose pickle runs code: torch's own loader
    (DefaultLoadPlanner.load_bytes, weights_only=False) runs it; mhmoe refuses it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = run / STEP_DIR
    state = read_dcp_full(ck / "dcp")
    state["optim"]["param_groups"][0]["lr"] = Payload(marker)
    shutil.rmtree(ck / "dcp")
    _dcp_save(state, ck / "dcp")
    rehash(ck)
    _live(lambda: dcp_to_torch_save(str(ck / "dcp"), str(run / "out.pt")), marker)  # the previous read path
    for name, load in _loaders(run, model_only=False).items():
        msg = _refused(load, marker, "refused DCP item|no valid checkpoint")
        assert "param_groups.0.lr" in msg, (name, msg)
    mhmoe.load(run, "cpu")  # loading the model reads no optimizer item
    assert not marker.exists()
    # torch's DefaultLoadPlanner behind the safe reader: the planner only sees bytes re-serialised by us
    model, _ = _trained(seed=1)
    sd = {"model": model.state_dict(), "optim": {"param_groups": [{"lr": 0.0}]}}
    with pytest.raises(CheckpointException) as info, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(sd, storage_reader=SafeFileSystemReader(ck / "dcp"), no_dist=True)
    (exc, _), = info.value.failures.values()
    assert isinstance(exc, CheckpointError) and "refused DCP item" in str(exc)
    assert not marker.exists()


def test_crafted_tensor_item_runs_no_code(run, marker):
    """A tensor item replaced by a pickle that runs code (appended to the .distcp file, the metadata
    pointing at it)."""
    ck = run / STEP_DIR
    md = read_metadata(ck / "dcp" / ".metadata")
    idx = next(k for k in md.storage_data if k.fqn == "model.embed.weight")
    info = md.storage_data[idx]
    buf = io.BytesIO()
    torch.save({"weight": Payload(marker), "pad": bytes(info.length)}, buf)  # as long as the real item
    evil = buf.getvalue()
    data_file = ck / "dcp" / info.relative_path
    info.offset, info.length = data_file.stat().st_size, len(evil)
    with open(data_file, "ab") as f:
        f.write(evil)
    (ck / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    rehash(ck)
    _live(lambda: torch.load(io.BytesIO(evil), weights_only=False), marker)
    for name, load in _loaders(run).items():
        msg = _refused(load, marker, "refused DCP item|no valid checkpoint")
        assert "model.embed.weight" in msg, (name, msg)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "newline"])
def test_data_file_names_stay_inside_the_dcp_directory(run, tmp_path, how):
    """``.metadata`` names the file of every item: ``../``, absolute names and symlinks out are refused."""
    ck = run / STEP_DIR
    md = read_metadata(ck / "dcp" / ".metadata")
    name = next(iter(md.storage_data.values())).relative_path
    outside = tmp_path / "outside.distcp"
    shutil.copy(ck / "dcp" / name, outside)  # a valid data file, but not the checkpoint's
    if how == "symlink":
        (ck / "dcp" / name).unlink()
        (ck / "dcp" / name).symlink_to(outside)
        with pytest.raises(CheckpointError, match="symlink out of the checkpoint"):
            load_checkpoint(ck)
        match = "link out of the directory"
    else:
        target = {"dotdot": "../../../../outside.distcp", "absolute": str(outside), "newline": "x\nError: fake"}[how]
        if how != "newline":
            assert os.path.samefile(ck / "dcp" / target, outside)  # live: the name leads outside
        for info in md.storage_data.values():
            info.relative_path = target
        (ck / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
        match = "not a plain file name inside the checkpoint"
    with pytest.raises(CheckpointError, match=match) as exc:
        read_dcp_full(ck / "dcp")
    assert "\n" not in str(exc.value)


# ---- 3. trainer_state.pt (both formats) ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_crafted_trainer_state_runs_no_code(run, tmp_path, marker, fmt):
    """trainer_state.pt is loaded with weights_only=True: a pickle that runs code is refused."""
    if fmt == "safetensors":
        model, _ = _trained()
        ck = save_checkpoint(tmp_path / "st", 1, model, _run(), ByteTokenizer(), {"step": 1})
    else:
        ck = run / STEP_DIR
    torch.save({"step": 1, "rng": Payload(marker)}, ck / "trainer_state.pt")
    rehash(ck)
    _live(lambda: torch.load(ck / "trainer_state.pt", weights_only=False), marker)
    _refused(lambda: load_checkpoint(ck), marker, "cannot be loaded")
    if fmt == "dcp":
        model, opt = _trained(seed=1)
        _refused(lambda: load_dcp_into(ck, model, opt), marker, "trainer_state.pt cannot be loaded")


# ---- 4. legitimate checkpoints read as before --------------------------------------------------------------
def test_legit_checkpoint_reads_exactly_as_torch_does(run, legit, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = run / STEP_DIR
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(ck / "dcp"), str(tmp_path / "full.pt"))  # trusted here: our own checkpoint
    want = torch.load(tmp_path / "full.pt", weights_only=True)
    got = read_dcp_full(ck / "dcp")

    def same(a, b, where="") -> None:
        assert type(a) is type(b), where
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{where}[{i}]")
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), where
        else:
            assert a == b, where

    same(got, want)
    ref = torch.load(legit / "reference.pt", weights_only=True)
    ck1 = load_checkpoint(ck)
    for k, v in ref["model"].items():
        assert torch.equal(ck1.model.state_dict()[k], v), k
    model, opt = _trained(seed=1)  # different weights, then loaded from the checkpoint (DCP's own planner)
    assert load_dcp_into(ck, model, opt)["step"] == 1
    for k, v in ref["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert opt.state_dict()["param_groups"] == ref["optim"]["param_groups"]
    for i, st in ref["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(opt.state_dict()["state"][i][k], v), (i, k)
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]


# ---- 5. the multi-process resume (2 gloo processes) --------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        root_p = Path(root)
        model, opt = _trained(seed=1)
        assert load_dcp_into(root_p / "legit" / STEP_DIR, model, opt)["step"] == 1  # legitimate: loads
        ref = torch.load(root_p / "reference.pt", weights_only=True)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ref["model"].items())
        for case in ("metadata", "bytes"):
            model, opt = _trained(seed=1)
            try:
                load_dcp_into(root_p / case / STEP_DIR, model, opt)
            except CheckpointError as exc:
                assert "\n" not in str(exc) and "refused" in str(exc), str(exc)
            else:
                raise AssertionError(f"{case}: the crafted checkpoint loaded")
            assert not (root_p / "PWNED").exists()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_multi_process_resume_refuses_crafted_checkpoints(legit, tmp_path):
    marker = tmp_path / "PWNED"
    for case in ("legit", "metadata", "bytes"):
        shutil.copytree(legit / "run", tmp_path / case)
    shutil.copy(legit / "reference.pt", tmp_path / "reference.pt")
    (tmp_path / "metadata" / STEP_DIR / "dcp" / ".metadata").write_bytes(_payload_pickle(marker))
    bad = tmp_path / "bytes" / STEP_DIR
    state = read_dcp_full(bad / "dcp")
    state["optim"]["param_groups"][1]["betas"] = Payload(marker)
    shutil.rmtree(bad / "dcp")
    _dcp_save(state, bad / "dcp")
    torch.multiprocessing.spawn(_dist_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    assert not marker.exists()
