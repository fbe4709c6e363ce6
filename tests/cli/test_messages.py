"""One-line errors that name the file (or the field) and its problem, for the inputs an adversarial run
found unclear: ``make-tasks FILE`` (was ``[Errno 17]``), a seed beyond 64 bits (was "Overflow when
unpacking long long") or below 0 for ``generate`` (accepted, while ``train`` refuses it), ``RUN/checkpoints``
as a file (was ``[Errno 20]`` at the first save). ``data.cache_dir=/proc/x`` and config.yaml linked to
another file: tests/train/test_special_files.py and tests/train/test_resume_identity.py."""

from __future__ import annotations

import pytest

from mhmoe.cli import main


def _one_line(capsys, *parts: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err
    return err


def test_make_tasks_into_a_file_names_it(tmp_path, capsys):
    f = tmp_path / "tasks"
    f.write_text("mine\n")
    assert main(["make-tasks", str(f)]) == 2
    _one_line(capsys, f"invalid OUT='{f}'", "this path exists and is not a directory")
    assert f.read_text() == "mine\n"


@pytest.mark.parametrize("seed", ["-1", str(2**63), "99999999999999999999999"])
def test_generate_refuses_seeds_train_refuses(tmp_path, capsys, seed):
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x", "--seed", seed]) == 2
    _one_line(capsys, f"invalid --seed={seed}", "0..2**63-1")
    assert main(["train", "--out", str(tmp_path / "o"), "--seed", seed]) == 2
    _one_line(capsys, "invalid train.seed")


def test_a_file_at_run_checkpoints_is_named_before_training(tmp_path, capsys):
    from helpers import MHMOE, tiny_run

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run(tmp_path, MHMOE, max_steps=2).to_yaml())
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoints").write_text("not a directory\n")
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    _one_line(capsys, f"{tmp_path / 'r' / 'checkpoints'}: is a regular file, where mhmoe writes a directory")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_reader_that_went_away_ends_the_command_quietly():
    """``mhmoe presets | head -1``: the pipe's reader is gone before the command writes; exit 141, no message
    (a real process: the interpreter's last flush of stdout must not fail again either)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mhmoe

    read, write = os.pipe()
    os.close(read)  # the reader went away: every write to the pipe fails with EPIPE (Python ignores SIGPIPE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(mhmoe.__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-m", "mhmoe", "presets"], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_another_broken_pipe_is_an_error_of_one_line(monkeypatch, capsys):
    """A pipe of the command's own breaking (stdout still has its reader) is not taken for ``| head``."""
    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("mhmoe.cli.plan._run_presets", broken)
    assert main(["presets"]) == 2
    _one_line(capsys, "mhmoe presets: error:", "Broken pipe")
