"""A resume never changes what the run is. A run killed (``kill -9``) before its first checkpoint, or
during its first save, holds its ``config.yaml`` and no checkpoint: ``mhmoe train --out RUN --resume``
(no ``--config``) trains that config from step 0, says so, leaves ``config.yaml`` as it was, and ends
with the same run as one never interrupted. Without a checkpoint and a config.yaml it refuses in one
line (unless the run is named); a resume of a finished run logs nothing twice.

Before: the resume trained the default preset (tiny-mh3 on kjv, 200 steps) and replaced the run's
config.yaml with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MHMOE, assert_same_run, records, tiny_run

import mhmoe
from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.cli import main
from mhmoe.config.run import RunConfig
from mhmoe.train.loop import train

SRC = Path(mhmoe.__file__).resolve().parents[1]
# the child dies by kill -9 at the named point: before the first checkpoint is written, or inside its
# save (the staging directory complete, meta.json written, not yet renamed into place)
KILL_AT = {
    "before-first-checkpoint": "mhmoe.train.loop.Trainer.save",
    "during-first-save": "mhmoe.checkpoint.format.publish_dir",
}
CHILD = """
import importlib, os, signal, sys
module, name = sys.argv[1].rsplit(".", 1)
owner = importlib.import_module(module) if "Trainer" not in module else None
if owner is None:  # a method: mhmoe.train.loop.Trainer.save
    mod, cls = module.rsplit(".", 1)
    owner = getattr(importlib.import_module(mod), cls)
setattr(owner, name, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
from mhmoe.cli import main
sys.exit(main(["train", "--config", sys.argv[2], "--out", sys.argv[3], "--no-progress"]))
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The two killed runs (trained in parallel child processes) and an uninterrupted one."""
    root = tmp_path_factory.mktemp("killed")
    run = tiny_run(root, MHMOE, max_steps=4, ckpt_every=2, log_every=1)
    config = root / "tiny.yaml"
    config.write_text(run.to_yaml())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = {case: subprocess.Popen([sys.executable, "-c", CHILD, where, str(config), str(root / case)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, where in KILL_AT.items()}
    train(run, root / "full", progress=False)
    for case, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -9, (case, proc.returncode, err[-3000:])
    return root


@pytest.mark.parametrize("case", list(KILL_AT))
def test_a_run_killed_before_its_first_checkpoint_resumes_its_own_config(killed, tmp_path, case, capsys):
    import shutil

    r = shutil.copytree(killed / case, tmp_path / "r")
    saved = (r / "config.yaml").read_bytes()
    assert not list_checkpoints(r) and records(r), "the kill left logged steps and no checkpoint"
    assert bool(list((r / "checkpoints").glob(".tmp-*"))) == (case == "during-first-save")
    # no --config, no --preset: the run is what its config.yaml says (threads: a launch property)
    assert main(["train", "--out", str(r), "--resume", "--no-progress", "--set", "train.threads=1"]) == 0
    err = capsys.readouterr().err
    assert f"holds no checkpoint yet: starting its own {r / 'config.yaml'} from step 0" in err
    assert (r / "config.yaml").read_bytes() == saved  # never replaced
    assert RunConfig.load(list_checkpoints(r)[-1] / "config.yaml").name == "tiny-test"
    assert not list((r / "checkpoints").glob(".tmp-*"))
    assert_same_run(killed / "full", r)  # as if never interrupted (not the default preset: tiny-mh3, kjv)


def test_a_resume_with_nothing_to_resume_is_refused_unless_the_run_is_named(killed, tmp_path, capsys):
    r = tmp_path / "r"
    r.mkdir()
    assert main(["train", "--out", str(r), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no checkpoint and no config.yaml" in err and str(r) in err, err
    assert "--config or --preset" in err and not os.listdir(r)
    # named: the run starts from step 0 and says so
    assert main(["train", "--config", str(killed / "tiny.yaml"), "--out", str(r), "--resume", "--no-progress",
                 "--max-steps", "2"]) == 0
    assert "starting the given config from step 0" in capsys.readouterr().err
    assert [x["step"] for x in records(r)] == [1, 2]


def test_a_damaged_config_yaml_without_checkpoint_is_refused_not_replaced(killed, tmp_path, capsys):
    import shutil

    r = shutil.copytree(killed / "before-first-checkpoint", tmp_path / "r")
    victim = tmp_path / "victim.yaml"
    victim.write_text("the user's own file\n")
    (r / "config.yaml").unlink()
    (r / "config.yaml").symlink_to(victim)
    assert main(["train", "--out", str(r), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{r / 'config.yaml'}: is a symlink" in err, err
    (r / "config.yaml").unlink()
    (r / "config.yaml").write_text("just a string\n")  # e.g. what a link to another file held
    assert main(["train", "--out", str(r), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{r / 'config.yaml'}" in err and "this file holds a str" in err, err
    assert victim.read_text() == "the user's own file\n" and (r / "config.yaml").read_text() == "just a string\n"


def test_resuming_a_finished_run_logs_nothing_twice(killed, tmp_path, capsys):
    import shutil

    r = shutil.copytree(killed / "full", tmp_path / "r")
    before = {f: (r / f).read_text() for f in ("metrics.jsonl", "eval.jsonl", "config.yaml")}
    for _ in range(2):
        res = train(tiny_run(killed, MHMOE, max_steps=4), r, resume=True, progress=False)
        assert res.step == 4 and res.eval  # evaluated (results.json), not logged again
    assert {f: (r / f).read_text() for f in before} == before
    assert [x["step"] for x in records(r, "eval.jsonl")] == [4]
