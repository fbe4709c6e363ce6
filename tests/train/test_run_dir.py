"""The run directory: one writer at a time (an exclusive lock, refused with one line and exit status 2
for a second training, released on exit, taken over from a process that died holding it), ``--out``
that is a file, ``--resume`` into a directory that does not exist, and the hidden temporary
checkpoint directories a killed run leaves behind.

Without the lock, two trainings into the same ``--out`` both "succeed": the checkpoints and results
are the second one's and metrics.jsonl interleaves both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MHMOE, assert_same_run, records, run_messages, sigint_default, tiny_run

import mhmoe
from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.train.lock import LOCK_FILE, RunDirLock
from mhmoe.train.loop import train

SRC = Path(mhmoe.__file__).resolve().parents[1]  # subprocesses run the sources this test imported


def _spawn(config: Path, out: Path, *extra: str) -> subprocess.Popen:
    """``python -m mhmoe train --config CONFIG --out OUT ...`` in a new process (this checkout's sources)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "mhmoe", "train", "--config", str(config), "--out", str(out),
                             "--no-progress", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=sigint_default)  # it gets a Ctrl-C


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 180.0) -> None:
    """Until the training ``proc`` has logged ``n`` steps into ``out`` (it holds the lock by then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the training ended early ({proc.returncode}): {proc.communicate()[1]}")
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the training logged nothing in time")


@pytest.fixture
def config(tmp_path) -> Path:
    """A tiny run that trains ~forever (until interrupted), logging every step."""
    path = tmp_path / "tiny.yaml"
    path.write_text(tiny_run(tmp_path, MHMOE, max_steps=100_000, log_every=1, warmup_steps=0).to_yaml())
    return path


def test_two_trainings_into_one_run_directory(config, tmp_path):
    """Two ``mhmoe train`` processes started together into one --out: the one that takes the lock trains,
    the other exits 2 at once with one line naming the holder; Ctrl-C then ends the first cleanly."""
    out = tmp_path / "run"
    procs = [_spawn(config, out), _spawn(config, out)]
    try:
        deadline = time.monotonic() + 180
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        loser = next(p for p in procs if p.poll() is not None)
        first = next(p for p in procs if p is not loser)
        _, err = loser.communicate()
        assert loser.returncode == 2, err
        assert err.count("\n") == 1 and err.startswith("mhmoe train: error: invalid --out="), err
        assert f"locked by process {first.pid} on " in err and "choose another --out" in err
        _wait_for_steps(first, out, 2)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=180)
    finally:
        for p in procs:
            p.kill()
    assert first.returncode == 130, err
    lines = run_messages(err)
    assert len(lines) == 1 and lines[0].startswith("mhmoe train: interrupted (SIGINT) at step "), err
    step = int(lines[0].split(" at step ")[1].split(":")[0])
    assert [p.name for p in list_checkpoints(out)] == [f"step_{step:08d}"]
    assert [r["step"] for r in records(out)] == list(range(1, step + 1))  # one writer: no interleaving
    assert not (out / LOCK_FILE).exists()  # released on exit
    res = train(tiny_run(tmp_path, MHMOE, max_steps=step + 2, log_every=1, warmup_steps=0), out, resume=True,
                progress=False)
    assert res.step == step + 2


def test_a_killed_training_leaves_a_lock_the_next_run_takes_over(config, tmp_path, capsys):
    """kill -9 of a real training: the next run takes the lock over (one note) and resumes bit for bit:
    the metrics and weights equal those of an uninterrupted run stopped at the same step."""
    out = tmp_path / "run"
    proc = _spawn(config, out, "--set", "train.ckpt_every=2")
    try:
        _wait_for_steps(proc, out, 3)
        proc.kill()  # kill -9: no handler runs, the lock file keeps the dead process's record
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == proc.pid
    step = int(list_checkpoints(out)[-1].name.split("_")[1])
    run = RunConfig.load(config).with_overrides(["train.ckpt_every=2"])
    stop = step + 3
    train(run, out, resume=True, progress=False, stop_after=stop)
    assert f"locked by process {proc.pid} on " in capsys.readouterr().err  # the note: taken over
    assert not (out / LOCK_FILE).exists()
    train(run, tmp_path / "reference", progress=False, stop_after=stop)
    assert_same_run(tmp_path / "reference", out)


def test_lock_in_process(tmp_path, capsys):
    out = tmp_path / "r"
    with RunDirLock(out) as held:
        assert held.fd is not None and json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=f"locked by process {os.getpid()} ") as info:
            with RunDirLock(out):
                pass
        assert info.value.field == "--out"
        with pytest.raises(ConfigError, match="locked by"):  # and training refuses it
            train(tiny_run(tmp_path, MHMOE), out, progress=False)
    assert not out.exists()  # created by the lock, nothing written: removed again
    assert capsys.readouterr().err == ""


def test_out_that_is_a_file_and_resume_into_nothing_are_one_line_errors(tmp_path):
    run = tiny_run(tmp_path, MHMOE, max_steps=2)
    (tmp_path / "file").write_text("my notes\n")
    with pytest.raises(ConfigError, match="this path is a file"):
        train(run, tmp_path / "file", progress=False)
    assert (tmp_path / "file").read_text() == "my notes\n"
    with pytest.raises(ConfigError, match="does not exist"):
        train(run, tmp_path / "nothing", resume=True, progress=False)
    assert not (tmp_path / "nothing").exists()


def test_failed_start_leaves_no_directory(tmp_path):
    """A run that fails before writing anything (here: a corpus that does not exist) leaves no --out."""
    run = tiny_run(tmp_path, MHMOE).with_overrides([f"data.corpus={tmp_path / 'missing.txt'}"])
    with pytest.raises(ValueError, match="missing.txt"):
        train(run, tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_stale_temporary_checkpoints_are_removed_on_start(tmp_path):
    """``.tmp-step_*`` directories are what a kill during a checkpoint save leaves; the next run on the
    directory (holding its lock) removes them; real checkpoints stay."""
    run = tiny_run(tmp_path, MHMOE, max_steps=2)
    train(run, tmp_path / "r", progress=False)
    ckpts = tmp_path / "r" / "checkpoints"
    for name in (".tmp-step_00000003-4242", ".tmp-step_00000004-dcp"):
        (ckpts / name).mkdir()
        (ckpts / name / "model.safetensors").write_bytes(b"half written")
    train(tiny_run(tmp_path, MHMOE, max_steps=3), tmp_path / "r", resume=True, progress=False)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000003"]
