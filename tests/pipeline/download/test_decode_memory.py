"""The integer, strip-wise decode: the same pixels as the float conversion it replaced, for every mode, and
no full-resolution temporary wider than the uint8 RGB result."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from pipeline.download import resize
from pipeline.download.resize import process_image


def _float_reference(im: Image.Image) -> np.ndarray:
    """The conversion this project used before (float alpha blend on white, 16-bit >> 8), in float64."""
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = np.asarray(im.convert("RGBA"), dtype=np.float64)
        alpha = rgba[..., 3:] / 255.0
        return np.rint(rgba[..., :3] * alpha + 255.0 * (1.0 - alpha)).clip(0, 255).astype(np.uint8)
    if im.mode.startswith("I;16") or im.mode == "I":
        arr = np.asarray(im).astype(np.int64)
        if im.mode != "I" or arr.max(initial=0) > 255:
            arr = arr >> 8
        return np.repeat(arr.clip(0, 255).astype(np.uint8)[..., None], 3, axis=2)
    if im.mode == "F":
        return np.repeat(np.asarray(im).clip(0, 255).astype(np.uint8)[..., None], 3, axis=2)
    return np.asarray(im.convert("RGB"))


def _images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(3)
    h, w = 37, 53
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    rgba[0, :, 3], rgba[1, :, 3] = 0, 255
    pal = Image.fromarray(rgba[..., :3]).quantize(16)
    pal.info["transparency"] = 3
    return {
        "RGBA": Image.fromarray(rgba, "RGBA"),
        "LA": Image.fromarray(rgba[..., :2].copy(), "LA"),
        "RGBa": Image.fromarray(rgba, "RGBA").convert("RGBa"),
        "P+transparency": pal,
        "P": Image.fromarray(rgba[..., :3]).quantize(16),
        "I;16": Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16)),
        "I wide": Image.fromarray(rng.integers(-70000, 70000, (h, w), dtype=np.int32), "I"),
        "I narrow": Image.fromarray(rng.integers(-5, 250, (h, w), dtype=np.int32), "I"),
        "F": Image.fromarray(rng.uniform(-20, 300, (h, w)).astype(np.float32), "F"),
        "CMYK": Image.fromarray(rgba, "RGBA").convert("CMYK"),
        "L": Image.fromarray(rgba[..., 0]),
        "1": Image.fromarray(rgba[..., 0] > 128),
    }


@pytest.mark.parametrize("strip_pixels", [1, 200, 1 << 18])  # one row per strip, a few rows, one strip
@pytest.mark.parametrize("name", list(_images()))
def test_strip_conversion_equals_float_reference(name: str, strip_pixels: int, monkeypatch) -> None:
    monkeypatch.setattr(resize, "STRIP_PIXELS", strip_pixels)
    im = _images()[name]
    got = resize._to_rgb(im)
    assert got.dtype == np.uint8 and got.shape == (im.size[1], im.size[0], 3)
    np.testing.assert_array_equal(got, _float_reference(im))


def test_composite_exact_over_every_value_and_alpha() -> None:
    c, a = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    rgba = np.stack([c, c, c, a], axis=-1).astype(np.uint8)
    exact = np.rint((c * a + 255 * (255 - a)) / 255).astype(np.uint8)
    assert (resize._composite_on_white(rgba) == exact[..., None]).all()
    float32 = np.rint(c * np.float32(a / 255.0) + 255.0 * (1 - np.float32(a / 255.0))).astype(np.uint8)
    assert (float32 == exact).all()  # img2dataset's float32 formula: the same values


def _png(mode_image: Image.Image) -> bytes:
    buf = io.BytesIO()
    mode_image.save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["RGBA", "I;16", "RGB"])
def test_large_canvas_temporaries_stay_below_the_rgb_copy(kind: str) -> None:
    """numpy allocations (traced) peak at the uint8 RGB copy plus strips, not at a float or int64 copy."""
    side = 2000
    arr = np.zeros((side, side, 4), np.uint8)
    arr[::7, :, :] = 200
    arr[..., 3] = np.where(np.arange(side)[None, :] % 5 == 0, 40, 255)
    im = {"RGBA": Image.fromarray(arr, "RGBA"), "RGB": Image.fromarray(arr[..., :3].copy()),
          "I;16": Image.fromarray(arr[..., 0].astype(np.uint16) * 257)}[kind]  # fmt: skip
    data = _png(im)
    tracemalloc.start()
    try:
        res = process_image(data, image_size=256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res.status == "success" and (res.width, res.height) == (256, 256)
    # 3 B/px for the RGB copy + strip temporaries (~40 B × STRIP_PIXELS); float32 RGBA alone was 16 B/px.
    assert peak < 3 * side * side + 40 * resize.STRIP_PIXELS + (4 << 20), peak


def test_process_image_output_unchanged_for_alpha_and_16bit() -> None:
    """End to end through the resize: the integer path gives the float path's output, byte for byte."""
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (700, 900, 4), dtype=np.uint8)
    for im in (Image.fromarray(rgba, "RGBA"), Image.fromarray(rng.integers(0, 65536, (700, 900), np.uint16))):
        ref = _float_reference(im)
        import cv2

        expected = cv2.resize(ref, (512, 398), interpolation=cv2.INTER_AREA)
        ok, buf = cv2.imencode(
            ".jpg", cv2.cvtColor(expected, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95]
        )
        res = process_image(_png(im), blur_faces=False)
        assert res.jpg == buf.tobytes()
