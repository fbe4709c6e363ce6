"""Hard links, FIFOs, devices and directories planted where a run writes or reads: every path is
checked for what it is before the first step. A hard-linked victim is never opened for writing (files
are replaced by rename; an append or the lock refuses a file with more than one link), FIFOs, devices
and directories are refused in one line naming them (never blocked on, never read), a ``.lock`` that is
not a file of its own refuses to train (never an unlocked run), and a symlinked log is not read.

Before: a hard link at ``.lock`` was truncated and written through (its victim emptied, exit 0); a FIFO
at metrics.jsonl made ``--resume`` block forever; ``metrics.jsonl -> /dev/zero`` was read until memory
ran out; a FIFO or a directory at ``.lock`` trained unlocked with a warning; ``RUN/checkpoints`` as a
file failed at the first save with a bare ``[Errno 20]``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import MHMOE, records, tiny_run

from mhmoe.cli import main
from mhmoe.errors import UnsafePathError
from mhmoe.runtime.files import atomic_write, open_append
from mhmoe.train.loop import train

SECRET = "the user's own file\n"


@pytest.fixture(scope="module")
def run2(tmp_path_factory) -> tuple[Path, Path]:
    """A run trained to step 2 with a checkpoint (copied per test) and its root."""
    root = tmp_path_factory.mktemp("special")
    train(tiny_run(root, MHMOE, max_steps=2), root / "run", progress=False)
    return root, root / "run"


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text(SECRET)
    return v


def _refused(exc: pytest.ExceptionInfo, path: Path, what: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and what in msg, msg


def test_a_hard_link_at_the_lock_is_refused_and_never_written(run2, tmp_path):
    root, run = run2
    victim = _victim(tmp_path)
    for resume in (False, True):
        r = shutil.copytree(run, tmp_path / f"r{resume}") if resume else tmp_path / "fresh"
        r.mkdir(exist_ok=True)
        os.link(victim, r / ".lock")
        with pytest.raises(UnsafePathError) as info:
            train(tiny_run(root, MHMOE, max_steps=4), r, resume=resume, progress=False)
        _refused(info, r / ".lock", "hard links; mhmoe does not write")
        assert victim.read_text() == SECRET  # before: truncated to the lock record, then emptied


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_file_refuses_to_train(run2, tmp_path, kind):
    root, _ = run2
    r = tmp_path / "r"
    r.mkdir()
    (os.mkfifo if kind == "fifo" else os.mkdir)(r / ".lock")
    with pytest.raises(UnsafePathError) as info:  # before: a warning, and the run trained unlocked
        train(tiny_run(root, MHMOE, max_steps=2), r, progress=False)
    _refused(info, r / ".lock", "not a regular file")
    assert sorted(os.listdir(r)) == [".lock"]


@pytest.mark.parametrize("name, kind", [("metrics.jsonl", "fifo"), ("eval.jsonl", "fifo"), ("results.json", "fifo"),
                                        ("config.yaml", "directory"), ("checkpoints", "file"), ("tb", "file")])
def test_special_files_where_a_run_writes_are_refused_before_the_first_step(run2, tmp_path, name, kind):
    """A FIFO at a log would have blocked ``--resume`` forever (its read) or the first log line (its
    open); a file at ``checkpoints`` failed hours later at the first save."""
    root, run = run2
    r = shutil.copytree(run, tmp_path / "r")
    shutil.rmtree(r / name) if (r / name).is_dir() else (r / name).unlink()
    {"fifo": os.mkfifo, "directory": os.mkdir, "file": lambda p: p.write_text(SECRET)}[kind](r / name)
    with pytest.raises(UnsafePathError) as info:
        train(tiny_run(root, MHMOE, max_steps=4), r, resume=True, progress=False)
    _refused(info, r / name, "is a FIFO" if kind == "fifo" else "is a directory" if kind == "directory"
             else "is a regular file, where mhmoe writes a directory")
    assert not (r / "checkpoints" / "step_00000004").exists()  # nothing trained (the FIFO is never opened here)


def test_hard_links_at_run_files_are_replaced_never_written_through(run2, tmp_path):
    root, run = run2
    victims = {}
    r = shutil.copytree(run, tmp_path / "r")
    for name in ("metrics.jsonl", "eval.jsonl", "results.json", "curves.png"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text(SECRET)
        (r / name).unlink()
        os.link(victims[name], r / name)
    res = train(tiny_run(root, MHMOE, max_steps=4), r, resume=True, progress=False)
    assert res.step == 4
    for name, v in victims.items():
        assert v.read_text() == SECRET, name
        assert os.stat(r / name).st_nlink == 1, name


def test_a_symlinked_log_is_not_read(run2, tmp_path, capsys):
    """metrics.jsonl -> /dev/zero (before: read until memory ran out) and -> a file of someone else's
    lines (before: copied into the run) are not read; the log is replaced."""
    root, run = run2
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"step": 1, "loss": 123.0}\n{"step": 2, "loss": 456.0}\n')
    r = shutil.copytree(run, tmp_path / "r")
    (r / "metrics.jsonl").unlink()
    (r / "metrics.jsonl").symlink_to("/dev/zero")
    (r / "eval.jsonl").unlink()
    (r / "eval.jsonl").symlink_to(foreign)
    train(tiny_run(root, MHMOE, max_steps=4), r, resume=True, progress=False)
    assert "metrics.jsonl is a symlink: not read" in capsys.readouterr().err
    assert [x["step"] for x in records(r)] == [3, 4] and 456.0 not in [x.get("loss") for x in records(r, "eval.jsonl")]
    assert foreign.read_text().count("\n") == 2


def test_appends_and_atomic_writes_check_their_target(tmp_path):
    victim = _victim(tmp_path)
    os.link(victim, tmp_path / "metrics.jsonl")
    with pytest.raises(UnsafePathError) as info:
        open_append(tmp_path / "metrics.jsonl")
    _refused(info, tmp_path / "metrics.jsonl", "has 2 hard links")
    os.mkfifo(tmp_path / "eval.jsonl")  # no reader: an O_WRONLY open would block
    with pytest.raises(UnsafePathError) as info:
        open_append(tmp_path / "eval.jsonl")
    _refused(info, tmp_path / "eval.jsonl", "is a FIFO")
    atomic_write(tmp_path / "metrics.jsonl", "new\n")  # a hard link is replaced by the rename
    assert victim.read_text() == SECRET and (tmp_path / "metrics.jsonl").read_text() == "new\n"
    with pytest.raises(UnsafePathError, match="is a FIFO"):
        atomic_write(tmp_path / "eval.jsonl", "x")
    (tmp_path / "d").mkdir()
    with pytest.raises(UnsafePathError, match="is a directory"):
        atomic_write(tmp_path / "d", "x")


def test_special_config_and_cache_paths_are_one_line_errors(run2, tmp_path, capsys):
    """``--config /dev/zero`` (before: read whole, out of memory), a FIFO (before: blocked), a
    directory; ``data.cache_dir`` that cannot be created (before: a bare ``[Errno 2]``)."""
    root, _ = run2
    os.mkfifo(tmp_path / "fifo.yaml")
    for config, what in (("/dev/zero", "is a character device"), (tmp_path / "fifo.yaml", "is a FIFO"),
                         (tmp_path, "is a directory")):
        assert main(["train", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and str(config) in err and what in err, err
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run(root, MHMOE, max_steps=2).to_yaml())
    (tmp_path / "afile").write_text("x")
    for cache, what in (("/proc/x", "No such file or directory"), (str(tmp_path / "afile"), "it is a regular file")):
        assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress", "--set",
                     f"data.cache_dir={cache}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"invalid data.cache_dir='{cache}'" in err and what in err, err


def test_fifos_in_checkpoint_and_saved_directories_are_refused_not_waited_on(tmp_path):
    """meta.json of a checkpoint and config.json of a saved model directory are downloaded content: a
    FIFO there made every loader wait forever."""
    from mhmoe.checkpoint.write import save_checkpoint
    from mhmoe.config.model import ModelConfig
    from mhmoe.config.run import RunConfig
    from mhmoe.config.train import TrainConfig
    from mhmoe.data.tokenizer import ByteTokenizer
    from mhmoe.errors import CheckpointError
    from mhmoe.loading.checkpoint import load_checkpoint
    from mhmoe.model.lm import LM

    cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=4, d_ff=32, max_seq_len=16)
    model = LM(cfg)
    ck = save_checkpoint(tmp_path / "run", 1, model, RunConfig(model=cfg, train=TrainConfig(seq_len=16)),
                         ByteTokenizer(), {"step": 1})
    (ck / "meta.json").unlink()
    os.mkfifo(ck / "meta.json")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ck)
    _refused(info, ck / "meta.json", "is a FIFO")
    saved = model.save_pretrained(tmp_path / "saved")
    (saved / "config.json").unlink()
    os.mkfifo(saved / "config.json")
    with pytest.raises(CheckpointError) as info:  # not a saved directory (its config.json is no file): one line
        LM.from_pretrained(saved)
    _refused(info, saved, "")
