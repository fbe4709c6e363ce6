"""The multilingual setting end to end: the `*-icml-ml-*` presets' data (the combined `manpages` corpus,
a BPE trained on its training split, one validation set per language) trains the decoder and reports
per-language validation perplexity. Debian's packages are faked in tmp_path (a few pages in two
languages, rendered by a stand-in for mandoc), so this runs in seconds; the real packages are used by
the slow test at the end."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest
from helpers import records

from mhmoe.config.presets import get_preset
from mhmoe.config.run import RunConfig
from mhmoe.data import manpages
from mhmoe.data.manpages import ManLanguage
from mhmoe.train.loop import train

WORDS = {"de": "der die das und ist nicht mit datei wird", "fr": "le la les et est pas avec fichier sera"}


def _language(tmp: Path, code: str, info: Path) -> ManLanguage:
    root = tmp / "man" / code
    listed = []
    for i in range(60):
        path = root / "man1" / f"cmd{i:02d}.1.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        words = WORDS[code].split()
        body = " ".join(words[(i * j) % len(words)] for j in range(400))
        path.write_bytes(gzip.compress(f".TH X 1\nNAME\n  cmd{i} {body}\n".encode()))
        listed.append(str(path))
    info.mkdir(parents=True, exist_ok=True)
    (info / f"fake-{code}.list").write_text("\n".join(listed) + "\n")
    return ManLanguage(code, f"Lang {code}", (f"fake-{code}",), root, ())


@pytest.fixture
def fake_manpages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    info = tmp_path / "dpkg-info"
    monkeypatch.setattr(manpages, "DPKG_INFO", info)
    monkeypatch.setattr(manpages, "MAN_LANGUAGES", {c: _language(tmp_path, c, info) for c in WORDS})
    monkeypatch.setattr(manpages, "MANPAGES_LANGS", tuple(WORDS))
    monkeypatch.setattr(manpages, "find_mandoc", lambda: sys.executable)
    monkeypatch.setattr(manpages, "render_roff", lambda roff, mandoc, where="": roff.decode().split("\n", 1)[1])
    monkeypatch.setattr(manpages, "_MEMO", {})
    return tmp_path


def _shrunk(preset: str, tmp_path: Path, **train) -> RunConfig:
    """The preset with a small model, few steps and the two fake languages' validation sets."""
    run = get_preset(preset)
    sets = ["model.d_model=48", "model.n_heads=4", "model.d_ff=64", "model.n_layers=2", "model.max_seq_len=64",
            "train.batch_size=4", "train.seq_len=32", "train.eval_batches=2", "train.threads=1", "train.log_every=1",
            "train.device=cpu", "data.vocab_size=400", "data.val_tokens=512", "data.val_sets=[man-de, man-fr]",
            f"data.cache_dir={tmp_path / 'cache'}", *(f"train.{k}={v}" for k, v in train.items())]
    if run.model.moe.kind == "moe":
        sets += ["model.moe.d_expert=32", "model.moe.n_experts=4"]
    return run.with_overrides(sets)


@pytest.mark.parametrize("preset", ["tiny-icml-ml-dense", "tiny-icml-ml-xmoe-8", "tiny-icml-ml-mh4-8"])
def test_multilingual_preset_trains_and_reports_every_language(fake_manpages, tmp_path, preset):
    run = _shrunk(preset, tmp_path, max_steps=3, warmup_steps=1)
    res = train(run, tmp_path / "r", progress=False)
    assert set(res.eval) == {"manpages", "man-de", "man-fr"}
    assert all(v["tokens"] > 0 and v["ppl"] > 1 for v in res.eval.values())
    assert len(records(tmp_path / "r")) == 3
    cfg = RunConfig.load(tmp_path / "r" / "config.yaml")
    assert 257 < cfg.model.vocab_size <= 400 and cfg.data.tokenizer == "bpe"  # a BPE of the training split


@pytest.mark.slow
def test_real_multilingual_preset_builds_and_trains(tmp_path):
    """The real Debian packages: the tiny multilingual MH-MoE preset, data built from scratch (mandoc
    renders ~10k pages, a 16k BPE is trained), a few steps, all 13 languages' validation perplexities."""
    try:
        manpages.load_manpages()
    except manpages.CorpusUnavailableError as exc:
        pytest.skip(str(exc))
    run = get_preset("tiny-icml-ml-mh4-8").with_overrides(
        ["train.max_steps=2", "train.eval_batches=1", "train.batch_size=2", f"data.cache_dir={tmp_path / 'c'}"])
    res = train(run, tmp_path / "r", progress=False)
    assert set(res.eval) == {"manpages", *manpages.MANPAGES_VAL_SETS}
