"""Ctrl-C (SIGINT) and SIGTERM during training: the signal is delivered (a real ``os.kill`` of this
process) from inside every piece of an optimizer step and of the step-boundary work (data fetch,
forward, backward, gradient clipping, optimizer step, scheduler step, reading the step's finiteness,
logging, evaluation, checkpoint save). Every time, the run stops at the step boundary with a
checkpoint whose weights, optimizer, scheduler, RNG and counters are those of its step number, raises
``Interrupted`` (exit code 130 / 143), and resuming reproduces the uninterrupted run bit for bit.

The failure this guards against: a Ctrl-C raised right after the optimizer step saves the new weights
under the old step number (the resume then trains that step twice and diverges from the uninterrupted
run), and SIGTERM kills the process without saving.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import MHMOE, assert_same_run, records, tiny_run

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.data import BatchSampler
from mhmoe.loading.checkpoint import load_latest
from mhmoe.model.lm import LM
from mhmoe.runtime.signals import Interrupted, StopRequests
from mhmoe.train.loop import Trainer, train
from mhmoe.train.metrics import MetricsWriter
from mhmoe.train.parallelism import SingleProcess
from mhmoe.train.resume import load_latest_for_resume

pytestmark = pytest.mark.usefixtures("sigint_raises")  # the tests send SIGINT to this process

# steps 3 and 6 log, evaluate and (step 3) checkpoint; the signal arrives during step 3 (index 2)
CADENCE = dict(log_every=3, eval_every=3, ckpt_every=3)
SIGNAL_STEP = 2
SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143)}


def _pieces() -> dict[str, tuple[object, str]]:
    """Every place a signal can land: (owner, attribute) of the function that runs there."""
    return {
        "data": (BatchSampler, "get_batch"),
        "forward": (LM, "forward"),
        "backward": (torch.Tensor, "backward"),
        "clip": (SingleProcess, "finish_grads"),
        "optimizer": (SingleProcess, "optimizer_step"),
        "scheduler": (torch.optim.lr_scheduler.LambdaLR, "step"),
        "count_skipped_steps": (Trainer, "count_skipped_steps"),
        "log": (MetricsWriter, "log"),
        "eval": (Trainer, "evaluate"),
        "save": (SingleProcess, "save_checkpoint"),
    }


@pytest.fixture(autouse=True)
def _sigterm_raises():
    """Outside the training loop a SIGTERM must not kill pytest (the loop installs its own handler)."""
    def handler(signum, frame):
        raise Interrupted(signum)

    old = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one is compared with."""
    root = tmp_path_factory.mktemp("full")
    train(tiny_run(root, MHMOE, **CADENCE), root / "run", progress=False)
    return root


def _deliver_in(monkeypatch, piece: str, signum: int) -> dict:
    """Send ``signum`` to this process from inside ``piece`` (after it ran) during step SIGNAL_STEP, once."""
    owner, attr = _pieces()[piece]
    original, box = getattr(owner, attr), {"step": -1, "sent": False}
    train_step = Trainer.train_step

    def tracking(self, step):
        box["step"] = step
        return train_step(self, step)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        if box["step"] == SIGNAL_STEP and not box["sent"]:
            box["sent"] = True
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(Trainer, "train_step", tracking)
    monkeypatch.setattr(owner, attr, wrapped)
    return box


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("piece", list(_pieces()))
def test_signal_anywhere_in_a_step_saves_that_step_and_resumes_exactly(full, tmp_path, monkeypatch, piece, sig):
    signum, code = SIGNALS[sig]
    run = tiny_run(full, MHMOE, **CADENCE)
    box = _deliver_in(monkeypatch, piece, signum)
    with pytest.raises(Interrupted) as info:
        train(run, tmp_path / "int", progress=False)
    monkeypatch.undo()
    assert box["sent"], f"{piece} never ran during step {SIGNAL_STEP}"
    assert info.value.exit_code == code and info.value.signum == signum
    assert str(info.value) == f"interrupted ({sig}) at step 3: checkpoint saved (continue with --resume)"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert [p.name for p in list_checkpoints(tmp_path / "int")] == ["step_00000003"]
    ck = load_latest_for_resume(tmp_path / "int")
    assert ck.trainer_state["step"] == 3 and ck.trainer_state["scheduler"]["last_epoch"] == 3
    assert [r["step"] for r in records(tmp_path / "int")] == [1, 3]  # step 1, then every log_every
    # the checkpoint holds exactly the weights the uninterrupted run had after step 3
    ref = tmp_path / "ref"
    train(run, ref, progress=False, stop_after=3)
    want = load_latest(ref).model.state_dict()
    for k, v in ck.model.state_dict().items():
        assert torch.equal(v, want[k]), k
    train(run, tmp_path / "int", resume=True, progress=False)
    assert_same_run(full / "run", tmp_path / "int")


def test_signal_during_the_final_step_saves_it_and_resume_writes_the_results(full, tmp_path, monkeypatch):
    run = tiny_run(full, MHMOE, **CADENCE)
    owner, attr = _pieces()["optimizer"]
    original = getattr(owner, attr)
    calls = {"n": 0}

    def last_step(*args, **kwargs):
        original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(owner, attr, last_step)
    with pytest.raises(Interrupted, match="at step 6: checkpoint saved"):
        train(run, tmp_path / "int", progress=False)
    monkeypatch.undo()
    assert not (tmp_path / "int" / "results.json").exists()
    res = train(run, tmp_path / "int", resume=True, progress=False)
    assert res.step == 6 and (tmp_path / "int" / "results.json").is_file()
    assert_same_run(full / "run", tmp_path / "int")


def test_a_second_signal_aborts_without_saving(full, tmp_path, monkeypatch):
    """The first Ctrl-C asks for a clean stop; a second one (here: inside the checkpoint save the first
    one triggered) aborts at once. The save is atomic, so the older checkpoint stays the newest."""
    run = tiny_run(full, MHMOE, **CADENCE)
    owner, attr = _pieces()["optimizer"]
    original, save = getattr(owner, attr), SingleProcess.save_checkpoint
    calls = {"n": 0}

    def fourth(*args, **kwargs):
        original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    def save_then_interrupt(self, run_dir, step, *args, **kwargs):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return save(self, run_dir, step, *args, **kwargs)

    monkeypatch.setattr(owner, attr, fourth)
    monkeypatch.setattr(SingleProcess, "save_checkpoint", save_then_interrupt)
    with pytest.raises(Interrupted, match="interrupted again") as info:
        train(run, tmp_path / "int", progress=False)
    monkeypatch.undo()
    assert info.value.exit_code == 130
    assert [p.name for p in list_checkpoints(tmp_path / "int")] == ["step_00000003"]
    assert not list((tmp_path / "int" / "checkpoints").glob(".tmp-*"))
    train(run, tmp_path / "int", resume=True, progress=False)
    assert_same_run(full / "run", tmp_path / "int")


def test_a_keyboard_interrupt_raised_inside_a_step_saves_nothing(full, tmp_path, monkeypatch):
    """A KeyboardInterrupt that does not come through the deferred handler (raised by code inside the
    step) may leave the step half-done: nothing is saved from it, the older checkpoint resumes exactly."""
    run = tiny_run(full, MHMOE, **CADENCE)
    original = SingleProcess.optimizer_step
    calls = {"n": 0}

    def fifth(*args, **kwargs):
        original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(SingleProcess, "optimizer_step", fifth)
    with pytest.raises(KeyboardInterrupt):
        train(run, tmp_path / "int", progress=False)
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path / "int")] == ["step_00000003"]
    train(run, tmp_path / "int", resume=True, progress=False)
    assert_same_run(full / "run", tmp_path / "int")


# ---- StopRequests itself ---------------------------------------------------------------------------------
def test_stop_requests_record_restore_and_respect_ignored_signals():
    before = signal.getsignal(signal.SIGINT)
    with StopRequests() as stop:
        assert stop.active and stop.signum is None
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT  # recorded, nothing raised
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a `nohup ... &` job: Ctrl-C stays ignored
    try:
        with StopRequests() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum is None
    finally:
        signal.signal(signal.SIGINT, before)
    with StopRequests(enabled=False) as stop:
        assert not stop.active and signal.getsignal(signal.SIGINT) is before


def test_stop_requests_are_a_no_op_off_the_main_thread():
    import threading

    seen = {}

    def worker():
        with StopRequests() as stop:
            seen["active"] = stop.active

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"active": False}
