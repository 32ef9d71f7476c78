"""Image decode and augmentation in numpy/Pillow (no torchvision: its wheels break the CPU torch here).

- ``decode_image``: simplejpeg (libjpeg-turbo) with DCT downscaling to the smallest size that still covers
  the requested side, Pillow for other formats.
- ``decode_for_size`` and ``center_resize``: the one deterministic preprocessing, shared by training with
  augmentation off and by every encoder (scoring, evaluation, embedding), so a model is evaluated on the
  pixels it was trained on.
- ``random_resized_crop_box``: the crop rule of torchvision's RandomResizedCrop (ten area/aspect draws,
  then a centred fallback); ProLIP App. B.1 uses area (0.8, 1.0).
- ``draw_jitter`` and ``draw_grayscale``: the per-image parameters of torchvision's ColorJitter
  (brightness/contrast/saturation factors uniform in [1 − s, 1 + s], a hue shift in [−h, h], a random order
  per image) and RandomGrayscale; ProLIP uses (0.32, 0.32, 0.32, 0.08) with probability 0.8 and grayscale
  p 0.2. Only the parameters are drawn here: the pixels are changed on the training device, in one batched
  pass (pipeline/ingest/device_augment.py), so a decode task ends at a uint8 crop.

Decode and crop run per image on uint8 arrays (H, W, 3).
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


JITTER_OPS = ("brightness", "contrast", "saturation", "hue")  # ColorJitter's operations, by index
IDENTITY_FACTORS = (1.0, 1.0, 1.0, 0.0)  # the jitter factors that change nothing


def draw_jitter(
    n: int, strength: Sequence[float], p: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per-image ColorJitter parameters: (factors (n, 4) float32, order (n, 4) int8).

    With probability ``p`` an image gets brightness/contrast/saturation factors uniform in
    [max(0, 1 − s), 1 + s] and a hue shift uniform in [−h, h] (fraction of the colour wheel), applied in the
    random ``order`` (operation index per position, as torchvision's ColorJitter draws a permutation per
    call); otherwise, and for an operation of strength 0, the identity factors. The pixels are jittered on
    the training device (pipeline/ingest/device_augment.py).
    """
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
    order = np.argsort(rng.random((n, 4)), axis=1).astype(np.int8)  # (n, 4): operation at each position
    off = ~(rng.random(n) < p)[:, None] | (np.asarray([b, c, s, hue]) <= 0)[None, :]  # (n, 4)
    return np.where(off, np.float32(IDENTITY_FACTORS), factors).astype(np.float32), order


def draw_grayscale(n: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """bool (n,): which images RandomGrayscale(p) turns grey (ITU-R 601-2 luma, on the device)."""
    return rng.random(n) < p
