"""``reproduce --minutes``: a measured wall-clock budget becomes one token count per run, reused on resume."""

import json

import pytest

from mhmoe.cli import main
from mhmoe.errors import ConfigError
from mhmoe.research import budget as budget_mod
from mhmoe.research import reproduce

SMALL = ["train.batch_size=2", "train.seq_len=32", "train.threads=1"]  # 64 tokens per step
ROWS = ["SMoE", "MH-MoE (head=2)"]


def _fake_trainer(calls):
    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append(run.train.max_steps)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(run.to_yaml())
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": run.train.max_steps, "params": 10, "fwd_flops_per_token": 5.0,
            "tokens_per_s": 1.0, "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 10.0, "loss": 2.3}}}))
    return fake_train


def test_tokens_for_minutes_fits_every_row_and_seed_in_the_budget():
    tps = {"fast": 1000.0, "slow": 250.0}
    tokens = budget_mod.tokens_for_minutes(1.0, 3, tps, reserve=0.25)
    # 45 s of training for 3 seeds of both rows: tokens * 3 * (1/1000 + 1/250) = 45
    assert tokens == 3000
    assert sum(3 * tokens / v for v in tps.values()) <= 60 * 0.75


def test_minutes_calibrates_on_this_machine_and_resumes_with_the_same_budget(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    reproduce.run_suite("v2-table1", tmp_path, seeds=2, overrides=SMALL, only=ROWS, progress=False, minutes=0.5)
    saved = json.loads((tmp_path / "budget.json").read_text())
    assert saved["rows"] == ROWS and saved["seeds"] == 2 and saved["device"] == ["cpu"]
    tps = saved["calibrated_tokens_per_s"]
    assert set(tps) == set(ROWS) and all(v > 0 for v in tps.values())
    assert saved["tokens_per_run"] == budget_mod.tokens_for_minutes(0.5, 2, tps) or \
        abs(saved["tokens_per_run"] / budget_mod.tokens_for_minutes(0.5, 2, tps) - 1) < 0.01  # rounded tok/s
    assert calls == [saved["tokens_per_run"] // 64] * 4  # every run the same number of steps
    assert "Budget: 0.5 minutes" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["budget"]["tokens_per_run"] == saved["tokens_per_run"]

    def no_calibration(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(budget_mod, "calibrate", no_calibration)
    calls.clear()
    reproduce.run_suite("v2-table1", tmp_path, seeds=2, overrides=SMALL, only=ROWS, progress=False, minutes=0.5)
    assert calls == []  # the same budget: every run reused


def test_a_budget_below_one_step_per_run_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(budget_mod, "calibrate", lambda runs, rounds=3: {k: 10.0 for k in runs})  # 10 tok/s
    with pytest.raises(ConfigError, match="--minutes") as exc:
        reproduce.run_suite("v2-table1", tmp_path, overrides=SMALL, only=ROWS, progress=False, minutes=0.01)
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="--tokens"):
        reproduce.run_suite("v2-table1", tmp_path, tokens=640, only=ROWS, progress=False, minutes=1)


def test_cli_device_and_minutes_reach_every_run(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    monkeypatch.setattr(budget_mod, "calibrate", lambda runs, rounds=3: {k: 6400.0 for k in runs})
    args = ["reproduce", "v2-table1", "--out", str(tmp_path), "--minutes", "1", "--device", "cpu", "--no-progress",
            "--rows", "SMoE", "--rows", "Dense"] + [a for s in SMALL for a in ("--set", s)]
    assert main(args) == 0
    # 48 s of training over 2 rows at 6400 tok/s: 153,600 tokens per run = 2400 steps of 64 tokens
    assert calls == [2400, 2400]
    cfg = (tmp_path / "SMoE" / "seed0" / "config.yaml").read_text()
    assert "device: cpu" in cfg and "max_steps: 2400" in cfg
    assert main(["reproduce", "v2-table1", "--out", str(tmp_path / "x"), "--minutes", "0"]) == 2
