"""Offline image sets and a discrete visual vocabulary (k-means patch codebook) for masked
multi-modal modelling (the ICML MH-MoE paper's BEiT-3 setting, at small scale).

Image sets (``load_image_set(name)``), both shipped by installed packages, nothing downloaded:

* ``digits``: the 1,797 handwritten digits that scikit-learn bundles (``sklearn.datasets.load_digits``;
  UCI "Optical Recognition of Handwritten Digits", CC BY 4.0; scikit-learn BSD-3).  8x8 grey, 17
  levels (0..16 scaled to 0..255), patch 2 -> a 4x4 grid of 16 patches.  Captions are **synthetic**
  (the label's English name, ``"seven"``): ``captions_real`` is False.
* ``emoji``: the single-code-point emoji of Debian's ``fonts-noto-color-emoji`` (Noto Color Emoji,
  SIL OFL 1.1) rendered with Pillow on white, centred, box-downsampled to 32x32 RGB, patch 4 -> an
  8x8 grid of 64 patches.  Captions are the **real** human-written Unicode character names
  (``"grinning face"``, Python's ``unicodedata``): ``captions_real`` is True.  Only code points that
  have a name in the running Python's Unicode database are used (so the count depends on the Python
  version: 1,392 with Python 3.11 / Unicode 14.0 and font 2.042); renders are cached.

Splits are by image (id), disjoint, with :func:`~mhmoe.data.documents.assign_splits` at 10% val and
10% test.  The codebook (:func:`load_or_fit_codebook`) is fit with scikit-learn's ``KMeans`` on the
train split's patches only (at most :data:`MAX_FIT_PATCHES`, a seeded subsample), single-threaded
so the result does not depend on the core count, and cached with the codes of every image.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import unicodedata
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mhmoe.data.documents import CorpusUnavailableError, assign_splits
from mhmoe.data.token_cache import default_cache_dir
from mhmoe.errors import DataError
from mhmoe.runtime.files import atomic_write, sha256_file
from mhmoe.runtime.reading import open_regular

IMAGE_VAL_PERCENT = 10
IMAGE_TEST_PERCENT = 10
MAX_FIT_PATCHES = 32768
CODEBOOK_FORMAT = 1
EMOJI_FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
EMOJI_INSTALL = "apt-get install -y fonts-noto-color-emoji (and pip install pillow)"
SKLEARN_INSTALL = "pip install scikit-learn  (or: pip install 'mhmoe[multimodal]')"
EMOJI_SIZE = 32
EMOJI_PATCH = 4
EMOJI_RENDER_VERSION = 1
# Code point ranges scanned for emoji glyphs (the font has colour glyphs only for emoji).
EMOJI_RANGES: tuple[tuple[int, int], ...] = (
    (0x00A9, 0x00AF),
    (0x203C, 0x204A),
    (0x2122, 0x213A),
    (0x2190, 0x2C00),
    (0x3030, 0x3300),
    (0x1F000, 0x1FB00),
)
DIGIT_NAMES: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DEFAULT_CODEBOOK_SIZE = {"digits": 64, "emoji": 256}


@dataclass(frozen=True)
class ImageSet:
    """Images ``uint8 [N, H, W, C]`` with ids, captions and a patch size; split by image id."""

    name: str
    source: str
    images: np.ndarray
    ids: tuple[str, ...]
    captions: tuple[str, ...]
    captions_real: bool
    patch: int
    _split: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.images)
        if self.images.ndim != 4 or self.images.dtype != np.uint8:
            raise DataError(f"image set {self.name!r}: images must be uint8 [N, H, W, C]")
        if len(self.ids) != n or len(self.captions) != n or len(set(self.ids)) != n:
            raise DataError(f"image set {self.name!r}: need one unique id and one caption per image")
        h, w = self.images.shape[1:3]
        if self.patch < 1 or h % self.patch or w % self.patch:
            raise DataError(f"image set {self.name!r}: patch {self.patch} does not tile {h}x{w}")
        split = assign_splits(list(self.ids), val_percent=IMAGE_VAL_PERCENT, test_percent=IMAGE_TEST_PERCENT)
        object.__setattr__(self, "_split", tuple(split))

    @property
    def grid(self) -> tuple[int, int]:
        """Patch grid ``(rows, cols)``."""
        return self.images.shape[1] // self.patch, self.images.shape[2] // self.patch

    @property
    def n_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch * self.images.shape[3]

    def split_indices(self, split: str) -> np.ndarray:
        """Indices (int64, ascending) of the images in ``split`` (``train``/``val``/``test``)."""
        if split not in ("train", "val", "test"):
            raise DataError(f"split {split!r}: unknown, expected train, val or test")
        return np.array([i for i, s in enumerate(self._split) if s == split], dtype=np.int64)

    def split_of(self, index: int) -> str:
        return self._split[index]


def patchify(images: np.ndarray, patch: int) -> np.ndarray:
    """``uint8 [N, H, W, C]`` -> ``float32 [N, P, patch*patch*C]`` in [0, 1], patches in row-major
    grid order (patch ``k`` is grid cell ``(k // cols, k % cols)``)."""
    n, h, w, c = images.shape
    gh, gw = h // patch, w // patch
    x = images.reshape(n, gh, patch, gw, patch, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(n, gh * gw, patch * patch * c).astype(np.float32) / 255.0


def load_digits_images() -> ImageSet:
    """scikit-learn's 1,797 8x8 digits (captions synthetic: the digit's English name)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise _unavailable(f"image set 'digits' needs scikit-learn: {SKLEARN_INSTALL}") from None
    d = load_digits()
    pixels = np.rint(np.asarray(d.images, dtype=np.float64) * (255.0 / 16.0)).astype(np.uint8)[..., None]
    ids = tuple(f"digits/{i:04d}" for i in range(len(pixels)))
    captions = tuple(DIGIT_NAMES[int(t)] for t in d.target)
    return ImageSet("digits", "scikit-learn load_digits (UCI optdigits)", pixels, ids, captions, False, 2)


def _unavailable(message: str) -> DataError:
    return CorpusUnavailableError(message)


def render_emoji(font_path: Path = EMOJI_FONT, size: int = EMOJI_SIZE) -> tuple[np.ndarray, list[int]]:
    """Render every named single-code-point emoji of the font: ``uint8 [N, size, size, 3]`` and the
    code points.  Glyphs are drawn at the font's bitmap size (109 px), composited on white, centred
    in a square of the larger bbox side, box-downsampled; identical renders are kept once."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(font_path), 109)
    images, cps, seen = [], [], set()
    for lo, hi in EMOJI_RANGES:
        for cp in range(lo, hi):
            ch = chr(cp)
            if unicodedata.name(ch, None) is None:
                continue
            canvas = Image.new("RGBA", (160, 160), (255, 255, 255, 0))
            ImageDraw.Draw(canvas).text((8, 8), ch, font=font, embedded_color=True)
            bbox = canvas.getbbox()
            if bbox is None:
                continue
            x0, y0, x1, y1 = bbox
            side = max(x1 - x0, y1 - y0)
            cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
            crop = canvas.crop((cx - side // 2, cy - side // 2, cx - side // 2 + side, cy - side // 2 + side))
            white = Image.new("RGBA", crop.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(white, crop).convert("RGB").resize((size, size), Image.Resampling.BOX)
            arr = np.asarray(rgb, dtype=np.uint8)
            digest = hashlib.sha256(arr.tobytes()).digest()
            if digest in seen:
                continue
            seen.add(digest)
            images.append(arr)
            cps.append(cp)
    if not images:
        raise DataError(f"{font_path}: no emoji glyphs rendered")
    return np.stack(images), cps


def load_npz(path: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The arrays ``names`` of a cached ``.npz`` file as :func:`numpy.savez` writes it, read within its own
    size: a regular file (a FIFO or a device is refused, never read), members stored uncompressed (a
    deflated one could inflate 1000x), each array's header claiming no more bytes than its member holds,
    no pickled objects. ValueError (the cache is then rebuilt) or KeyError otherwise."""
    with os.fdopen(open_regular(path), "rb") as f:
        try:
            _check_npz(f, str(path))
        except (zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{path}: not an .npz file ({exc})") from None
        f.seek(0)
        with np.load(f, allow_pickle=False) as npz:
            return {name: npz[name] for name in names}


def _check_npz(f: io.BufferedReader, where: str) -> None:
    """ValueError unless every member of the zip ``f`` is an uncompressed ``.npy`` array of plain values
    whose header claims at most the member's bytes, the members summing to at most the file."""
    fmt = np.lib.format
    size = os.fstat(f.fileno()).st_size
    with zipfile.ZipFile(f) as z:
        infos = z.infolist()
        if any(i.compress_type != zipfile.ZIP_STORED for i in infos) or sum(i.file_size for i in infos) > size:
            raise ValueError(f"{where}: compressed or overlapping members (not a cache file mhmoe wrote)")
        for i in infos:
            with z.open(i) as m:
                version = fmt.read_magic(m)
                read_header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise ValueError(f"{where}: .npy format {version} of {i.filename!r}")
                shape, _, dtype = read_header(m)
                if dtype.hasobject:
                    raise ValueError(f"{where}: {i.filename!r} holds Python objects (a pickle)")
                if math.prod(shape) * dtype.itemsize > i.file_size:
                    raise ValueError(f"{where}: {i.filename!r} claims more than its {i.file_size:,} bytes")


def load_emoji_images(font_path: Path = EMOJI_FONT, cache_dir: str | os.PathLike[str] = "") -> ImageSet:
    """Noto Color Emoji renders (32x32 RGB) captioned with their Unicode names; cached."""
    if not font_path.is_file():
        raise _unavailable(f"image set 'emoji': Noto Color Emoji font not installed: {EMOJI_INSTALL}")
    try:
        import PIL
    except ImportError:
        raise _unavailable(f"image set 'emoji' needs Pillow: {EMOJI_INSTALL}") from None
    meta = {
        "font_sha256": sha256_file(font_path),
        "pillow": PIL.__version__,
        "unidata": unicodedata.unidata_version,
        "size": EMOJI_SIZE,
        "render": EMOJI_RENDER_VERSION,
    }
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    path = default_cache_dir(cache_dir) / "images" / f"emoji-{key}.npz"
    images = cps = None
    if path.is_file():
        try:
            z = load_npz(path, ("images", "codepoints"))
            images, cps = z["images"], [int(c) for c in z["codepoints"]]
        except (OSError, ValueError, KeyError):
            images = None
    if images is None:
        images, cps = render_emoji(font_path, EMOJI_SIZE)
        buf = io.BytesIO()
        np.savez(buf, images=images, codepoints=np.array(cps, dtype=np.int64))
        atomic_write(path, buf.getvalue())
    ids = tuple(f"emoji/U+{cp:04X}" for cp in cps)
    captions = tuple(unicodedata.name(chr(cp)).lower() for cp in cps)
    return ImageSet("emoji", f"Noto Color Emoji {font_path}", images, ids, captions, True, EMOJI_PATCH)


IMAGE_SETS: dict[str, str] = {
    "digits": "scikit-learn's 1,797 8x8 handwritten digits (synthetic captions)",
    "emoji": "Noto Color Emoji, 32x32 RGB, captioned with Unicode names (real captions)",
}


def load_image_set(name: str, cache_dir: str | os.PathLike[str] = "") -> ImageSet:
    """``digits`` or ``emoji`` (see the module docstring)."""
    if name == "digits":
        return load_digits_images()
    if name == "emoji":
        return load_emoji_images(cache_dir=cache_dir)
    raise DataError(f"image set {name!r}: unknown, expected one of {', '.join(IMAGE_SETS)}")


@dataclass(frozen=True)
class VisualCodebook:
    """k-means centroids over patches: ``centroids float32 [K, D]``; ``codes int64 [N, P]`` are the
    nearest-centroid indices of every patch of every image of the set (train, val and test)."""

    centroids: np.ndarray
    codes: np.ndarray
    patch: int
    key: str
    built: bool = False
    info: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.centroids.shape[0])

    def encode(self, images: np.ndarray) -> np.ndarray:
        """Codes ``int64 [N, P]`` of ``uint8 [N, H, W, C]`` images (nearest centroid, float64)."""
        return nearest_code(patchify(images, self.patch), self.centroids)

    def decode(self, codes: np.ndarray, grid: tuple[int, int], channels: int) -> np.ndarray:
        """Images ``uint8 [N, H, W, C]`` rebuilt from codes (each patch = its centroid)."""
        p = self.patch
        x = self.centroids[np.asarray(codes)].reshape(-1, grid[0], grid[1], p, p, channels)
        x = x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, grid[0] * p, grid[1] * p, channels)
        return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def nearest_code(patches: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid for ``patches [N, P, D]`` (ties: lowest index)."""
    flat = patches.reshape(-1, patches.shape[-1]).astype(np.float64)
    c = centroids.astype(np.float64)
    d = (c * c).sum(1)[None, :] - 2.0 * flat @ c.T
    return d.argmin(1).reshape(patches.shape[:-1]).astype(np.int64)


def fit_codebook(patches: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k-means (scikit-learn, k-means++ init, one init, Lloyd, single thread) on ``patches [M, D]``."""
    try:
        from sklearn.cluster import KMeans
        from threadpoolctl import threadpool_limits
    except ImportError:
        raise _unavailable(f"the visual codebook needs scikit-learn: {SKLEARN_INSTALL}") from None
    distinct = len(np.unique(patches, axis=0))
    if distinct < k:
        raise DataError(f"codebook size {k} > {distinct} distinct training patches; use a smaller size")
    with threadpool_limits(limits=1):
        km = KMeans(n_clusters=k, init="k-means++", n_init=1, max_iter=100, random_state=seed, algorithm="lloyd")
        km.fit(patches.astype(np.float64))
    return km.cluster_centers_.astype(np.float32)


def load_or_fit_codebook(
    image_set: ImageSet,
    k: int | None = None,
    *,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] = "",
    max_fit_patches: int = MAX_FIT_PATCHES,
) -> VisualCodebook:
    """The cached codebook of ``image_set`` (fit on its train split only), or fit and cache it.

    The cache key hashes the images and ids, ``k``, the patch size, ``seed``, ``max_fit_patches`` and
    the scikit-learn version; the file holds the centroids and the codes of all images.
    """
    import sklearn

    k = k or DEFAULT_CODEBOOK_SIZE.get(image_set.name, 256)
    train = image_set.split_indices("train")
    h = hashlib.sha256()
    meta = {
        "format": CODEBOOK_FORMAT,
        "k": k,
        "patch": image_set.patch,
        "seed": seed,
        "max_fit": max_fit_patches,
        "sklearn": sklearn.__version__,
        "shape": list(image_set.images.shape),
    }
    h.update(json.dumps(meta, sort_keys=True).encode())
    h.update("\n".join(image_set.ids).encode())  # the ids fix the split, hence the fitting patches
    h.update(np.ascontiguousarray(image_set.images).tobytes())  # codes cover every image
    key = h.hexdigest()[:16]
    path = default_cache_dir(cache_dir) / "visual" / f"{image_set.name}-k{k}-{key}.npz"
    if path.is_file():
        try:
            z = load_npz(path, ("centroids", "codes"))
            centroids, codes = z["centroids"], z["codes"]
            if centroids.shape == (k, image_set.patch_dim) and codes.shape == (
                len(image_set.images),
                image_set.n_patches,
            ):
                return VisualCodebook(centroids, codes.astype(np.int64), image_set.patch, key, False, meta)
        except (OSError, ValueError, KeyError):
            pass
    patches = patchify(image_set.images[train], image_set.patch).reshape(-1, image_set.patch_dim)
    if len(patches) > max_fit_patches:
        rng = np.random.default_rng(seed)
        patches = patches[np.sort(rng.choice(len(patches), max_fit_patches, replace=False))]
    centroids = fit_codebook(patches, k, seed)
    codes = nearest_code(patchify(image_set.images, image_set.patch), centroids)
    buf = io.BytesIO()
    np.savez(buf, centroids=centroids, codes=codes.astype(np.uint16 if k <= 65536 else np.int64))
    atomic_write(path, buf.getvalue())
    return VisualCodebook(centroids, codes, image_set.patch, key, True, meta)
