"""The pHash: its DCT rule against scipy and imagehash, and near-duplicate detection against imagehash's."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from pipeline.dedup.phash import hamming, phash64
from pipeline.download.resize import process_image

THRESHOLD = 4  # DedupeConfig.phash_threshold


def _photo(seed: int, w: int = 720, h: int = 540) -> np.ndarray:
    """Photo-like RGB: a smooth random colour field, a few soft discs, film grain."""
    rng = np.random.default_rng(seed)
    field = rng.integers(0, 256, (int(rng.integers(3, 6)), int(rng.integers(3, 6)), 3), dtype=np.uint8)
    img = cv2.resize(field, (w, h), interpolation=cv2.INTER_CUBIC).astype(np.float32)
    for _ in range(int(rng.integers(3, 8))):
        mask = np.zeros((h, w), np.float32)
        centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        cv2.circle(mask, centre, int(rng.integers(w // 20, w // 5)), 1.0, -1)
        mask = cv2.GaussianBlur(mask, (0, 0), 3)[..., None]
        img = img * (1 - mask) + mask * rng.integers(0, 256, 3).astype(np.float32)
    img += rng.normal(0, 4, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _jpeg(rgb: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _imagehash64(image: Image.Image) -> int:
    imagehash = pytest.importorskip("imagehash")
    bits = imagehash.phash(image, hash_size=8).hash.flatten()
    return int(np.packbits(bits).view(">i8")[0])


def test_dct_rule_is_scipy_dct_ii_and_bit_order_is_imagehash() -> None:
    scipy_fftpack = pytest.importorskip("scipy.fftpack")
    grey = np.random.default_rng(0).integers(0, 256, (32, 32), dtype=np.uint8)
    low = scipy_fftpack.dct(scipy_fftpack.dct(grey.astype(float), axis=0), axis=1)[:8, :8]
    bits = (low > np.median(low)).ravel()
    expected = sum(1 << (63 - i) for i, b in enumerate(bits) if b)
    expected -= 1 << 64 if expected >= 1 << 63 else 0
    assert phash64(Image.fromarray(grey)) == phash64(grey) == expected
    # At 32×32 no reduction happens on either side: imagehash computes the same bits in the same order.
    assert phash64(Image.fromarray(grey)) == _imagehash64(Image.fromarray(grey))


def test_channel_orders_and_input_types_agree() -> None:
    rgb = _photo(1)
    h = phash64(rgb)
    assert phash64(np.ascontiguousarray(rgb[..., ::-1]), "BGR") == h == phash64(Image.fromarray(rgb))
    assert hamming(np.int64(h), np.int64(_imagehash64(Image.fromarray(rgb)))) <= THRESHOLD


def _as_built(data: bytes) -> np.ndarray:
    """The BGR 512-px pixels the download stage hashes, through ``process_image`` itself."""
    res = process_image(data)
    assert res.status == "success", res.error
    return cv2.imdecode(np.frombuffer(res.jpg, np.uint8), cv2.IMREAD_COLOR), res.phash


def _copies(rgb: np.ndarray, rng: np.random.Generator) -> list[bytes]:
    """Web-style near duplicates: rescaled, re-encoded at low quality, cropped by a few percent."""
    h, w = rgb.shape[:2]
    f = rng.uniform(0.6, 0.9)
    small = cv2.resize(rgb, (round(w * f), round(h * f)), interpolation=cv2.INTER_AREA)
    c = max(1, int(0.03 * min(w, h)))
    return [_jpeg(small, 85), _jpeg(rgb, int(rng.integers(40, 60))), _jpeg(rgb[c:-c, c:-c], 90)]


def test_near_duplicate_detection_no_worse_than_imagehash() -> None:
    """40 photos, 3 transformed copies each (resize, JPEG q40–60, 3% crop), hashed on the pixels the
    download stage stores: per transformation the new hash misses no more copies (Hamming > 4) than
    imagehash's on the same pixels, finds every resized and re-encoded copy, matches no distinct pair,
    and stays within the threshold of imagehash's hash of the same image."""
    rng = np.random.default_rng(5)
    new, old = np.zeros((40, 4), np.int64), np.zeros((40, 4), np.int64)
    for i in range(40):
        rgb = _photo(100 + i, int(rng.integers(640, 1200)), int(rng.integers(480, 900)))
        for k, data in enumerate([_jpeg(rgb, 90), *_copies(rgb, rng)]):
            pixels, new[i, k] = _as_built(data)
            old[i, k] = _imagehash64(Image.fromarray(np.ascontiguousarray(pixels[..., ::-1])))
    missed = {
        name: [int((hamming(h[:, k], h[:, 0]) > THRESHOLD).sum()) for k in (1, 2, 3)]
        for name, h in (("new", new), ("old", old))
    }
    assert all(n <= o for n, o in zip(missed["new"], missed["old"], strict=True)), missed
    assert missed["new"][:2] == [0, 0], missed  # a crop moves the DCT grid: both hashes miss about half
    i, j = np.triu_indices(40, 1)
    assert hamming(new[i, 0], new[j, 0]).min() > 2 * THRESHOLD
    assert hamming(new, old).max() <= THRESHOLD
