"""What ``mhmoe train`` shows while it runs (mhmoe.train.progress): the header, the step bar with loss and
tokens/s from step 1, evaluation bars with their ETA and result lines, the resume line -- captured from a
real ``python -m mhmoe train`` process -- and the pieces behind them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MHMOE, tiny_run

import mhmoe
from mhmoe.train.objectives import build_objective
from mhmoe.train.progress import LossReader, StepBar, eval_progress, format_eval, run_header

SRC = Path(mhmoe.__file__).resolve().parents[1]  # the subprocess runs the sources this test imported


def _train(config: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m mhmoe train`` with bars drawn at every update (TQDM_MININTERVAL=0: tqdm reads it at import)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "TQDM_MININTERVAL": "0"}
    return subprocess.run([sys.executable, "-m", "mhmoe", "train", "--config", str(config), "--out", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_training_talks_from_the_first_step_and_says_where_it_resumes(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(tiny_run(tmp_path, MHMOE, max_steps=3, log_every=10, eval_every=2, eval_batches=2).to_yaml())
    out = tmp_path / "run"
    proc = _train(config, out)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    header = err[:err.index("tiny-test:")]  # everything before the step bar
    params = mhmoe.load(out).model.num_params()
    for needle in (f"mhmoe train: tiny-test -> {out}", f"{params:,} parameters", "forward FLOPs/token",
                   "train tokens (byte, vocab 257)", "val corpus 512 tokens", "3 steps x 128 tokens",
                   "every 2 steps and at the end", "cpu (", "1 thread), float32"):
        assert needle in header, needle
    frames = re.split(r"[\r\n]", err)
    first = next(f for f in frames if re.search(r"tiny-test: .*\b1/3\b", f))
    assert re.search(r"loss=\d+\.\d{3}", first) and re.search(r"tok/s=[\d,]+", first), first  # from step 1
    for step in (2, 3):  # the periodic evaluation and the final one: a bar with its ETA, then a result line
        assert re.search(rf"eval step {step}: +\d+%.*\[\d\d:\d\d<\d\d:\d\d", err), step
        assert re.search(rf"^step {step}/3  val ppl corpus [\d,]+\.\d  \(eval \d+ s\)$", err, re.M), step
    assert proc.stdout.startswith("tiny-test: step 3")
    resumed = _train(config, out, "--resume", "--max-steps", "4", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step 3, checkpoint {out / 'checkpoints' / 'step_00000003'}," in resumed.stderr
    assert "(resumed at step 3)" in resumed.stderr and "tiny-test:" not in resumed.stderr  # no bar
    assert re.search(r"^step 4/4  val ppl", resumed.stderr, re.M)  # result lines without bars too


def test_the_step_bar_shows_loss_and_tokens_per_s_at_step_1():
    bar = StepBar(total=5, initial=0, tokens_per_step=1000, device=torch.device("cpu"), enabled=True)
    bar.start()
    bar.step(torch.tensor(2.5))
    assert bar.bar.n == 1 and bar.bar.postfix.startswith("loss=2.500, tok/s=")
    assert bar.tokens_per_s() > 0
    bar.close()
    off = StepBar(total=5, initial=0, tokens_per_step=1000, device=torch.device("cpu"), enabled=False)
    off.step(torch.tensor(1.0))  # a disabled bar reads nothing
    assert off.bar.n == 0


def test_loss_reader_on_the_cpu_reads_at_once():
    reader = LossReader(torch.device("cpu"))
    assert reader.poll() is None
    reader.push(torch.tensor(3.25))
    assert reader.poll() == 3.25


@pytest.mark.gpu
def test_loss_reader_on_cuda_never_synchronises():
    reader = LossReader(torch.device("cuda"))
    losses = [torch.full((), float(i), device="cuda") * 2 for i in range(20)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        for loss in losses:
            reader.push(loss)
            reader.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert reader.poll() in {2.0 * i for i in range(20)}  # the newest one that had a free slot


def test_eval_size_counts_the_batches_evaluate_runs(tmp_path):
    run = tiny_run(tmp_path, MHMOE, eval_batches=3)
    task = build_objective(run)
    model = mhmoe.LM(mhmoe.ModelConfig(**{**run.model.to_dict(), "vocab_size": task.vocab_size}))
    for cap in (1, 3, None):
        with eval_progress(task.eval_size(cap), "eval", enabled=True) as tick:
            calls = []

            def counted(tick=tick, calls=calls) -> None:
                calls.append(1)
                tick()

            task.evaluate(model, max_batches=cap, device="cpu", dtype="float32", on_batch=counted)
        assert len(calls) == task.eval_size(cap) > 0


def test_header_and_result_lines(tmp_path):
    run = tiny_run(tmp_path, MHMOE, max_steps=1000, grad_accum=2, eval_every=100, ckpt_every=250)
    lines = run_header(run, tmp_path / "r", 49_632, 115_872.0, "corpus: 11,435 train tokens", torch.device("cpu"),
                       world_size=2, start_step=400)
    text = "\n".join(lines)
    assert lines[0] == f"mhmoe train: tiny-test -> {tmp_path / 'r'} (resumed at step 400)"
    for needle in ("49,632 parameters", "115,872 forward FLOPs/token", "1,000 steps x 512 tokens (batch 4 x seq 32 "
                   "x accum 2 x 2 ranks)", "600 to go", "every 100 steps and at the end", "checkpoints every 250",
                   "corpus: 11,435 train tokens"):
        assert needle in text, needle
    res = {"kjv": {"ppl": 1234.56, "loss": 7.1}, "pydocs": {"ppl": 12.0, "loss": 2.5}}
    assert format_eval(200, 2000, res, 12.3) == "step 200/2000  val ppl kjv 1,234.6  pydocs 12.0  (eval 12 s)"
