"""Decode/resize/blur/encode on images built in code: sizes, modes, orientation, bounds, blur strength."""

from __future__ import annotations

import importlib.util
import io
import math
import os
import struct
import types
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps
from scipy import ndimage

from pipeline.dedup.phash import hamming, phash64
from pipeline.download.resize import blur_boxes, dct_factor, output_size, process_image


def _textured(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Gradients plus correlated noise: texture that blurring visibly removes and JPEG keeps well."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w, 1), yy * 255 / max(h, 1), (xx + yy) % 64 * 4], axis=-1)
    # Luma-only noise: 4:2:0 JPEG would smear per-channel noise and drown the comparisons below.
    noise = ndimage.gaussian_filter(rng.normal(0, 1, (h, w)), sigma=1.5)[..., None]
    return np.clip(base * 0.6 + 50 + noise * 150, 0, 255).astype(np.uint8)


def _encode(arr_or_im, fmt: str = "JPEG", **kw) -> bytes:
    im = arr_or_im if isinstance(arr_or_im, Image.Image) else Image.fromarray(arr_or_im)
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _decode(jpg: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB"))


@pytest.mark.parametrize(
    ("w", "h", "expected"),
    [(1000, 750, (512, 384)), (750, 1000, (384, 512)), (100, 80, (100, 80)), (512, 300, (512, 300)),
     (1025, 3, (512, 1)), (1001, 333, (512, 170))],
)  # fmt: skip
def test_output_size_is_keep_ratio_largest_downscale_only(w: int, h: int, expected: tuple[int, int]) -> None:
    assert output_size(w, h, 512) == expected


def test_large_jpeg_downscaled_to_longest_512() -> None:
    res = process_image(_encode(_textured(1000, 750), quality=90))
    assert res.status == "success", res.error
    assert (res.width, res.height, res.original_width, res.original_height) == (512, 384, 1000, 750)
    assert _decode(res.jpg).shape == (384, 512, 3)
    assert hamming(np.int64(res.phash), np.int64(phash64(Image.open(io.BytesIO(res.jpg))))) <= 4


def test_small_image_not_upscaled_and_exact_size_kept() -> None:
    small = process_image(_encode(_textured(120, 90), "PNG"))
    assert (small.width, small.height) == (120, 90)
    exact = process_image(_encode(_textured(512, 200), "PNG"))
    assert (exact.width, exact.height) == (512, 200)
    assert _decode(exact.jpg).shape == (200, 512, 3)


def test_html_and_empty_are_not_images() -> None:
    assert process_image(b"<!doctype html><html>nope</html>").status == "failed_to_resize:not_an_image"
    assert process_image(b"").status == "failed_to_resize:not_an_image"


def test_corrupt_and_truncated_jpeg() -> None:
    good = _encode(_textured(200, 150), quality=90)
    garbage = good[:200] + bytes(np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8))
    assert process_image(garbage).status == "failed_to_resize:corrupt"
    assert process_image(good[: len(good) // 2]).status == "failed_to_resize:corrupt"
    assert process_image(b"\xff\xd8\xff\xe0garbage").status == "failed_to_resize:corrupt"


def _png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG that declares ``width``×``height`` pixels: a decompression bomb's header."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_decompression_bomb_refused_from_header() -> None:
    bomb = _png_header_only(40_000, 40_000)
    assert len(bomb) < 200
    assert process_image(bomb).status == "failed_to_resize:too_many_pixels"
    # Below Pillow's own limit, our bound still applies before any decoding.
    assert process_image(_png_header_only(20_000, 5_000), max_pixels=50_000_000).status == (
        "failed_to_resize:too_many_pixels"
    )
    assert process_image(_encode(_textured(100, 100), "PNG"), max_pixels=5_000).status == (
        "failed_to_resize:too_many_pixels"
    )


def test_cmyk_jpeg_becomes_rgb() -> None:
    rgb = np.zeros((64, 96, 3), np.uint8)
    rgb[:, :48] = (220, 30, 30)
    rgb[:, 48:] = (30, 30, 220)
    res = process_image(_encode(Image.fromarray(rgb).convert("CMYK"), quality=95))
    out = _decode(res.jpg).astype(int)
    assert res.status == "success" and out.shape == (64, 96, 3)
    assert np.abs(out[32, 10] - (220, 30, 30)).max() < 30 and np.abs(out[32, 80] - (30, 30, 220)).max() < 30


def test_rgba_composited_on_white_like_img2dataset() -> None:
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, 20:, 3] = 255  # right half opaque red, left half fully transparent
    out = _decode(process_image(_encode(rgba, "PNG")).jpg).astype(int)
    assert np.abs(out[20, 5] - 255).max() <= 3  # white
    assert np.abs(out[20, 35] - (200, 0, 0)).max() <= 6


def test_palette_with_transparency_and_grayscale_and_16bit() -> None:
    pal = Image.new("P", (30, 30), 0)
    pal.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    pal.paste(1, (15, 0, 30, 30))
    pal.info["transparency"] = 0
    out = _decode(process_image(_encode(pal, "GIF", transparency=0)).jpg).astype(int)
    assert np.abs(out[15, 5] - 255).max() <= 3 and np.abs(out[15, 25] - (0, 255, 0)).max() <= 6

    gray = process_image(_encode(Image.fromarray(_textured(50, 40)[..., 0], "L"), quality=95))
    assert gray.status == "success" and _decode(gray.jpg).shape == (40, 50, 3)
    assert Image.open(io.BytesIO(gray.jpg)).mode == "RGB"

    deep = Image.fromarray(np.full((20, 20), 40_000, np.uint16))
    out16 = _decode(process_image(_encode(deep, "PNG")).jpg)
    assert abs(int(out16[10, 10, 0]) - 40_000 // 256) <= 2  # scaled, not clipped to white


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_applied_like_pillow(orientation: int) -> None:
    arr = np.zeros((60, 90, 3), np.uint8)
    arr[:30, :30] = (255, 0, 0)  # a red corner shows where the top-left went
    arr[40:, 70:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(Image.fromarray(arr), quality=95, exif=exif.tobytes())
    res = process_image(data)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")).astype(int)
    out = _decode(res.jpg).astype(int)
    assert out.shape == expected.shape
    assert (res.width, res.height) == (res.original_width, res.original_height) == expected.shape[1::-1]
    assert np.abs(out - expected).mean() < 3


def _reference_blur(img: np.ndarray, boxes: list[list[float]]) -> np.ndarray:
    """img2dataset ≤ 1.45's blur written independently with scipy (float, reflect-101 border)."""
    h, w = img.shape[:2]
    mask = np.zeros((h, w), np.float64)
    side = 0
    for b in boxes:
        x0, y0, x1, y1 = int(b[0] * w), int(b[1] * h), int(b[2] * w), int(b[3] * h)
        d = max(x1 - x0, y1 - y0)
        side = max(side, d)
        mask[max(0, int(y0 - 0.1 * d)) : int(y1 + 0.1 * d), max(0, int(x0 - 0.1 * d)) : int(x1 + 0.1 * d)] = 1
    sigma = 0.1 * side
    trunc = math.ceil(4 * sigma) / sigma  # scipy's radius = int(truncate·σ + 0.5) = ⌈4σ⌉ here
    f = img.astype(np.float64)
    blurred = ndimage.gaussian_filter(f, sigma=(sigma, sigma, 0), mode="mirror", truncate=trunc)
    soft = ndimage.gaussian_filter(mask, sigma=sigma, mode="mirror", truncate=trunc)[..., None]
    return np.clip(np.rint(f * (1 - soft) + blurred * soft), 0, 255)


def test_blur_matches_reference_gaussian_with_original_sigma() -> None:
    img = _textured(300, 200)
    boxes = [[0.2, 0.25, 0.4, 0.6], [0.7, 0.1, 0.75, 0.2]]  # largest box 60×70 px → σ = 7, kernel 57
    out = blur_boxes(img, boxes)
    ref = _reference_blur(img, boxes)
    assert np.abs(out.astype(int) - ref).max() <= 2  # float32 (OpenCV) vs float64 (scipy)
    # Deep inside the big box the result is the plain Gaussian with σ = 0.1 · 70 px.
    inner = ndimage.gaussian_filter(img.astype(float), sigma=(7, 7, 0), mode="mirror", truncate=4)
    deep = (slice(75, 95), slice(85, 95))  # ≥ ⌈4σ⌉ = 28 px inside the grown box 53..127 × 43..127
    assert np.abs(out[deep].astype(int) - np.rint(inner[deep])).max() <= 2
    # The 1.46+ blur (σ from kernel 2·⌈σ⌉+1 = 15 → 0.3·6+0.8 = 2.6) leaves far more texture behind.
    weak = cv2.GaussianBlur(img, (15, 15), 0)

    def detail(a: np.ndarray) -> float:  # mean horizontal gradient: texture left in the face region
        return float(np.abs(np.diff(a[75:95, 80:100].astype(float), axis=1)).mean())

    assert detail(out) < 0.5 * detail(weak) < 0.5 * detail(img)


def test_blur_changes_only_the_feathered_box_region() -> None:
    img = _textured(300, 200)
    out = blur_boxes(img, [[0.4, 0.4, 0.5, 0.5]])  # 30×20 px → σ = 3, grown box 117..153 × 77..123
    changed = np.argwhere(np.any(out != img, axis=-1))
    reach = 3 + 12  # growth 0.1·30 plus the mask feather radius ⌈4σ⌉
    assert changed[:, 1].min() >= 120 - reach and changed[:, 1].max() < 150 + reach
    assert changed[:, 0].min() >= 80 - reach and changed[:, 0].max() < 100 + reach
    assert np.array_equal(blur_boxes(img, []), img)


def _img2dataset_blurrer():
    """img2dataset's own ``blurrer.py`` from the installed package, loaded by file: the package's
    ``__init__`` imports its whole CLI stack (~15 s); the module itself needs numpy and albumentations."""
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    found = importlib.util.find_spec("img2dataset")
    if found is None or not found.submodule_search_locations:
        pytest.skip("img2dataset is not installed")
    path = os.path.join(found.submodule_search_locations[0], "blurrer.py")
    spec = importlib.util.spec_from_file_location("img2dataset_blurrer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Boxes that pin each rule: inside, touching the right/bottom edge (the mask stops at W−1/H−1), the
# whole image, partly or wholly outside [0, 1] (σ from the unclamped box), inverted, zero-size, thin.
_EDGE_BOXES = [
    [[0.2, 0.25, 0.4, 0.6], [0.7, 0.1, 0.75, 0.2]],
    [[0.9, 0.9, 1.0, 1.0]],
    [[0.0, 0.0, 1.0, 1.0]],
    [[0.8, -0.2, 1.3, 0.4]],
    [[-0.5, -0.5, -0.1, -0.1], [0.45, 0.45, 0.5, 0.5]],
    [[1.2, 1.2, 1.6, 1.9]],
    [[0.6, 0.6, 0.4, 0.4]],
    [[0.3, 0.3, 0.3, 0.3]],
    [[0.5, 0.1, 0.5, 0.9]],
    [[0.1, 0.5, 0.9, 0.5004]],
    [[0.0, 0.0, 0.004, 0.004]],
    [[0.999, 0.999, 1.0, 1.0]],
]


def _random_boxes(rng: np.random.Generator) -> list[list[float]]:
    out = []
    for _ in range(int(rng.integers(1, 4))):
        if rng.random() < 0.5:
            x0, x1 = np.sort(rng.uniform(0, 1, 2))
            y0, y1 = np.sort(rng.uniform(0, 1, 2))
            out.append([float(x0), float(y0), float(x1), float(y1)])
        else:
            out.append([float(v) for v in rng.uniform(-0.3, 1.3, 4)])
    return out


def test_blur_is_pixel_identical_to_img2dataset_blurrer() -> None:
    """Our blur against img2dataset's ``BoundingBoxBlurrer`` called directly on the same image. The
    installed release (1.47) differs from 1.40, which DataComp pinned, only in its Gaussian call: 1.40
    called ``albumentations.augmentations.gaussian_blur(img, ksize=2·⌈4σ⌉+1, sigma=σ)`` with σ = 0.1·d;
    for that variant the module's ``A.GaussianBlur`` is swapped for exactly that call, everything else
    (box scaling, growth, clipping, mask, blend, truncation) runs as installed."""
    blurrer_mod = _img2dataset_blurrer()
    albumentations = blurrer_mod.A
    blurrer = blurrer_mod.BoundingBoxBlurrer()
    rng = np.random.default_rng(7)
    cases = [(300, 200, b) for b in _EDGE_BOXES] + [(97, 61, b) for b in _EDGE_BOXES]
    cases += [(int(rng.integers(16, 400)), int(rng.integers(16, 400)), _random_boxes(rng)) for _ in range(40)]
    for i, (w, h, boxes) in enumerate(cases):
        img = _textured(w, h, seed=i)
        assert np.array_equal(blur_boxes(img, boxes, "img2dataset_1.47"), blurrer(img, boxes)), (w, h, boxes)
        side = max(0, *(max(int(b[2] * w) - int(b[0] * w), int(b[3] * h) - int(b[1] * h)) for b in boxes))
        sigma = 0.1 * side
        ksize = int(2 * np.ceil(4 * sigma)) + 1

        def blur140(image: np.ndarray, k: int = ksize, s: float = sigma) -> dict[str, np.ndarray]:
            return {"image": albumentations.augmentations.gaussian_blur(image, ksize=k, sigma=s)}

        # 1.40's call in place of 1.47's A.GaussianBlur(blur_limit=(k, k))
        blurrer_mod.A = types.SimpleNamespace(GaussianBlur=lambda **_: blur140)
        try:
            reference = blurrer(img, boxes)
        finally:
            blurrer_mod.A = albumentations
        ours = blur_boxes(img, boxes)
        assert np.array_equal(ours, reference), (w, h, boxes, np.abs(ours.astype(int) - reference).max())
    with pytest.raises(ValueError, match="variant"):
        blur_boxes(_textured(20, 20), [[0.1, 0.1, 0.5, 0.5]], "rounded")


def test_blur_mask_stops_before_the_last_row_and_column() -> None:
    """img2dataset clips the grown box to W−1/H−1 as a slice end, so a whole-image box leaves the last
    column out of the mask; blurred pixels are truncated back to uint8, not rounded."""
    img = _textured(50, 40)
    out = blur_boxes(img, [[0.0, 0.0, 1.0, 1.0]])  # d = 50 → σ = 5: every pixel is blended
    inner = cv2.GaussianBlur(img.astype(np.float32) / 255.0, (41, 41), 5.0)
    assert np.array_equal(out[:20, :20], (inner[:20, :20] * 255.0).astype(np.uint8))  # truncated, not rounded
    assert not np.array_equal(out[:, -1], (inner[:, -1] * 255.0).astype(np.uint8))  # mask ends at W−2


def test_blur_uses_unclamped_boxes_for_sigma() -> None:
    img = _textured(200, 100)
    outside = blur_boxes(img, [[0.4, 0.4, 0.6, 1.6]])  # 40×160 px box → σ = 16 (60 px of it lie inside)
    clamped = blur_boxes(img, [[0.4, 0.4, 0.6, 1.0]])  # 40×60 px → σ = 6
    region = (slice(50, 95), slice(85, 115))
    detail = [float(np.abs(np.diff(a[region].astype(float), axis=1)).mean()) for a in (outside, clamped)]
    assert detail[0] < detail[1]
    assert np.array_equal(blur_boxes(img, [[0.6, 0.6, 0.4, 0.4]]), img)  # inverted: empty mask, σ = 0
    assert np.array_equal(blur_boxes(img, [[0.3, 0.3, 0.3, 0.3]]), img)  # zero size


def test_blur_happens_after_resize_in_output_pixels() -> None:
    big = _textured(800, 600)
    boxes = [[0.3, 0.3, 0.5, 0.6]]
    data = _encode(big, "PNG", compress_level=1)
    res = process_image(data, face_bboxes=boxes)
    expected = blur_boxes(cv2.resize(big, (512, 384), interpolation=cv2.INTER_AREA), boxes)
    ok, jpg = cv2.imencode(".jpg", cv2.cvtColor(expected, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok and res.jpg == jpg.tobytes()  # resize → blur → OpenCV q95: byte for byte
    unblurred = process_image(data, face_bboxes=boxes, blur_faces=False)
    far = (slice(0, 40), slice(0, 80))  # feathered box starts at y 58, x 96 (+ a 16 px JPEG MCU)
    assert np.array_equal(_decode(res.jpg)[far], _decode(unblurred.jpg)[far])
    assert not np.array_equal(_decode(res.jpg)[150:200, 200:240], _decode(unblurred.jpg)[150:200, 200:240])
    assert process_image(data, face_bboxes=[[0.9, 0.9, "x", None], [0.5]]).status == "success"


def test_dct_downscale_path_stays_close_to_full_decode() -> None:
    """The margin is now a parameter (``DownloadConfig.jpeg_dct_margin``, default 3), not a module
    constant: 0 forces the full decode the scaled outputs are compared with, as before."""
    assert dct_factor(1000, 750, 512, 384) == 1 and dct_factor(4000, 3000, 512, 384) == 2
    assert dct_factor(8000, 6000, 512, 384) == 4 and dct_factor(3000, 2250, 512, 384) == 1
    assert dct_factor(3000, 2250, 512, 384, 2) == 2 and dct_factor(2040, 1600, 512, 384, 2) == 1
    assert dct_factor(1000, 750, 512, 384, 1) == 1 and dct_factor(1024, 768, 512, 384, 1) == 2
    assert dct_factor(4000, 3000, 512, 384, 1) == 4 and dct_factor(4000, 3000, 512, 384, 2) == 2
    assert dct_factor(8000, 6000, 512, 384, 0) == 1 and dct_factor(9000, 9000, 32, 32, 1) == 8
    big = cv2.resize(_textured(400, 300), (1600, 1200), interpolation=cv2.INTER_CUBIC)
    data = _encode(big, quality=92)
    assert dct_factor(1600, 1200, 256, 192) == 2
    full = _decode(process_image(data, image_size=256, dct_margin=0).jpg).astype(float)
    for margin, floor in ((3, 40), (2, 40), (1, 30)):
        fast = _decode(process_image(data, image_size=256, dct_margin=margin).jpg).astype(float)
        psnr = 10 * math.log10(255**2 / np.mean((fast - full) ** 2))
        assert floor < psnr < math.inf, (margin, psnr)


def _old_path_jpeg(data: bytes, dct: int = 1) -> bytes:
    """What process_image encoded before pixels stayed BGR: RGB decode (simplejpeg for RGB/grey JPEGs,
    Pillow for the rest, transparency composited on white), INTER_AREA, RGB→BGR, OpenCV q95."""
    import simplejpeg

    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG" and im.mode in ("RGB", "L"):
        w, h = im.size
        rgb = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-w // dct), min_height=-(-h // dct))
    elif "A" in im.mode:
        rgba = np.asarray(im.convert("RGBA")).astype(np.float32)
        a = rgba[..., 3:] / 255.0
        rgb = np.rint(rgba[..., :3] * a + 255.0 * (1 - a)).astype(np.uint8)
    else:
        rgb = np.asarray(im.convert("RGB"))
    size = output_size(im.size[0], im.size[1], 512)
    if rgb.shape[1::-1] != size:
        rgb = cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    return buf.tobytes()


def test_bgr_pipeline_bytes_identical_to_the_rgb_path() -> None:
    """Decoding straight to BGR and dropping the RGB→BGR conversion changes no output byte: RGB, grey,
    CMYK and 4:4:4 JPEGs, a DCT-downscaled large one, PNG with alpha, a palette GIF, small and large."""
    tex = _textured(1300, 900, seed=3)
    rgba = np.dstack(
        [_textured(700, 500, seed=4), np.tile(np.arange(700, dtype=np.uint8)[None, :] // 3, (500, 1))]
    )
    cases = {
        "rgb": (_encode(tex, quality=90), 1),
        "rgb 4:4:4 small": (_encode(tex[:300, :400], quality=95, subsampling=0), 1),
        "grey": (_encode(Image.fromarray(tex[..., 1]), quality=90), 1),
        "cmyk": (_encode(Image.fromarray(tex).convert("CMYK"), quality=90), 1),
        "large, DCT 1/2": (
            _encode(cv2.resize(tex, (4000, 2770), interpolation=cv2.INTER_CUBIC), quality=85),
            2,
        ),
        "png alpha": (_encode(Image.fromarray(rgba, "RGBA"), "PNG"), 1),
        "gif palette": (_encode(Image.fromarray(tex[:200, :300]).quantize(64), "GIF"), 1),
    }
    for name, (data, dct) in cases.items():
        res = process_image(data, blur_faces=False)
        assert res.status == "success", (name, res.error)
        assert res.jpg == _old_path_jpeg(data, dct), name


@pytest.mark.slow
def test_byte_identical_to_img2dataset_resizer_without_dct_or_blur() -> None:
    resizer_mod = pytest.importorskip("img2dataset.resizer")  # ~15 s import (wandb, ray): slow marker
    resizer = resizer_mod.Resizer(512, "keep_ratio_largest", True)
    for w, h in [(1000, 750), (640, 1000), (300, 200)]:
        data = _encode(_textured(w, h, seed=w), quality=90)
        jpg, width, height, ow, oh, err = resizer(io.BytesIO(data))
        ours = process_image(data)
        assert err is None and (ours.width, ours.height, ours.original_width, ours.original_height) == (
            width,
            height,
            ow,
            oh,
        )
        assert ours.jpg == jpg
