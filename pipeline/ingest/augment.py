"""Image decode and augmentation in numpy/Pillow (no torchvision: its wheels break the CPU torch here).

- ``decode_image``: simplejpeg (libjpeg-turbo) with DCT downscaling to the smallest size that still covers
  the requested side, Pillow for other formats.
- ``decode_for_size`` and ``center_resize``: the one deterministic preprocessing, shared by training with
  augmentation off and by every encoder (scoring, evaluation, embedding), so a model is evaluated on the
  pixels it was trained on.
- ``random_resized_crop_box``: the crop rule of torchvision's RandomResizedCrop (ten area/aspect draws,
  then a centred fallback); ProLIP App. B.1 uses area (0.8, 1.0).
- ``color_jitter``: brightness/contrast/saturation factors uniform in [1 − s, 1 + s] and a hue shift in
  [−h, h], applied in a random order per image as torchvision's ColorJitter; ProLIP uses
  (0.32, 0.32, 0.32, 0.08) with probability 0.8. ``random_grayscale``: ITU-R 601-2 luma, p 0.2.

Everything operates on float arrays (n, H, W, 3) in [0, 1] and is vectorised over the images that take
an operation; only decode and crop run per image.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np


def decode_image(data: bytes, min_side: int = 0) -> np.ndarray:
    """(H, W, 3) uint8 RGB. JPEGs via simplejpeg, DCT-downscaled while both sides stay >= ``min_side``."""
    try:
        import simplejpeg

        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_side, min_width=min_side)
    except (ValueError, ImportError):
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))


def random_resized_crop_box(
    h: int, w: int, scale: Sequence[float], ratio: Sequence[float], rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of a crop covering a random area fraction in ``scale`` with aspect in ``ratio``.

    The rule of torchvision's RandomResizedCrop: ten draws (area uniform, aspect log-uniform); if none
    fits, the largest centred crop with the aspect clamped into ``ratio``.
    """
    area = h * w
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            return x0, y0, x0 + cw, y0 + ch
    aspect = w / h
    if aspect < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif aspect > ratio[1]:
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


def center_crop_box(h: int, w: int) -> tuple[int, int, int, int]:
    side = min(h, w)
    x0, y0 = (w - side) // 2, (h - side) // 2
    return x0, y0, x0 + side, y0 + side


# Decode at >= this × the output side: the DCT downscale stops short of the output, so a bicubic resize (which
# filters what it drops) does the last step, and random_resized_crop's smallest crop side (~0.77 of the
# image at area 0.6) still covers the output.
DECODE_MARGIN = 1.3


def decode_for_size(data: bytes, size: int) -> np.ndarray:
    """(H, W, 3) uint8 RGB decoded for an output side of ``size`` (both sides >= DECODE_MARGIN × size when
    the image is that large)."""
    return decode_image(data, math.ceil(size * DECODE_MARGIN))


def center_resize(arr: np.ndarray, size: int) -> np.ndarray:
    """(size, size, 3) uint8: the centred square crop of ``arr``, bicubic-resized."""
    from PIL import Image

    box = center_crop_box(*arr.shape[:2])
    return np.asarray(Image.fromarray(arr).resize((size, size), Image.BICUBIC, box=box))


def _gray(x: np.ndarray) -> np.ndarray:
    # ITU-R 601-2 luma, the weights Pillow and torchvision use for grayscale.
    return x[..., 0] * 0.299 + x[..., 1] * 0.587 + x[..., 2] * 0.114  # (n, H, W)


def rgb_to_hsv(x: np.ndarray) -> np.ndarray:
    """(..., 3) RGB in [0, 1] → HSV in [0, 1]."""
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    maxc, minc = x.max(-1), x.min(-1)
    delta = maxc - minc
    safe = np.where(delta > 0, delta, 1.0)
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    h = np.where(r == maxc, bc - gc, np.where(g == maxc, 2.0 + rc - bc, 4.0 + gc - rc))
    h = np.where(delta > 0, (h / 6.0) % 1.0, 0.0)
    s = np.where(maxc > 0, delta / np.where(maxc > 0, maxc, 1.0), 0.0)
    return np.stack([h, s, maxc], -1).astype(x.dtype)


def hsv_to_rgb(x: np.ndarray) -> np.ndarray:
    """(..., 3) HSV in [0, 1] → RGB in [0, 1]."""
    h, s, v = x[..., 0], x[..., 1], x[..., 2]
    i = np.floor(h * 6.0)
    f = h * 6.0 - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    i = i.astype(np.int64) % 6
    r = np.choose(i, [v, q, p, p, t, v])
    g = np.choose(i, [t, v, v, q, p, p])
    b = np.choose(i, [p, p, t, v, v, q])
    return np.stack([r, g, b], -1).astype(x.dtype)


def _blend(x: np.ndarray, other: np.ndarray, factor: np.ndarray) -> np.ndarray:
    f = factor.reshape(-1, *([1] * (x.ndim - 1)))
    return np.clip(f * x + (1.0 - f) * other, 0.0, 1.0)


def _adjust(op: int, x: np.ndarray, f: np.ndarray) -> np.ndarray:
    if op == 0:  # brightness: blend with black
        return _blend(x, np.zeros_like(x), f)
    if op == 1:  # contrast: blend with the image's mean luma
        return _blend(x, _gray(x).mean(axis=(1, 2)).reshape(-1, 1, 1, 1), f)
    if op == 2:  # saturation: blend with the grayscale image
        return _blend(x, _gray(x)[..., None], f)
    hsv = rgb_to_hsv(x)
    hsv[..., 0] = (hsv[..., 0] + f.reshape(-1, 1, 1)) % 1.0
    return hsv_to_rgb(hsv)


def color_jitter(x: np.ndarray, strength: Sequence[float], p: float, rng: np.random.Generator) -> np.ndarray:
    """Colour jitter on (n, H, W, 3) floats in [0, 1], each image with probability ``p``.

    ``strength`` = (brightness, contrast, saturation, hue): factors uniform in [1 − s, 1 + s], hue shift
    uniform in [−h, h] (fraction of the colour wheel); the four run in a random order per image, as
    torchvision's ColorJitter. Vectorised per (position, operation) over the images that need it.
    """
    n = x.shape[0]
    apply = rng.random(n) < p
    b, c, s, hue = strength
    factors = np.stack(
        [
            rng.uniform(max(0.0, 1 - b), 1 + b, n),
            rng.uniform(max(0.0, 1 - c), 1 + c, n),
            rng.uniform(max(0.0, 1 - s), 1 + s, n),
            rng.uniform(-hue, hue, n),
        ],
        axis=1,
    ).astype(np.float32)  # (n, 4)
    order = np.argsort(rng.random((n, 4)), axis=1)  # (n, 4): operation at each position
    active = [b > 0, c > 0, s > 0, hue > 0]
    x = x.copy()
    for pos in range(4):
        for op in range(4):
            idx = np.flatnonzero(apply & (order[:, pos] == op))
            if idx.size and active[op]:
                x[idx] = _adjust(op, x[idx], factors[idx, op])
    return x


def random_grayscale(x: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    idx = np.flatnonzero(rng.random(x.shape[0]) < p)
    if idx.size:
        x = x.copy()
        x[idx] = _gray(x[idx])[..., None]
    return x
