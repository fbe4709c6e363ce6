"""``mhmoe train --branch-from``: another run continued from one of its checkpoints into a new directory (that run
untouched), with the launch fields and the schedule's shape from the command; and the lr of a resumed run's first
step from the schedule it resumes with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import MHMOE, records, tiny_run

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.cli import main
from mhmoe.config.run import RunConfig
from mhmoe.loading.checkpoint import load_latest
from mhmoe.train import train
from mhmoe.train.optim import lr_lambda


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def _source(tmp_path: Path, **kw) -> tuple[Path, RunConfig]:
    run = tiny_run(tmp_path, MHMOE, ckpt_every=3, keep_last=5, eval_every=0, **kw)
    config = tmp_path / "run.yaml"
    config.write_text(run.to_yaml())
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    return tmp_path / "a", run


def test_a_branch_with_the_runs_own_config_reproduces_its_continuation_and_leaves_it_untouched(tmp_path, capsys):
    a, _ = _source(tmp_path)
    before = _tree(a)
    step3 = list_checkpoints(a)[0]
    assert step3.name == "step_00000003"
    assert main(["train", "--branch-from", str(step3), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "branching from step 3" in err and "(branched at step 3)" in err
    assert _tree(a) == before  # the source run is read, never written
    b = tmp_path / "b"
    assert [c.name for c in list_checkpoints(b)] == ["step_00000003", "step_00000006"]  # the branch point first
    mine, theirs = RunConfig.load(b / "config.yaml").to_dict(), RunConfig.load(a / "config.yaml").to_dict()
    assert theirs["data"].pop("cache_dir") and mine["data"].pop("cache_dir") == ""  # this machine's cache, not theirs
    assert mine == theirs
    assert [r["loss"] for r in records(b)] == [r["loss"] for r in records(a) if r["step"] > 3]  # bit for bit
    wa, wb = load_latest(a).model.state_dict(), load_latest(b).model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_wsd_cooldown_branched_from_the_stable_phase_follows_the_new_schedule(tmp_path):
    a, run = _source(tmp_path, schedule="wsd", max_steps=9, cooldown_fraction=0.2, warmup_steps=1)
    out = tmp_path / "cool"
    assert main(["train", "--branch-from", str(a / "checkpoints" / "step_00000006"), "--out", str(out),
                 "--max-steps", "8", "--set", "train.cooldown_fraction=0.25", "--set", "train.cooldown_shape=linear",
                 "--no-progress"]) == 0
    branched = RunConfig.load(out / "config.yaml").train
    assert (branched.max_steps, branched.cooldown_fraction, branched.cooldown_shape) == (8, 0.25, "linear")
    f = lr_lambda(branched)
    logged = {r["step"]: r["lr"] for r in records(out)}
    assert sorted(logged) == [7, 8]
    for step, lr in logged.items():  # step s was optimizer step s - 1; the first one included
        assert lr == pytest.approx(run.train.lr * f(step - 1), rel=1e-6)
    assert logged[7] == pytest.approx(run.train.lr) and logged[8] == pytest.approx(run.train.lr * 0.5)


def test_a_resume_with_more_steps_takes_its_first_lr_from_the_new_schedule(tmp_path):
    run = tiny_run(tmp_path, MHMOE, max_steps=4, warmup_steps=1, schedule="linear")
    train(run, tmp_path / "r", progress=False, stop_after=2)
    longer = run.with_overrides(["train.max_steps=8"])
    train(longer, tmp_path / "r", resume=True, progress=False)
    f = lr_lambda(longer.train)
    third = next(r for r in records(tmp_path / "r") if r["step"] == 3)
    assert third["lr"] == pytest.approx(run.train.lr * f(2), rel=1e-6)  # 4-step schedule: lr * f4(2) = 0.33 lr


@pytest.mark.parametrize("argv,needle", [
    (["--set", "model.n_layers=3"], "model.n_layers=3"),
    (["--lr", "0.5"], "train.lr=0.5"),
    (["--resume"], "--resume"),
])
def test_what_a_branch_cannot_change_is_refused_in_one_line(tmp_path, capsys, argv, needle):
    a, _ = _source(tmp_path)
    capsys.readouterr()
    assert main(["train", "--branch-from", str(a), "--out", str(tmp_path / "b"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err
    assert not (tmp_path / "b").exists()


def test_a_branch_into_another_run_is_refused(tmp_path, capsys):
    a, _ = _source(tmp_path)
    capsys.readouterr()
    assert main(["train", "--branch-from", str(a), "--out", str(a), "--no-progress"]) == 2
    assert "a new directory for --branch-from" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # what the run is: a preset, a config or a branch, one of them
        main(["train", "--branch-from", str(a), "--preset", "tiny-smoe", "--out", str(tmp_path / "c")])
    assert exc.value.code == 2
    assert json.loads((a / "results.json").read_text())["step"] == 6
