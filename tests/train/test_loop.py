"""Training loop: overfitting one batch, bit-exact resume on CPU, NaN-step skipping, and refusing to
overwrite a run directory. Every run is a ~50k-parameter model on a tiny byte-level corpus."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import DENSE, MHMOE, NOISY_MH, SMOE, assert_same_run, losses, records, tiny_run  # noqa: E402

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import BatchSampler
from mhmoe.errors import ConfigError
from mhmoe.loading.checkpoint import load_latest
from mhmoe.model.lm import LM
from mhmoe.train.loop import train
from mhmoe.train.optim import build_optimizer


@pytest.mark.parametrize("moe", [DENSE, SMOE, MHMOE], ids=["dense", "smoe", "mhmoe"])
def test_tiny_model_overfits_one_batch(moe):
    """Repeated AdamW steps on one fixed batch of random tokens: loss from ~log(64) to < 0.25 nats."""
    V, bound = 64, 0.25
    torch.set_num_threads(1)  # tiny matmuls: one thread is as fast, and robust to a busy machine
    model = LM(ModelConfig(vocab_size=V, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe_every=1,
                           moe=moe))
    opt = build_optimizer(model, TrainConfig(lr=3e-3, weight_decay=0.0))
    batch = torch.randint(0, V, (4, 33))
    x, y = batch[:, :-1], batch[:, 1:]
    first = last = None
    for _ in range(200):
        out = model(x, y)
        (out.loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = out.loss.item()
        first = last if first is None else first
        if last < bound:
            break
    assert abs(first - math.log(V)) < 0.3
    assert last < bound, f"{moe.kind}/heads={moe.heads}: loss {last:.3f} after 200 steps"


def test_training_loop_overfits_fixed_batch(tmp_path, monkeypatch):
    """The full train() loop (scheduler, clipping, aux loss, balance step) drives an MH-MoE model's LM
    loss on one repeated batch far below its start."""
    original, fixed = BatchSampler.get_batch, {}

    def one_batch(self, step, micro=0):
        if not fixed:
            fixed["xy"] = original(self, 0, 0)
        return fixed["xy"]

    monkeypatch.setattr(BatchSampler, "get_batch", one_batch)
    run = tiny_run(tmp_path, MHMOE, max_steps=80, lr=5e-3, warmup_steps=0, schedule="constant", weight_decay=0.0,
                   log_every=1)
    train(run, tmp_path / "run", progress=False)
    ls = losses(tmp_path / "run")
    assert len(ls) == 80
    assert ls[0] > 5.0 and ls[-1] < 0.5, ls[::10]  # from ~log(257) nats


# ---- bit-exact resume ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "moe, extra",
    [
        (MHMOE, {}),
        (NOISY_MH, dict(grad_accum=2)),  # the noisy router draws from the global RNG every step
        (MoEConfig(n_experts=4, top_k=2, d_expert=32, aux_free_bias=True), dict(ckpt_every=2, eval_every=2)),
    ],
    ids=["mhmoe", "noisy-mhmoe-accum", "auxfree-bias-ckpt-eval"],
)
def test_resume_is_bit_exact(tmp_path, moe, extra):
    run = tiny_run(tmp_path, moe, **extra)
    full, split = tmp_path / "full", tmp_path / "split"
    res_full = train(run, full, progress=False)
    first = train(run, split, progress=False, stop_after=3)
    assert first.step == 3 and len(records(split)) == 3
    assert list_checkpoints(split)[-1].name == "step_00000003"
    res_split = train(run, split, resume=True, progress=False)
    assert res_full.step == res_split.step == 6
    assert_same_run(full, split)
    assert res_full.eval == res_split.eval


def test_noisy_router_really_draws_noise(tmp_path):
    """Guards the noisy resume case above: same init and batches, noise on vs off -> other losses."""
    quiet = MoEConfig(**{**NOISY_MH.to_dict(), "noise_std": 0.0})
    train(tiny_run(tmp_path, NOISY_MH, max_steps=2), tmp_path / "noisy", progress=False)
    train(tiny_run(tmp_path, quiet, max_steps=2), tmp_path / "quiet", progress=False)
    a, b = losses(tmp_path / "noisy"), losses(tmp_path / "quiet")
    assert len(a) == len(b) == 2 and a != b


def test_resume_after_a_crash_falls_back_and_trims_logs(tmp_path):
    """A run killed after its step-4 checkpoint but before step 5's was saved: resuming from step 4
    drops the metrics/eval lines logged after it and reproduces the uninterrupted run exactly."""
    run = tiny_run(tmp_path, MHMOE, ckpt_every=2, eval_every=1, keep_last=3)
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    train(run, full, progress=False)
    train(run, crashed, progress=False, stop_after=5)
    newest = list_checkpoints(crashed)[-1]
    assert newest.name == "step_00000005"
    shutil.rmtree(newest)  # the crash: step 5 was logged, never checkpointed
    assert [r["step"] for r in records(crashed, "eval.jsonl")] == [1, 2, 3, 4, 5]
    train(run, crashed, resume=True, progress=False)
    assert_same_run(full, crashed)
    assert [r["step"] for r in records(crashed, "eval.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_resume_survives_a_torn_metrics_line(tmp_path):
    """A crash in the middle of writing a log line must not make the run impossible to resume."""
    run = tiny_run(tmp_path, MHMOE)
    train(run, tmp_path / "full", progress=False)
    train(run, tmp_path / "torn", progress=False, stop_after=3)
    with open(tmp_path / "torn" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    with open(tmp_path / "torn" / "eval.jsonl", "a") as f:
        f.write("\n{")
    train(run, tmp_path / "torn", resume=True, progress=False)
    assert_same_run(tmp_path / "full", tmp_path / "torn")


def test_resume_without_checkpoints_starts_fresh_and_finished_run_is_a_no_op(tmp_path, capsys):
    """--resume into a run directory that holds no checkpoint and no config.yaml starts the given config at
    step 0 and says so (tests/train/test_resume_identity.py: with a config.yaml, the run's own); into a
    directory that does not exist it is an error (a mistyped --out)."""
    run = tiny_run(tmp_path, SMOE, max_steps=3)
    with pytest.raises(ConfigError, match="does not exist") as info:
        train(run, tmp_path / "r", resume=True, progress=False)
    assert info.value.field == "--out" and not (tmp_path / "r").exists()
    (tmp_path / "r").mkdir()
    res = train(run, tmp_path / "r", resume=True, progress=False)
    assert res.step == 3 and "holds no checkpoint and no config.yaml yet: starting the given config from step 0" \
        in capsys.readouterr().err
    before = losses(tmp_path / "r")
    again = train(run, tmp_path / "r", resume=True, progress=False)
    assert again.step == 3 and losses(tmp_path / "r") == before
    assert [p.name for p in list_checkpoints(tmp_path / "r")] == ["step_00000003"]


def test_resume_can_extend_max_steps(tmp_path):
    train(tiny_run(tmp_path, SMOE, max_steps=3), tmp_path / "r", progress=False)
    res = train(tiny_run(tmp_path, SMOE, max_steps=5), tmp_path / "r", resume=True, progress=False)
    assert res.step == 5
    assert [r["step"] for r in records(tmp_path / "r")] == [1, 2, 3, 4, 5]


# ---- outputs ------------------------------------------------------------------------------------------
def test_run_directory_outputs(tmp_path):
    run = tiny_run(tmp_path, MHMOE, ckpt_every=2, keep_last=2)
    res = train(run, tmp_path / "r", progress=False)
    d = tmp_path / "r"
    recs = records(d)
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert math.isfinite(r["loss"]) and r["nan_skips"] == 0 and r["tokens"] == r["step"] * 4 * 32
        assert {"aux_loss", "lr", "grad_norm", "load_imbalance", "experts_used_frac", "dropped_frac"} <= set(r)
    assert recs[0]["lr"] == pytest.approx(0.5e-3) and recs[1]["lr"] == pytest.approx(1e-3)
    ev = records(d, "eval.jsonl")
    assert [e["step"] for e in ev] == [6] and ev[0]["corpus_ppl"] == pytest.approx(math.exp(ev[0]["corpus_loss"]))
    summary = json.loads((d / "results.json").read_text())
    assert summary["step"] == 6 and summary["params"] == res.params > 0
    assert summary["fwd_flops_per_token"] > 0 and set(summary["eval"]) == {"corpus"}
    assert [p.name for p in list_checkpoints(d)] == ["step_00000004", "step_00000006"]  # keep_last=2
    assert not list((d / "checkpoints").glob(".tmp-*"))
    saved = RunConfig.load(d / "config.yaml")
    assert saved.model.vocab_size == 257  # filled in from the byte tokenizer


# ---- non-finite losses ----------------------------------------------------------------------------------
def _nan_on_calls(monkeypatch, bad_calls: set[int]):
    """Make LM.forward return a NaN training loss on the given (0-based) training-forward calls."""
    original = LM.forward
    calls = {"n": 0}

    def forward(self, idx, targets=None, *args, **kwargs):
        out = original(self, idx, targets, *args, **kwargs)
        if targets is not None and self.training:
            if calls["n"] in bad_calls:
                out.loss = out.loss * float("nan")
            calls["n"] += 1
        return out

    monkeypatch.setattr(LM, "forward", forward)


def test_nan_steps_are_skipped_and_counted(tmp_path, monkeypatch, capsys):
    _nan_on_calls(monkeypatch, {1, 2})
    res = train(tiny_run(tmp_path, MHMOE, max_nan_skips=2), tmp_path / "r", progress=False)
    assert res.step == 6 and res.nan_skips == 2
    recs = records(tmp_path / "r")
    assert [r["step"] for r in recs] == [1, 4, 5, 6]  # steps 2 and 3 were skipped
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["nan_skips"] == 2
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "non-finite loss" in ln]
    assert len(warnings) == 2 and "step skipped" in warnings[0]
    assert load_latest(tmp_path / "r").step == 6


def test_consecutive_nan_steps_stop_the_run(tmp_path, monkeypatch, capsys):
    _nan_on_calls(monkeypatch, set(range(1, 100)))
    with pytest.raises(RuntimeError, match=r"max_nan_skips=3"):
        train(tiny_run(tmp_path, MHMOE, max_steps=20, max_nan_skips=3), tmp_path / "r", progress=False)
    err = [ln for ln in capsys.readouterr().err.splitlines() if "non-finite" in ln]
    assert len(err) == 4  # 3 skipped, the 4th in a row stops
    assert list_checkpoints(tmp_path / "r") == []  # nothing saved from a diverged run


def test_huge_lr_diverges_and_stops_without_saving(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="non-finite"):
        train(tiny_run(tmp_path, MHMOE, max_steps=20, lr=1e30, warmup_steps=0, max_nan_skips=2), tmp_path / "r",
              progress=False)
    assert list_checkpoints(tmp_path / "r") == []
    assert "non-finite loss" in capsys.readouterr().err


# ---- refusing to overwrite ---------------------------------------------------------------------------------
def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_refuses_a_run_directory_with_checkpoints(tmp_path):
    run = tiny_run(tmp_path, SMOE, max_steps=2)
    train(run, tmp_path / "r", progress=False)
    before = _snapshot(tmp_path / "r")
    with pytest.raises(ConfigError, match="--resume") as info:
        train(tiny_run(tmp_path, MHMOE, max_steps=4), tmp_path / "r", progress=False)
    assert info.value.field == "--out"
    assert _snapshot(tmp_path / "r") == before  # nothing overwritten, not even metrics.jsonl


def test_training_is_deterministic(tmp_path):
    run = tiny_run(tmp_path, NOISY_MH, max_steps=3)
    train(run, tmp_path / "a", progress=False)
    train(run, tmp_path / "b", progress=False)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_resume_takes_threads_from_the_command(tmp_path):
    """threads is a property of the machine the run continues on, not of the run: --resume takes it."""
    run = tiny_run(tmp_path, MHMOE)
    train(run, tmp_path / "r", progress=False, stop_after=1)
    again = run.with_overrides(["train.threads=2"])
    train(again, tmp_path / "r", resume=True, progress=False, stop_after=2)
    assert torch.get_num_threads() == 2
    assert RunConfig.load(list_checkpoints(tmp_path / "r")[-1] / "config.yaml").train.threads == 2
    # config.yaml is what the run started with: a resume never rewrites it
    assert RunConfig.from_yaml((tmp_path / "r" / "config.yaml").read_text()).train.threads == 1
    torch.set_num_threads(1)
