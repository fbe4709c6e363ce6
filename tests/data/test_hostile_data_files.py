"""FIFOs, links to /dev/zero, oversized files and bombs at the paths the data layer reads: a user's
``.jsonl`` corpus, token-cache manifests, a saved tokenizer's metadata, cached image arrays (``.npz``)
and cached corpora (``.jsonl.gz``). Each is refused in one line naming the file (or, for a cache, taken
as damaged and rebuilt) before a byte is read, without blocking.

Before: ``path.read_bytes()`` / ``read_text()`` read them whole (a FIFO blocked forever, /dev/zero until
memory ran out), a cached corpus was inflated whole, and ``np.load`` inflated deflated members whole."""

from __future__ import annotations

import gzip
import io
import json
import zipfile

import numpy as np
import pytest
from bombs import gzip_bomb
from helpers import plant, within

from mhmoe.data import debdocs, manpages
from mhmoe.data.images import load_npz
from mhmoe.data.tiktoken_tok import MAX_RANKS_BYTES, RANKS_FILE, TiktokenTokenizer
from mhmoe.data.token_cache import check_cached
from mhmoe.data.tokenizer_base import META_FILE, read_tokenizer_meta
from mhmoe.data.userdata import load_jsonl
from mhmoe.errors import DataError
from mhmoe.runtime.bounded import MAX_JSON_CHARS, BoundedLoadError

# user and cache files may be symlinks (followed): what they point to is checked
KINDS = (("fifo", "is a FIFO"), ("zero", "is a character device"), ("large", "more than the 67,108,864 allowed"))


def _one_line(msg: str, path, what: str) -> None:
    assert "\n" not in msg and str(path) in msg and what in msg, msg


@pytest.mark.parametrize("kind,what", KINDS[:2])
def test_a_user_jsonl_corpus_must_be_a_regular_file(tmp_path, kind, what):
    path = plant(tmp_path / "corpus.jsonl", kind)
    with pytest.raises(DataError) as info:
        within(lambda: load_jsonl(path), fifos=[path])
    _one_line(str(info.value), path, what)
    path.unlink()
    path.write_text(json.dumps({"text": "In the beginning"}) + "\n")
    assert load_jsonl(path).documents[0].text == "In the beginning"


@pytest.mark.parametrize("kind,what", KINDS)
def test_tokenizer_metadata_and_token_cache_manifests(tmp_path, kind, what):
    meta = plant(tmp_path / "tok" / META_FILE, kind, MAX_JSON_CHARS + 1)
    with pytest.raises(DataError) as info:
        within(lambda: read_tokenizer_meta(meta.parent), fifos=[meta])
    _one_line(str(info.value), meta, what)
    ranks = plant(tmp_path / "tiktoken" / RANKS_FILE, kind, MAX_RANKS_BYTES + 1)
    with pytest.raises(DataError) as info:
        within(lambda: TiktokenTokenizer._from_saved(ranks.parent, {}), fifos=[ranks])
    _one_line(str(info.value), ranks, what.replace("67,108,864", f"{MAX_RANKS_BYTES:,}"))
    tokens = tmp_path / "cache" / "kjv-train.bin"
    tokens.parent.mkdir()
    tokens.write_bytes(b"")
    manifest = plant(tokens.with_suffix(".json"), kind, MAX_JSON_CHARS + 1)
    cached, reason = within(lambda: check_cached(tokens, {}), fifos=[manifest])
    assert cached is None  # rebuilt (and the manifest replaced by rename, never written through)
    if kind == "large":
        assert "unreadable manifest" in reason and "allowed for a token-cache manifest" in reason, reason


def _npz(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _npy(header: dict, body: bytes = b"") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + body


def test_cached_arrays_are_read_within_their_size(tmp_path):
    ok = tmp_path / "ok.npz"
    np.savez(ok, images=np.arange(12, dtype=np.uint8).reshape(3, 4), codepoints=np.array([1, 2, 3]))
    got = load_npz(ok, ("images", "codepoints"))
    assert got["images"].tolist() == np.arange(12).reshape(3, 4).tolist() and got["codepoints"].tolist() == [1, 2, 3]
    fifo = plant(tmp_path / "fifo.npz", "fifo")
    with pytest.raises(BoundedLoadError) as info:
        within(lambda: load_npz(fifo, ("images",)), fifos=[fifo])
    _one_line(str(info.value), fifo, "is a FIFO")
    huge = {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)}  # 4 TiB claimed in a few bytes
    objects = {"descr": "|O", "fortran_order": False, "shape": (1,)}
    for name, data, what in (
            ("deflated", _npz({"images.npy": _npy(huge)}, zipfile.ZIP_DEFLATED), "compressed"),
            ("huge", _npz({"images.npy": _npy(huge, b"\0" * 64)}), "claims more than"),
            ("objects", _npz({"images.npy": _npy(objects, b"\0" * 64)}), "holds Python objects"),
            ("text", b"not a zip", "not an .npz file")):
        path = tmp_path / f"{name}.npz"
        path.write_bytes(data)
        with pytest.raises(ValueError) as info:
            load_npz(path, ("images",))
        _one_line(str(info.value), path, what)


def test_cached_corpora_are_never_blocked_on_or_inflated_past_a_multiple(tmp_path):
    fifo = plant(tmp_path / "cache.jsonl.gz", "fifo")
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip_bomb(64 << 20))  # 64 MiB in 65 KB: past the 16 MiB floor of gzip_limit
    for read in (debdocs.read_cache, manpages._read_cache):
        for path in (fifo, bomb):
            assert within(lambda: read(path), fifos=[fifo]) is None  # noqa: B023 -- called at once
    good = tmp_path / "good.jsonl.gz"
    good.write_bytes(gzip.compress(b'{"id": "a", "text": "b"}\n'))
    assert debdocs.read_cache(good) == [{"id": "a", "text": "b"}]
    assert [d.text for d in manpages._read_cache(good)] == ["b"]
