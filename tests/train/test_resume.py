"""Resume: a checkpoint whose trainer state cannot resume (optimizer state without its key, counters or
scheduler of another step, broken DCP metadata) is refused in one line and the previous checkpoint is
used, bit-exactly; ``--resume`` keeps the run's own step count unless one is given and takes the token
cache directory from the command; a run whose every step was skipped as non-finite saves nothing.

The failures guarded against: a trainer_state.pt without "optimizer" ends the resume in a KeyError
traceback (no fallback), resuming without --max-steps silently retrains with the preset's step count
(another LR schedule), and an all-skipped run exits 0 with a checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import MHMOE, assert_same_run, records, rehash, tiny_run

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.errors import CheckpointError
from mhmoe.loading.checkpoint import load_latest
from mhmoe.model.lm import LM
from mhmoe.parallel.checkpoint import save_dcp_checkpoint
from mhmoe.train.loop import LAUNCH_FIELDS, train
from mhmoe.train.resume import load_for_resume

NO_MAX_STEPS = tuple(f for f in LAUNCH_FIELDS if f != "max_steps")  # what the CLI passes without --max-steps


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("full")
    train(tiny_run(root, MHMOE, ckpt_every=2, keep_last=3), root / "run", progress=False)
    return root


@pytest.fixture
def stopped(full, tmp_path) -> Path:
    """The same run stopped after step 4 (checkpoints at 2 and 4)."""
    train(tiny_run(full, MHMOE, ckpt_every=2, keep_last=3), tmp_path / "run", progress=False, stop_after=4)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000002", "step_00000004"]
    return tmp_path / "run"


def _edit_state(ck: Path, edit) -> None:
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    edit(state)
    torch.save(state, ck / "trainer_state.pt")
    rehash(ck)


@pytest.mark.parametrize("damage", ["no-optimizer", "optimizer-no-state", "step-mismatch", "scheduler-step",
                                    "moment-shape", "rng"])
def test_a_state_that_cannot_resume_falls_back_to_the_previous_checkpoint(full, stopped, capsys, damage):
    ck = list_checkpoints(stopped)[-1]

    def edit(st):
        if damage == "no-optimizer":
            del st["optimizer"]
        elif damage == "optimizer-no-state":
            del st["optimizer"]["state"]
        elif damage == "step-mismatch":
            st["step"] = 3
        elif damage == "scheduler-step":
            st["scheduler"]["last_epoch"] = 7
        elif damage == "moment-shape":
            st["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
        else:
            st["rng_cpu"] = torch.zeros(5, dtype=torch.uint8)

    _edit_state(ck, edit)
    assert load_latest(stopped, warn=False).step == 4  # eval and generate do not need the trainer state
    with pytest.raises(CheckpointError, match="trainer_state.pt") as info:
        load_for_resume(ck)
    assert "\n" not in str(info.value)
    capsys.readouterr()
    train(tiny_run(full, MHMOE, ckpt_every=2, keep_last=3), stopped, resume=True, progress=False)
    err = capsys.readouterr().err
    assert "step_00000004: trainer_state.pt" in err and "falling back to the previous checkpoint" in err
    assert "from step 2" in err
    assert_same_run(full / "run", stopped)


def test_broken_dcp_metadata_falls_back_to_the_older_checkpoint(full, tmp_path, capsys):
    """A sharded (DCP) newest checkpoint whose .metadata is damaged: eval / resume use the older one."""
    run = tmp_path / "run"
    shutil.copytree(full / "run", run)
    older = load_latest(run)
    model = LM(older.run.model)
    from mhmoe.train.optim import build_optimizer

    opt = build_optimizer(model, older.run.train)
    save_dcp_checkpoint(run, 7, model, opt, older.run, older.tokenizer, older.trainer_state, keep_last=5,
                        no_dist=True)
    md = run / "checkpoints" / "step_00000007" / "dcp" / ".metadata"
    md.write_bytes(md.read_bytes()[: len(md.read_bytes()) // 2])  # truncated pickle
    rehash(md.parent.parent)
    ck = load_latest(run)
    assert ck.step == 6
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "step_00000007" in err and "falling back" in err


def test_resume_keeps_the_runs_step_count_unless_given(full, stopped):
    """The CLI without --max-steps passes launch fields without max_steps: the run keeps its own 6 steps
    (and LR schedule) even though the command's config says 50."""
    longer = tiny_run(full, MHMOE, ckpt_every=2, keep_last=3, max_steps=50)
    res = train(longer, stopped, resume=True, progress=False, launch_fields=NO_MAX_STEPS)
    assert res.step == 6
    assert_same_run(full / "run", stopped)
    res = train(tiny_run(full, MHMOE, ckpt_every=2, keep_last=3, max_steps=8), stopped, resume=True, progress=False)
    assert res.step == 8  # given: extended


def test_resume_takes_the_cache_directory_from_the_command(full, stopped, tmp_path):
    """data.cache_dir is where this machine keeps token caches: a checkpoint (perhaps downloaded) never
    decides where a resumed run writes."""
    here = tmp_path / "my-cache"
    run = tiny_run(full, MHMOE, ckpt_every=2, keep_last=3).with_overrides([f"data.cache_dir={here}"])
    train(run, stopped, resume=True, progress=False)
    assert any(here.rglob("*.bin"))
    assert load_latest(stopped).run.data.cache_dir == str(here)


def test_a_run_whose_every_step_was_skipped_saves_nothing(tmp_path, monkeypatch):
    original = LM.forward

    def nan_loss(self, idx, targets=None, *args, **kwargs):
        out = original(self, idx, targets, *args, **kwargs)
        if targets is not None and self.training:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(LM, "forward", nan_loss)
    with pytest.raises(RuntimeError, match="all 3 steps were skipped as non-finite"):
        train(tiny_run(tmp_path, MHMOE, max_steps=3, max_nan_skips=10), tmp_path / "r", progress=False)
    assert list_checkpoints(tmp_path / "r") == [] and not (tmp_path / "r" / "results.json").exists()
    assert records(tmp_path / "r") == []


def test_activation_checkpointing_trains_the_same_run_and_may_change_on_resume(full, stopped, tmp_path):
    """A run recomputing its MoE layers equals the run that keeps every activation, bit for bit; a run stopped
    without it and resumed recomputing every block does too, and its checkpoint records the launch's setting."""
    train(tiny_run(full, MHMOE, ckpt_every=2, keep_last=3, activation_checkpointing="moe"), tmp_path / "moe",
          progress=False)
    assert_same_run(full / "run", tmp_path / "moe")
    blocks = tiny_run(full, MHMOE, ckpt_every=2, keep_last=3, activation_checkpointing="blocks")
    train(blocks, stopped, resume=True, progress=False)
    assert_same_run(full / "run", stopped)
    assert load_latest(stopped).run.train.activation_checkpointing == "blocks"
