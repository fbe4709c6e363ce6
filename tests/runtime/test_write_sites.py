"""Every place mhmoe writes outside a run directory goes through :mod:`mhmoe.runtime.files` too: the
token cache, saved and exported model directories, suite reports, plots, analysis outputs. A planted
symlink is replaced (a file) or refused in one line (a directory), and its target is never written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import MHMOE, tiny_run

from mhmoe.cli import main
from mhmoe.config.model import ModelConfig
from mhmoe.data.documents import Document
from mhmoe.data.token_cache import load_or_build_tokens
from mhmoe.data.tokenizer import ByteTokenizer
from mhmoe.errors import UnsafePathError
from mhmoe.model.lm import LM
from mhmoe.research.report import write_suite_report
from mhmoe.train.loop import train
from mhmoe.train.plots import Curves, plot_curves

SECRET = "the user's own file\n"
DOCS = [Document(f"d{i}", f"document number {i} " * 20) for i in range(4)]


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text(SECRET)
    return v


def test_the_token_cache_replaces_planted_files_and_refuses_planted_directories(tmp_path, victim):
    cache, tok = tmp_path / "cache", ByteTokenizer()
    built = load_or_build_tokens(cache, "corp", "train", DOCS, tok)
    for f in (built.path, built.path.with_suffix(".json")):  # a stranger's cache entries: links
        f.unlink()
        f.symlink_to(victim)
    again = load_or_build_tokens(cache, "corp", "train", DOCS, tok)
    assert again.built and again.tokens.tolist() == built.tokens.tolist() and victim.read_text() == SECRET
    assert not again.path.is_symlink() and not again.path.with_suffix(".json").is_symlink()

    other = tmp_path / "other-cache"
    other.mkdir()
    (other / "tokens").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(UnsafePathError, match="tokens: is a symlink"):
        load_or_build_tokens(other, "corp", "train", DOCS, tok)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_save_pretrained_and_tokenizers_refuse_a_symlinked_target(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "saved").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    model = LM(ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=4, d_ff=32, max_seq_len=16))
    with pytest.raises(UnsafePathError, match="saved: is a symlink"):
        model.save_pretrained(tmp_path / "saved")
    with pytest.raises(UnsafePathError, match="saved: is a symlink"):
        ByteTokenizer().save(tmp_path / "saved")
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "saved"]  # no staging left behind


def test_the_bitnet_export_refuses_a_symlinked_out(tmp_path, capsys):
    from mhmoe.config.moe import MoEConfig

    run = tiny_run(tmp_path, MoEConfig(n_experts=4, top_k=2, d_expert=16), max_steps=1)
    run = run.with_overrides(["model.quant=bitnet158"])
    train(run, tmp_path / "run", progress=False)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    capsys.readouterr()  # the training's own report
    assert main(["export", "--bitnet", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "out: is a symlink" in err, err
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_suite_reports_and_plots_replace_planted_links(tmp_path, victim):
    out = tmp_path / "suite"
    out.mkdir()
    names = ["results.md", "results.csv", "results.json", "curves.png"]
    for n in names:
        (out / n).symlink_to(victim)
    run = {"label": "m", "seed": 0, "params": 10, "fwd_flops_per_token": 20.0, "tokens_per_s": 1.0, "train_s": 1.0,
           "eval": {"kjv": {"ppl": 3.0, "loss": 1.1}}, "run_dir": str(tmp_path / "nowhere")}
    write_suite_report([run], out, "t")
    plot_curves([Curves("m", [(1, 2.0)], {"kjv": [(1, 3.0)]})], out / "curves.png")
    assert victim.read_text() == SECRET and not any((out / n).is_symlink() for n in names)
    assert json.loads((out / "results.json").read_text())["title"] == "t"
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_resumed_run_with_a_symlinked_tb_directory_is_refused(tmp_path):
    run = tiny_run(tmp_path, MHMOE, max_steps=1)
    train(run, tmp_path / "r", progress=False)
    (tmp_path / "elsewhere").mkdir()
    import shutil

    shutil.rmtree(tmp_path / "r" / "tb", ignore_errors=True)
    (tmp_path / "r" / "tb").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    pytest.importorskip("torch.utils.tensorboard")
    with pytest.raises(UnsafePathError, match="tb: is a symlink"):
        train(tiny_run(tmp_path, MHMOE, max_steps=2), tmp_path / "r", resume=True, progress=False)
    assert list((tmp_path / "elsewhere").iterdir()) == []
