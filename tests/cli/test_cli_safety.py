"""The CLI under faults and bad input: one line on stderr and the right exit status, never a traceback,
never overwriting what the user has.

* every bad value the adversarial pass found (``train.lr=null``, ``model.moe.n_experts=2.5`` / ``true``,
  ``train.batch_size=1000000000``, ``train.lr=.inf``, ``model.norm_eps=-1``, ``train.seed=2**70``,
  ``--config`` a directory, ``--out`` a file, ``--resume`` into nothing): exit 2 naming the field;
* running out of memory: exit 2, one line;
* Ctrl-C / SIGTERM during start-up (imports, data preparation) and during training: one line, exit 130 / 143,
  a checkpoint at the step boundary;
* ``convert-checkpoint`` into an existing run and ``export --bitnet`` into a non-empty folder: refused,
  nothing touched (unguarded, the run's newest checkpoint is replaced and older ones pruned, exit 0; the
  user's config.yaml is overwritten);
* ``--resume`` keeps the run's step count and prints the run's own name; ``compare`` refuses to reuse
  runs trained with other settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import MHMOE, run_messages, sigint_default, tiny_run

import mhmoe.cli
from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.cli import main
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import BatchSampler, ByteTokenizer
from mhmoe.model.lm import LM
from mhmoe.train.parallelism import SingleProcess

SRC = Path(mhmoe.__file__).resolve().parents[1]  # subprocesses run the sources this test imported


@pytest.fixture(autouse=True)
def _sigterm_raises():
    """A SIGTERM that nothing handles must fail the test, not kill pytest."""
    def handler(signum, frame):
        raise AssertionError(f"unhandled signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, old)


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(tiny_run(tmp_path, MHMOE, max_steps=100).to_yaml())
    return path


@pytest.fixture
def trained(config, tmp_path) -> Path:
    """`mhmoe train --config tiny.yaml --max-steps 4` (the config itself says 100 steps)."""
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(out), "--max-steps", "4", "--no-progress"]) == 0
    return out


def _one_line(capsys, prefix: str) -> str:
    """The one message line on stderr (a training's header and evaluation lines aside)."""
    err = capsys.readouterr().err
    lines = run_messages(err)
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0] + "\n"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- bad values: exit 2, one line naming the field -------------------------------------------------------------------
@pytest.mark.parametrize("assignment, field", [
    ("train.lr=null", "train.lr"),
    ("model.moe.n_experts=2.5", "model.moe.n_experts"),
    ("model.moe.n_experts=true", "model.moe.n_experts"),
    ("train.batch_size=1000000000", "train.batch_size"),
    ("train.lr=.inf", "train.lr"),
    ("train.lr=1e400", "train.lr"),
    ("model.norm_eps=-1", "model.norm_eps"),
    (f"train.seed={2**70}", "train.seed"),
    ("train.seed=-1", "train.seed"),
    ("model.moe.top_k=null", "model.moe.top_k"),
    ("name=5", "name"),
])
def test_bad_values_exit_2_naming_the_field(config, tmp_path, capsys, assignment, field):
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--out", str(out), "--set", assignment]) == 2
    assert f"invalid {field}=" in _one_line(capsys, "mhmoe train: error:")
    assert not out.exists()


def test_bad_paths_exit_2(config, tmp_path, capsys):
    (tmp_path / "a-file").write_text("notes\n")
    assert main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "invalid config=" in _one_line(capsys, "mhmoe train: error:")
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)))
    assert main(["train", "--config", str(tmp_path / "bin.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "not UTF-8" in _one_line(capsys, "mhmoe train: error:")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "a-file"), "--no-progress"]) == 2
    assert "invalid --out=" in _one_line(capsys, "mhmoe train: error:")
    assert (tmp_path / "a-file").read_text() == "notes\n"
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert "does not exist" in _one_line(capsys, "mhmoe train: error:")
    assert not (tmp_path / "o").exists() and not (tmp_path / "nothing").exists()


def test_a_failed_train_leaves_no_empty_directories(config, tmp_path, capsys):
    out = tmp_path / "runs" / "week1" / "mh3"  # neither runs/ nor runs/week1/ exists yet
    assert main(["train", "--config", str(config), "--out", str(out), "--data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in _one_line(capsys, "mhmoe train: error:")
    assert not (tmp_path / "runs").exists()  # every directory the run created is gone again
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("mine\n")
    assert main(["train", "--config", str(config), "--out", str(out), "--data", str(tmp_path / "missing.txt")]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["notes.txt"]  # what was there stays


@pytest.mark.parametrize("error", [
    MemoryError("Unable to allocate 246. GiB for an array with shape (1000000000, 33)"),  # numpy, host memory
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\n(GPU 0; 79.1 GiB total)"),
], ids=["host", "device"])
def test_out_of_memory_is_one_line(config, tmp_path, monkeypatch, capsys, error):
    def oom(self, step, micro=0):
        raise error

    monkeypatch.setattr(BatchSampler, "get_batch", oom)
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = _one_line(capsys, "mhmoe train: error: out of memory")
    assert "train.batch_size" in err


# ---- Ctrl-C and SIGTERM ----------------------------------------------------------------------------------------------
def test_ctrl_c_while_the_cli_starts_is_one_line(monkeypatch, capsys):
    def importing(command=None):
        raise KeyboardInterrupt  # what a Ctrl-C during `import torch` looks like

    monkeypatch.setattr(mhmoe.cli, "_parser_builders", importing)
    assert main(["train", "--out", "x"]) == 130
    assert _one_line(capsys, "mhmoe: interrupted")


@pytest.mark.parametrize("how, code", [("keyboard", 130), ("SIGTERM", 143)])
def test_interrupt_during_data_preparation_is_one_line(config, tmp_path, monkeypatch, capsys, how, code):
    import mhmoe.train.loop as loop

    def prepare(*args, **kwargs):
        if how == "keyboard":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # main() turns it into an exception (no silent kill)
        time.sleep(5)  # pragma: no cover -- never reached: the handler raises first
        raise AssertionError("SIGTERM was not delivered")

    monkeypatch.setattr(loop, "build_objective", prepare)
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--out", str(out), "--no-progress"]) == code
    err = _one_line(capsys, "mhmoe train: interrupted")
    assert ("SIGTERM" in err) == (how == "SIGTERM")
    assert not out.exists()  # nothing was written: the lock's directory is removed again


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_training_saves_and_exits(config, tmp_path, monkeypatch, capsys, sig, code):
    original, calls = SingleProcess.optimizer_step, {"n": 0}

    def step(*args, **kwargs):
        original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(SingleProcess, "optimizer_step", step)
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--out", str(out), "--no-progress"]) == code
    err = _one_line(capsys, "mhmoe train: interrupted")
    assert f"({signal.Signals(sig).name}) at step 2: checkpoint saved (continue with --resume)" in err
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002"]


def _wait_until_importing_torch(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until the child has mapped torch's library (on Linux; elsewhere 0.5 s): Python installs its SIGINT
    handler before it imports anything, so a signal sent then is the interpreter's, not the default kill."""
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + timeout_s
    if not maps.parent.exists():
        time.sleep(0.5)
        return
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)


def test_ctrl_c_in_a_real_process_during_start_up(tmp_path, config):
    """A real `mhmoe train` process, Ctrl-C while it imports / prepares: one line, exit 130."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "mhmoe", "train", "--config", str(config), "--out",
                             str(tmp_path / "o"), "--no-progress"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    _wait_until_importing_torch(proc)  # the interpreter is up (its SIGINT handler installed), not yet training
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.count("\n") == 1 and err.startswith("mhmoe"), err
    assert "interrupted" in err and "Traceback" not in err


# ---- never overwrite -------------------------------------------------------------------------------------------------
def test_convert_checkpoint_refuses_an_existing_run(trained, tmp_path, capsys):
    other = tmp_path / "other"
    model = LM(ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32,
                           moe=MoEConfig(n_experts=2, d_expert=16)))
    run = RunConfig(model=model.cfg, train=TrainConfig(seq_len=32))
    save_checkpoint(other, 9, model, run, ByteTokenizer(), {"step": 9})
    before = _snapshot(trained)
    for target in (trained, tmp_path / "a-file"):
        (tmp_path / "a-file").write_text("notes\n")
        for to in ("safetensors", "dcp"):
            assert main(["convert-checkpoint", str(other), str(target), "--to", to]) == 2
            assert "refusing to overwrite" in _one_line(capsys, "mhmoe convert-checkpoint: error:")
    assert _snapshot(trained) == before
    (tmp_path / "empty").mkdir()
    assert main(["convert-checkpoint", str(trained), str(tmp_path / "empty"), "--to", "dcp"]) == 0
    assert main(["convert-checkpoint", str(tmp_path / "empty"), str(tmp_path / "new" / "run"), "--to",
                 "safetensors"]) == 0
    assert [p.name for p in list_checkpoints(tmp_path / "new" / "run")] == ["step_00000004"]
    assert not (tmp_path / "new" / "run" / ".lock").exists()


def test_export_bitnet_refuses_a_non_empty_folder(tmp_path, capsys):
    model = LM(ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32,
                           quant="bitnet158", moe=MoEConfig(n_experts=2, d_expert=16)))
    run = RunConfig(model=model.cfg, train=TrainConfig(seq_len=32))
    save_checkpoint(tmp_path / "run", 1, model, run, ByteTokenizer(), {"step": 1})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own config\n")
    assert main(["export", "--bitnet", str(tmp_path / "run"), str(mine)]) == 2
    assert "refusing to overwrite" in _one_line(capsys, "mhmoe export: error:")
    assert _snapshot(mine) == {"config.yaml": b"my own config\n"}
    assert main(["export", "--bitnet", str(tmp_path / "run"), str(tmp_path / "new"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert Path(rep["path"]) == tmp_path / "new" / "model.bitnet.safetensors" and Path(rep["path"]).is_file()
    assert {p.name for p in tmp_path.iterdir()} == {"run", "mine", "new"}  # no temporary folder left


# ---- resume and compare ----------------------------------------------------------------------------------------------
def test_resume_keeps_the_runs_steps_and_name(trained, tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", "--preset", "tiny-dense", "--out", str(trained), "--resume", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("tiny-test: step 4 ")  # the run's name and its 4 steps (not 100, not tiny-dense)
    assert "train.max_steps" not in out.err  # not taken from the command
    assert main(["train", "--preset", "tiny-dense", "--out", str(trained), "--resume", "--no-progress",
                 "--max-steps", "5"]) == 0
    assert capsys.readouterr().out.startswith("tiny-test: step 5 ")


@pytest.mark.parametrize("flags, field", [(["--lr", "0.5"], "train.lr"), (["--batch-size", "3"], "train.batch_size"),
                                          (["--set", "model.moe.top_k=1"], "model.moe.top_k")])
def test_resume_refuses_overrides_it_cannot_honour(trained, capsys, flags, field):
    """--resume keeps the run's config: a flag or --set that would change it is refused in one line, not
    silently ignored; the same value, and the launch properties, are accepted."""
    before = _snapshot(trained)
    capsys.readouterr()
    argv = ["train", "--preset", "tiny-dense", "--out", str(trained), "--resume", "--no-progress"]
    assert main(argv + flags) == 2
    err = _one_line(capsys, "mhmoe train: error:")
    assert field in err and "--resume" in err and "new --out" in err
    assert _snapshot(trained) == before  # nothing trained, nothing written
    saved = RunConfig.load(trained / "config.yaml")
    assert main(argv + ["--lr", str(saved.train.lr), "--max-steps", "5", "--set", "train.threads=1"]) == 0


def test_compare_refuses_to_reuse_runs_trained_with_other_settings(tmp_path, capsys):
    corpus = tiny_run(tmp_path, MHMOE).data.corpus
    sets = ["train.batch_size=2", "train.seq_len=16", "train.eval_batches=1", "train.warmup_steps=0",
            "train.threads=1", "train.device=cpu", "data.tokenizer=byte", "data.val_sets=[]",
            "data.val_tokens=64", "model.max_seq_len=16", "model.n_layers=1", "model.d_model=32",
            "model.n_heads=2", "model.d_ff=32", "model.moe.d_expert=16"]
    argv = ["compare", "--presets", "tiny-dense", "--out", str(tmp_path / "cmp"), "--data", corpus, "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv + ["--max-steps", "2"]) == 0
    capsys.readouterr()
    before = _snapshot(tmp_path / "cmp")
    assert main(argv + ["--max-steps", "3"]) == 2
    err = _one_line(capsys, "mhmoe compare: error:")
    assert "train.max_steps: 2 there, 3 now" in err
    assert main(argv + ["--max-steps", "2", "--set", "train.lr=1e-2"]) == 2
    assert "train.lr: " in _one_line(capsys, "mhmoe compare: error:")
    assert _snapshot(tmp_path / "cmp") == before
    assert main(argv + ["--max-steps", "2", "--set", "train.threads=2"]) == 0  # a launch property: reused
    assert "finished earlier: reusing" in capsys.readouterr().err
