"""``reproduce --minutes``: a measured wall-clock budget -- training, evaluation, checkpoints and the
calibration itself -- becomes one token count per run, reused on resume."""

import json

import pytest

from mhmoe.cli import main
from mhmoe.errors import ConfigError
from mhmoe.research import budget as budget_mod
from mhmoe.research import reproduce

# 64 tokens per step, one evaluation batch on the training corpus's own split
SMALL = ["train.batch_size=2", "train.seq_len=32", "train.threads=1", "train.eval_batches=1", "data.val_sets=[]"]
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


def _costs(tps, eval_s=0.0, ckpt_s=0.0, setup_s=0.0):
    return {"tokens_per_s": tps, "eval_s": eval_s, "checkpoint_s": ckpt_s, "setup_s": setup_s, "train_tokens": 875_290}


def _resolver(points=4, ckpt_every=0):
    from mhmoe.config.presets import get_preset

    def resolve(label, tokens):
        steps = max(1, tokens // 4096)
        return get_preset("tiny-smoe").with_overrides([f"train.max_steps={steps}", f"train.ckpt_every={ckpt_every}",
                                                       f"train.eval_every={max(1, steps // points)}"])
    return resolve


def test_the_budget_covers_training_evaluation_checkpoints_and_the_calibration():
    resolve = _resolver(points=4, ckpt_every=100)
    costs = {"fast": _costs(1000.0, eval_s=20.0, ckpt_s=1.0, setup_s=5.0), "slow": _costs(250.0, eval_s=40.0)}
    seeds = {"fast": 3, "slow": 2}
    tokens = budget_mod.tokens_for_minutes(60, seeds, costs, resolve, spent_s=100.0, reserve=0.05)

    def total(t):
        return 100.0 + sum(n * budget_mod.run_seconds(costs[k], resolve(k, t)) for k, n in seeds.items())

    assert total(tokens) <= 3600 * 0.95 < total(tokens + 4096)  # the most whole steps that fit
    run = resolve("fast", tokens)  # 5 evaluations (4 periodic + the final one), checkpoints every 100 steps
    steps = run.train.max_steps
    evals = len(range(run.train.eval_every, steps, run.train.eval_every)) + 1
    assert budget_mod.run_seconds(costs["fast"], run) == pytest.approx(
        5.0 + steps * 4096 / 1000.0 + evals * 20.0 + ((steps - 1) // 100 + 1) * 1.0)
    # without evaluation and checkpoints in the model, training alone would be given the whole budget
    assert tokens < budget_mod.tokens_for_minutes(60, seeds, {k: _costs(v["tokens_per_s"]) for k, v in costs.items()},
                                                  resolve, reserve=0.05)
    assert budget_mod.tokens_for_minutes(1, seeds, costs, resolve, spent_s=100.0) == 0  # nothing fits


def test_minutes_calibrates_on_this_machine_and_resumes_with_the_same_budget(tmp_path, monkeypatch):
    out = tmp_path / "suite"
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    reproduce.run_suite("v2-table1", out, seeds=2, overrides=SMALL, only=ROWS, progress=False, minutes=1.5)
    saved = json.loads((out / "budget.json").read_text())
    assert saved["rows"] == ROWS and saved["seeds"] == {"SMoE": 2, "MH-MoE (head=2)": 2} and saved["device"] == ["cpu"]
    tps = saved["calibrated_tokens_per_s"]
    assert set(tps) == set(ROWS) and all(v > 0 for v in tps.values())
    costs = saved["calibrated_costs_s"]["SMoE"]
    assert costs["eval_s"] > 0 and costs["checkpoint_s"] > 0 and costs["setup_s"] > 0
    assert saved["calibration_s"] > 0 and saved["predicted_minutes"] <= 1.5 and saved["train_tokens"] > 0
    assert calls == [saved["tokens_per_run"] // 64] * 4  # every run the same number of steps
    assert "Budget: 1.5 minutes for 4 runs" in (out / "results.md").read_text()
    assert json.loads((out / "summary.json").read_text())["budget"]["tokens_per_run"] == saved["tokens_per_run"]

    def no_calibration(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(budget_mod, "calibrate", no_calibration)
    calls.clear()
    reproduce.run_suite("v2-table1", out, seeds=2, overrides=SMALL, only=ROWS, progress=False, minutes=1.5)
    assert calls == []  # the same budget: every run reused


def _fake_calibration(tps, eval_s=0.0):
    return lambda runs, rounds=3, scratch=None: {k: _costs(tps, eval_s) for k in runs}


def test_a_budget_below_one_step_per_run_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(budget_mod, "calibrate", _fake_calibration(10.0))  # 10 tok/s
    with pytest.raises(ConfigError, match="--minutes") as exc:
        reproduce.run_suite("v2-table1", tmp_path / "s", overrides=SMALL, only=ROWS, progress=False, minutes=0.01)
    assert "\n" not in str(exc.value)
    monkeypatch.setattr(budget_mod, "calibrate", _fake_calibration(1e6, eval_s=60.0))  # evaluation alone overruns
    with pytest.raises(ConfigError, match="at least about"):
        reproduce.run_suite("v2-table1", tmp_path / "t", seeds=1, overrides=SMALL, only=ROWS, progress=False, minutes=1)
    with pytest.raises(ConfigError, match="--tokens"):
        reproduce.run_suite("v2-table1", tmp_path / "u", tokens=640, only=ROWS, progress=False, minutes=1)


def test_a_budget_past_the_suites_epoch_limit_trains_one_epoch(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    monkeypatch.setattr(budget_mod, "calibrate", _fake_calibration(1e6))  # a fast machine: many epochs' worth
    reproduce.run_suite("decisive", tmp_path / "s", seeds=1, overrides=SMALL + ["data.corpus=kjv"], progress=False,
                        minutes=1)
    assert calls == [875_290 // 64] * 3  # one epoch of the 875,290-token corpus, in steps of 64 tokens
    assert "1 epoch(s) of the corpus is 875,290" in capsys.readouterr().err


def test_cli_device_and_minutes_reach_every_run(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    monkeypatch.setattr(budget_mod, "calibrate", _fake_calibration(6400.0))
    out = tmp_path / "suite"
    args = ["reproduce", "v2-table1", "--out", str(out), "--minutes", "1", "--device", "cpu", "--no-progress",
            "--rows", "SMoE", "--rows", "Dense", "--seeds", "1"] + [a for s in SMALL for a in ("--set", s)]
    assert main(args) == 0
    # 57 s (95% of a minute) less the calibration's time, over 2 rows at 6400 tok/s: 182,400 tokens per run
    # = 2850 steps of 64 tokens, less a step for the (fake, instant) calibration
    assert calls[0] == calls[1] and 2845 <= calls[0] < 2850
    rec = json.loads(next((tmp_path / "store" / "records").glob("*.json")).read_text())
    assert rec["config"]["train"]["device"] == "cpu" and rec["config"]["train"]["max_steps"] == calls[0]
    assert main(["reproduce", "v2-table1", "--out", str(tmp_path / "x"), "--minutes", "0"]) == 2


@pytest.mark.slow
@pytest.mark.real_train_tokens
def test_a_real_suite_ends_within_ten_percent_of_its_budget(tmp_path):
    """Two tiny rows trained for real under --minutes 2: calibration, training, evaluations and
    checkpoints together end within 10% of the budget (on a machine whose load stays the same)."""
    import time

    args = ["reproduce", "v2-table1", "--rows", "SMoE", "--rows", "MH-MoE (head=3)", "--seeds", "1", "--minutes", "2",
            "--out", str(tmp_path / "suite"), "--no-progress", "--set", "train.threads=1", "--set",
            "train.eval_batches=2", "--set", "train.batch_size=4"]
    t0 = time.perf_counter()
    assert main(args) == 0
    wall = time.perf_counter() - t0
    saved = json.loads((tmp_path / "suite" / "budget.json").read_text())
    assert saved["predicted_minutes"] <= 2 * 0.95 + 0.01
    assert 0.8 * 120 <= wall <= 1.1 * 120, wall
