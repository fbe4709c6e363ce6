"""Every kind of directory a release wrote loads through every entry point, with the numbers that
release printed (fixtures/release-0.1.0/README.md: how they were made, and what it printed).

Kinds: a run directory and its checkpoint directory, each in the single-file and in the sharded (DCP)
format, a ``save_pretrained`` directory and a ``mhmoe export --hf`` directory. Entry points:
``LM.from_pretrained`` and ``mhmoe.load`` (every kind), ``mhmoe generate`` (every kind), and ``mhmoe
eval``, ``analyze`` and ``export --hf`` (the training kinds; a saved directory holds no run config, which
they need: a one-line error, exit status 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import mhmoe
from mhmoe.cli import main
from mhmoe.model.lm import LM

FIXTURE = Path(__file__).parent / "fixtures" / "release-0.1.0"
STEP = "checkpoints/step_00000002"
KINDS = {"run": "run", "checkpoint": f"run/{STEP}", "dcp-run": "dcp", "dcp-checkpoint": f"dcp/{STEP}",
         "saved": "saved", "export-hf": "hf"}
TRAINING = ("run", "checkpoint", "dcp-run", "dcp-checkpoint")
# analyze and export take seconds each and load through the same load_latest as eval: one training kind
# each in the quick suite (and the refusals), the others under -m slow
ANALYZE = [pytest.param(k, marks=pytest.mark.slow) if k in TRAINING and k != "dcp-run" else k for k in KINDS]
EXPORT = [pytest.param(k, marks=pytest.mark.slow) if k in TRAINING and k != "checkpoint" else k for k in KINDS]
EVAL_LOSS = 5.483691692352295  # `mhmoe eval --checkpoint run --batches 1` of release 0.1.0
GREEDY = "in theeeeeeeee"  # its greedy `mhmoe generate --prompt "in the" --max-new-tokens 8`


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A copy of the fixture (loading never writes into it, analyze does: into the copy)."""
    root = tmp_path_factory.mktemp("release") / "release-0.1.0"
    shutil.copytree(FIXTURE, root)
    return root


@pytest.fixture
def at_release(released, monkeypatch) -> Path:
    monkeypatch.chdir(released)  # the runs' data.corpus is the relative path `corpus`
    return released


@pytest.fixture(scope="module")
def weights(released) -> dict[str, torch.Tensor]:
    return LM.from_pretrained(released / "run").state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_and_load_read_every_kind(released, weights, kind):
    model = LM.from_pretrained(released / KINDS[kind])
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()), kind
    lm = mhmoe.load(released / KINDS[kind], "cpu")
    assert lm.generate("in the", max_new_tokens=8, temperature=0) == GREEDY
    assert lm.step == (None if kind in ("saved", "export-hf") else 2)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_reads_every_kind(at_release, capsys, kind):
    args = ["generate", "--checkpoint", KINDS[kind], "--prompt", "in the", "--max-new-tokens", "8",
            "--temperature", "0", "--device", "cpu"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == GREEDY


def _refused(capsys, command: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"mhmoe {command}: error:") and "saved model directory" in err[-1], err


@pytest.mark.parametrize("kind", KINDS)
def test_eval_reads_every_training_kind(at_release, capsys, kind):
    code = main(["eval", "--checkpoint", KINDS[kind], "--batches", "1", "--device", "cpu", "--json", "--no-progress"])
    if kind not in TRAINING:
        assert code == 2
        return _refused(capsys, "eval")
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    assert res["step"] == 2 and res["eval"]["corpus"]["loss"] == pytest.approx(EVAL_LOSS, rel=1e-6)


@pytest.mark.parametrize("kind", ANALYZE)
def test_analyze_reads_every_training_kind(at_release, tmp_path, capsys, kind):
    code = main(["analyze", "--checkpoint", KINDS[kind], "--batches", "1", "--device", "cpu", "--json",
                 "--out", str(tmp_path / "analysis")])
    if kind not in TRAINING:
        assert code == 2
        return _refused(capsys, "analyze")
    assert code == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"].endswith(STEP)


@pytest.mark.parametrize("kind", EXPORT)
def test_export_hf_reads_every_training_kind(at_release, tmp_path, capsys, kind):
    pytest.importorskip("transformers")
    code = main(["export", "--hf", KINDS[kind], str(tmp_path / "hf"), "--json"])
    if kind not in TRAINING:
        assert code == 2
        return _refused(capsys, "export")
    assert code == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert torch.equal(LM.from_pretrained(tmp_path / "hf").embed.weight, LM.from_pretrained(KINDS[kind]).embed.weight)
