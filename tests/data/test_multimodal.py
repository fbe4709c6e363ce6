"""Masked multi-modal data: image sets, k-means visual codebook, masking, batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mhmoe.data import images as img
from mhmoe.data.images import ImageSet, load_or_fit_codebook, patchify
from mhmoe.data.multimodal import (
    KIND_IMAGE,
    KIND_PAIR,
    KIND_TEXT,
    MODALITY_IMAGE,
    MODALITY_TEXT,
    MaskedMultimodalData,
    MaskingConfig,
    masked_perplexity_groups,
    n_masked,
    values_to_grid,
)
from mhmoe.errors import ConfigError, DataError

sklearn = pytest.importorskip("sklearn", reason="pip install scikit-learn")
HAS_EMOJI = img.EMOJI_FONT.is_file()


@pytest.fixture(scope="module")
def digits() -> ImageSet:
    return img.load_digits_images()


@pytest.fixture(scope="module")
def codebook(digits: ImageSet, tmp_path_factory: pytest.TempPathFactory) -> img.VisualCodebook:
    return load_or_fit_codebook(digits, 16, seed=3, cache_dir=tmp_path_factory.mktemp("cb"), max_fit_patches=4000)


def test_digits_image_set(digits: ImageSet) -> None:
    assert digits.images.shape == (1797, 8, 8, 1) and digits.images.dtype == np.uint8
    assert digits.grid == (4, 4) and digits.n_patches == 16 and digits.patch_dim == 4
    assert digits.captions[:3] == ("zero", "one", "two") and not digits.captions_real
    parts = {s: set(digits.split_indices(s).tolist()) for s in ("train", "val", "test")}
    assert not (parts["train"] & parts["val"]) and not (parts["train"] & parts["test"])
    assert not (parts["val"] & parts["test"])
    assert sum(map(len, parts.values())) == 1797
    assert 120 < len(parts["val"]) < 240 and 120 < len(parts["test"]) < 240


def test_patchify_row_major() -> None:
    x = np.arange(16, dtype=np.uint8).reshape(1, 4, 4, 1)
    p = patchify(x, 2) * 255
    assert p.shape == (1, 4, 4)
    assert p[0, 0].tolist() == [0, 1, 4, 5] and p[0, 1].tolist() == [2, 3, 6, 7] and p[0, 2].tolist() == [8, 9, 12, 13]


def test_codebook_deterministic_cached_and_train_only(
    digits: ImageSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = load_or_fit_codebook(digits, 16, seed=3, cache_dir=tmp_path / "a", max_fit_patches=4000)
    b = load_or_fit_codebook(digits, 16, seed=3, cache_dir=tmp_path / "b", max_fit_patches=4000)
    assert a.built and b.built and a.key == b.key
    assert np.array_equal(a.centroids, b.centroids) and np.array_equal(a.codes, b.codes)
    assert a.centroids.shape == (16, 4) and a.codes.shape == (1797, 16) and a.codes.max() < 16
    assert np.array_equal(a.encode(digits.images[:50]), a.codes[:50])
    seen = {}

    def spy(patches: np.ndarray, k: int, seed: int) -> np.ndarray:
        seen["patches"] = patches
        raise AssertionError("refit although cached")

    monkeypatch.setattr(img, "fit_codebook", spy)
    c = load_or_fit_codebook(digits, 16, seed=3, cache_dir=tmp_path / "a", max_fit_patches=4000)
    assert not c.built and np.array_equal(c.centroids, a.centroids) and np.array_equal(c.codes, a.codes)

    def capture(patches: np.ndarray, k: int, seed: int) -> np.ndarray:
        seen["patches"] = patches
        return patches[:k].copy()

    monkeypatch.setattr(img, "fit_codebook", capture)
    load_or_fit_codebook(digits, 8, seed=3, cache_dir=tmp_path / "c", max_fit_patches=10**9)
    train = patchify(digits.images[digits.split_indices("train")], 2).reshape(-1, 4)
    assert np.array_equal(seen["patches"], train)  # fit on the train split only


def test_codebook_decode_roundtrip(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    rec = codebook.decode(codebook.codes[:10], digits.grid, 1)
    assert rec.shape == (10, 8, 8, 1) and rec.dtype == np.uint8
    assert np.abs(rec.astype(int) - digits.images[:10]).mean() < 40


def make_data(digits: ImageSet, codebook: img.VisualCodebook, **kw: object) -> MaskedMultimodalData:
    rng = np.random.default_rng(0)
    train = rng.integers(0, 100, 5000).astype(np.uint16)
    val = rng.integers(0, 100, 600).astype(np.uint16)
    captions = [[10 + int(c[0] == "s"), 20, 30] for c in digits.captions]
    args = {"text_vocab_size": 100, "text_train": train, "text_val": val, "captions": captions, "text_len": 6}
    return MaskedMultimodalData(digits, codebook, **{**args, **kw})  # type: ignore[arg-type]


def test_batch_shapes_layout_and_ratios(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    data = make_data(digits, codebook)
    v = data.vocab
    assert (v.code_offset, v.pad_id, v.mask_id, v.cls_id, v.sep_id, v.size) == (100, 116, 117, 118, 119, 120)
    assert data.seq_len == 16 + 6 + 3 == 25
    b = data.get_batch(5, batch_size=9)
    assert len(b) == 9 and b.input_ids.shape == (9, 25) and b.patch_pos.shape == (9, 25, 2)
    assert b.kind.tolist() == [KIND_IMAGE] * 3 + [KIND_TEXT] * 3 + [KIND_PAIR] * 3
    assert torch.equal(b.position[0], torch.arange(25))
    for i in range(9):
        kind, tgt, lm = int(b.kind[i]), b.targets[i], b.loss_mask[i]
        assert tgt[0] == v.cls_id and torch.equal(b.input_ids[i][lm], torch.full((int(lm.sum()),), v.mask_id))
        assert torch.equal(b.input_ids[i][~lm], tgt[~lm])
        if kind == KIND_TEXT:
            assert int(b.image_index[i]) == -1 and (b.modality[i] == MODALITY_TEXT).all()
            assert tgt[-1] == v.sep_id and (tgt[1:-1] < 100).all() and int(lm.sum()) == n_masked(23, 0.15)
            assert (b.patch_pos[i] == -1).all() and b.attention_mask[i].all()
            continue
        idx = int(b.image_index[i])
        assert digits.split_of(idx) == "train"
        codes = torch.from_numpy(codebook.codes[idx].astype(np.int64)) + 100
        assert torch.equal(tgt[1:17], codes) and tgt[17] == v.sep_id
        assert (b.modality[i][:18] == MODALITY_IMAGE).all()
        assert int(lm[1:17].sum()) == n_masked(16, 0.4)
        assert b.patch_pos[i][1].tolist() == [0, 0] and b.patch_pos[i][16].tolist() == [3, 3]
        assert b.patch_pos[i][5].tolist() == [1, 0] and (b.patch_pos[i][17:] == -1).all()
        if kind == KIND_IMAGE:
            assert (tgt[18:] == v.pad_id).all() and not b.attention_mask[i][18:].any() and not lm[18:].any()
        else:
            assert tgt[18:21].tolist() == data.captions[idx] and tgt[21] == v.sep_id
            assert (b.modality[i][18:22] == MODALITY_TEXT).all() and int(lm[18:21].sum()) == n_masked(3, 0.5)
            assert not b.attention_mask[i][22:].any()


def test_batches_are_pure_functions(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    data = make_data(digits, codebook)
    a, b = data.get_batch(3, 1, batch_size=6), data.get_batch(3, 1, batch_size=6)
    c = make_data(digits, codebook).get_batch(3, 1, batch_size=6)
    for name in ("input_ids", "targets", "loss_mask", "image_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)) and torch.equal(getattr(a, name), getattr(c, name))
    assert not torch.equal(a.input_ids, data.get_batch(4, 1, batch_size=6).input_ids)
    assert not torch.equal(a.input_ids, make_data(digits, codebook, seed=9).get_batch(3, 1, batch_size=6).input_ids)
    masking = MaskingConfig(image_mode="random")
    random_mode = make_data(digits, codebook, masking=masking, mix=(1, 0, 0)).get_batch(3, batch_size=3)
    assert int(random_mode.loss_mask.sum()) == 3 * n_masked(16, 0.4)


def test_mix_weights(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    data = make_data(digits, codebook, mix=(1.0, 0.0, 3.0))
    assert data.kinds_for_batch(8) == [KIND_IMAGE] * 2 + [KIND_PAIR] * 6
    with pytest.raises(ConfigError, match="mix"):
        make_data(digits, codebook, mix=(0, 0, 0))


def test_validation_set_fixed_and_disjoint(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    data = make_data(digits, codebook, val_text_windows=10)
    examples = data.val_examples()
    n_val = len(digits.split_indices("val"))
    assert len(examples) == 2 * n_val + 10
    batches = list(data.iter_val_batches(64))
    again = list(data.iter_val_batches(64))
    assert sum(len(b) for b in batches) == len(examples)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(batches, again, strict=True))
    val_images = {int(i) for b in batches for i in b.image_index.tolist() if i >= 0}
    train_images = set(digits.split_indices("train").tolist())
    assert val_images == set(digits.split_indices("val").tolist()) and not (val_images & train_images)
    seen = {int(i) for s in range(20) for i in data.get_batch(s, batch_size=12).image_index.tolist() if i >= 0}
    assert seen <= train_images
    assert len(list(data.iter_val_batches(64, max_batches=2))) == 2


def test_fig8_helpers_and_perplexity_groups(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    data = make_data(digits, codebook)
    ex = data.image_example(42, mask=False)
    assert not ex.loss_mask.any() and torch.equal(ex.input_ids, ex.targets)
    assert data.image(42).shape == (8, 8, 1) and data.grid == (4, 4) and data.patch_size == 2
    grid = values_to_grid(ex, 0, torch.arange(data.seq_len, dtype=torch.float32), data.grid)
    assert grid.shape == (4, 4) and grid[0, 0] == 1 and grid[3, 3] == 16
    text = data.text_example("val", 0)
    assert np.isnan(values_to_grid(text, 0, torch.zeros(data.seq_len), data.grid)).all()
    b = data.get_batch(0, batch_size=6)
    groups = masked_perplexity_groups(b, torch.ones(b.input_ids.shape))
    assert groups["all"][1] == int(b.loss_mask.sum()) == groups["image"][1] + groups["text"][1]
    assert groups["image"][0] == groups["image"][1]


def test_errors(digits: ImageSet, codebook: img.VisualCodebook) -> None:
    with pytest.raises(DataError, match="text window"):
        make_data(digits, codebook, text_val=np.zeros(5, dtype=np.uint16))
    with pytest.raises(DataError, match="captions"):
        make_data(digits, codebook, captions=[[1]])
    with pytest.raises(DataError, match="distinct"):
        img.fit_codebook(np.zeros((100, 4), dtype=np.float32), 8, 0)
    with pytest.raises(DataError, match="unknown"):
        img.load_image_set("cifar")


def test_emoji_missing_font_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="fonts-noto-color-emoji"):
        img.load_emoji_images(font_path=tmp_path / "none.ttf", cache_dir=tmp_path)


@pytest.mark.skipif(not HAS_EMOJI, reason="apt-get install -y fonts-noto-color-emoji")
def test_emoji_render_small_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(img, "EMOJI_RANGES", ((0x1F600, 0x1F610),))
    s = img.load_emoji_images(cache_dir=tmp_path)
    assert s.images.shape == (16, 32, 32, 3) and s.grid == (8, 8) and s.captions_real
    assert s.ids[0] == "emoji/U+1F600" and s.captions[0] == "grinning face"
    assert (s.images[:, 0, 0] >= 250).all()  # white background
    cached = img.load_emoji_images(cache_dir=tmp_path)
    assert np.array_equal(cached.images, s.images)


def test_prepare_multimodal_with_user_text(tmp_path: Path) -> None:
    from mhmoe.data.multimodal import MultimodalConfig, prepare_multimodal

    text = tmp_path / "story.txt"
    text.write_text("\n\n".join(f"Paragraph {i}. " + "The quick brown fox jumps. " * 30 for i in range(60)))
    cfg = MultimodalConfig(image_set="digits", codebook_size=16, text_corpus=str(text), cache_dir=str(tmp_path / "c"))
    data = prepare_multimodal(cfg)
    info = data.describe()
    assert info["codebook_size"] == 16 and info["grid"] == [4, 4] and info["vocab_size"] == 257 + 16 + 4
    assert data.captions[7] == list(b"seven") and info["captions_real"] is False
    b = data.get_batch(0, batch_size=3)
    assert b.input_ids.shape == (3, data.seq_len) and int(b.input_ids.max()) < data.vocab.size
