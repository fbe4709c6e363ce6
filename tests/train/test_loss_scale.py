"""float16 training (mhmoe.train.loss_scale): GradScaler's rule on the device, the gradients the optimizer sees are
unscaled (the float32 run's, to float16 rounding), a gradient overflow at a finite loss skips the step and halves
the scale without counting as a non-finite loss (however many in a row, up to a limit), the scale is checkpointed
and resumes bit for bit, a malformed saved scale is refused, and FSDP2 is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import MHMOE, assert_same_run, records, tiny_run

from mhmoe.checkpoint.read import check_trainer_state
from mhmoe.config.train import TrainConfig
from mhmoe.errors import CheckpointError, ConfigError, TrainingStopped
from mhmoe.train import loop, loss_scale
from mhmoe.train.loop import Trainer, train
from mhmoe.train.loss_scale import LossScale
from mhmoe.train.parallelism import SingleProcess

CPU = torch.device("cpu")


def test_the_rule_grows_after_an_interval_of_finite_steps_and_halves_on_overflow():
    ls = LossScale(CPU, enabled=True, init=8.0, interval=3)
    yes, no = torch.tensor(True), torch.tensor(False)
    seen = []
    for finite in (yes, yes, yes, yes, no, yes, yes, yes):
        ls.update(finite)
        seen.append((float(ls.scale), int(ls.finite_run)))
    assert seen == [(8, 1), (8, 2), (16, 0), (16, 1), (8, 0), (8, 1), (8, 2), (16, 0)]
    p = torch.nn.Parameter(torch.ones(3))
    loss = (p * 2).sum()
    ls.scaled(loss).backward()
    assert torch.equal(p.grad, torch.full((3,), 32.0))
    ls.unscale_([p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    other = LossScale(CPU, enabled=True)
    other.load_state_dict(ls.state_dict())
    assert float(other.scale) == 16 and int(other.finite_run) == 0
    off = LossScale(CPU, enabled=False)
    off.update(no)
    assert off.scaled(loss) is loss and float(off.scale) == loss_scale.INIT_SCALE


def _first_grad_norm(tmp_path, dtype: str) -> float:
    run = tiny_run(tmp_path, MHMOE, dtype=dtype, max_steps=3)
    trainer = Trainer(run, tmp_path / dtype, resume=False, progress=False, stop_after=None,
                      parallelism=SingleProcess(CPU))
    return float(trainer.train_step(0).grad_norm)


def test_the_optimizer_sees_unscaled_gradients(tmp_path):
    fp16, fp32 = _first_grad_norm(tmp_path, "float16"), _first_grad_norm(tmp_path, "float32")
    assert fp16 == pytest.approx(fp32, rel=2e-2)


@pytest.fixture
def huge_scale(monkeypatch):
    """The first steps overflow: the scale starts at 2**40 and halves until the gradients fit in float16."""
    monkeypatch.setattr(loss_scale, "INIT_SCALE", 2.0**40)


def test_overflows_skip_steps_without_counting_as_non_finite(tmp_path, huge_scale, capsys):
    res = train(tiny_run(tmp_path, MHMOE, dtype="float16", max_steps=30), tmp_path / "r", progress=False)
    summary = json.loads((tmp_path / "r" / "results.json").read_text())
    skips = summary["scale_skips"]
    assert skips > TrainConfig().max_nan_skips and summary["nan_skips"] == 0 and res.step == 30
    assert summary["loss_scale"] == 2.0 ** (40 - skips)  # halved once per overflow, never grown (interval 2000)
    recs = records(tmp_path / "r")
    assert len(recs) == 30 - skips and recs[-1]["tokens"] == (30 - skips) * 4 * 32
    assert recs[-1]["scale_skips"] == skips and recs[0]["step"] == skips + 1
    assert "warning" not in capsys.readouterr().err


def test_overflows_that_never_end_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(loss_scale, "INIT_SCALE", 2.0**100)
    monkeypatch.setattr(loop, "MAX_SCALE_SKIPS", 4)
    with pytest.raises(TrainingStopped, match="5 float16 gradient overflows in a row"):
        train(tiny_run(tmp_path, MHMOE, dtype="float16", max_steps=8), tmp_path / "r", progress=False)


def test_the_scale_resumes_bit_for_bit(tmp_path, huge_scale):
    run = tiny_run(tmp_path, MHMOE, dtype="float16", max_steps=30, ckpt_every=10, keep_last=5)
    train(run, tmp_path / "full", progress=False)
    train(run, tmp_path / "stopped", progress=False, stop_after=20)
    from mhmoe.loading.checkpoint import load_latest

    state = load_latest(tmp_path / "stopped").trainer_state
    assert float(state["loss_scale"]["scale"]) < 2.0**40 and state["scale_skips"] > 0
    train(run, tmp_path / "stopped", resume=True, progress=False)
    assert_same_run(tmp_path / "full", tmp_path / "stopped")


@pytest.mark.parametrize("bad", [
    {"scale": torch.tensor(-1.0), "finite_run": torch.tensor(0)},
    {"scale": torch.tensor(float("inf")), "finite_run": torch.tensor(0)},
    {"scale": torch.tensor(2.0, dtype=torch.float64), "finite_run": torch.tensor(0)},
    {"scale": torch.ones(2), "finite_run": torch.tensor(0)},
    {"scale": torch.tensor(2.0), "finite_run": torch.tensor(-3)},
    {"scale": torch.tensor(2.0)},
    {"scale": 2.0, "finite_run": 0},
    [1, 2],
], ids=["negative", "inf", "float64", "vector", "negative-run", "missing", "numbers", "list"])
def test_a_malformed_saved_scale_is_refused(tmp_path, bad):
    state = {"step": 3, "nan_total": 0, "tokens_seen": 1, "train_s": 1.0, "scheduler": {"last_epoch": 3},
             "rng_cpu": torch.get_rng_state()}
    assert check_trainer_state(tmp_path, {**state, "loss_scale": {"scale": torch.tensor(4.0),
                                                                   "finite_run": torch.tensor(2)}}, 3, False)
    with pytest.raises(CheckpointError, match="malformed loss scale"):
        check_trainer_state(tmp_path, {**state, "loss_scale": bad}, 3, False)
    with pytest.raises(CheckpointError, match="scale_skips"):
        check_trainer_state(tmp_path, {**state, "scale_skips": -1}, 3, False)


def test_float16_with_fsdp_is_refused():
    with pytest.raises(ConfigError, match="train.dtype.*fsdp"):
        TrainConfig(dtype="float16", parallel="fsdp")
    assert TrainConfig(dtype="float16", parallel="ddp").dtype == "float16"
