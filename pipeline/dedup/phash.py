"""Perceptual hash shared by the download stage, near-duplicate dedupe and the demo pool generator.

One definition so the generator's guarantee ("unrelated images are far apart") is made with the very hash
the pipeline uses. DCT pHash, 64 bits, returned as a signed int64 so it fits Arrow/numpy int64 columns;
Hamming distance is computed on the raw bits.

The rule is the common DCT pHash (imagehash's ``phash`` with its default 8×8): a 32×32 grey reduction, the
unnormalised 2-D DCT-II, its 8×8 lowest frequencies, one bit per coefficient: above their median. The
reduction is OpenCV's area average (the same filter as the download's resize, GIL released) where
imagehash uses Pillow's Lanczos; the two hashes agree to within a few bits (docs/download.md, "Deliberate deviations").
"""

from __future__ import annotations

import cv2
import numpy as np
from PIL import Image

_SIDE, _BITS = 32, 8
# Rows k < 8 of the unnormalised DCT-II on 32 points, 2·cos(π·k·(2n+1) / 64) (scipy.fftpack.dct's type 2
# without norm): low = C · P · Cᵀ is the top-left 8×8 of the 2-D transform of P.
_DCT = 2 * np.cos(np.pi * np.arange(_BITS)[:, None] * (2 * np.arange(_SIDE)[None, :] + 1) / (2 * _SIDE))
_TO_GREY = {"RGB": cv2.COLOR_RGB2GRAY, "BGR": cv2.COLOR_BGR2GRAY}


def _grey(image: Image.Image | np.ndarray, order: str) -> np.ndarray:
    if isinstance(image, Image.Image):
        if image.mode == "L":
            return np.asarray(image)
        image, order = np.asarray(image.convert("RGB")), "RGB"
    if image.ndim == 2:
        return image
    return cv2.cvtColor(np.ascontiguousarray(image), _TO_GREY[order])


def phash64(image: Image.Image | np.ndarray, order: str = "RGB") -> int:
    """64-bit DCT pHash of a Pillow image or an (H, W, 3) uint8 array in channel ``order`` ("RGB"/"BGR")
    or an (H, W) grey one."""
    small = cv2.resize(_grey(image, order), (_SIDE, _SIDE), interpolation=cv2.INTER_AREA)
    low = _DCT @ small.astype(np.float64) @ _DCT.T
    bits = np.packbits((low > np.median(low)).ravel())  # first coefficient = most significant bit
    return int(bits.view(">i8")[0])


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise Hamming distance of int64 hashes (broadcasts)."""
    # Count on the unsigned view: for signed ints bitwise_count counts the bits of the absolute value.
    x = np.bitwise_xor(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)).view(np.uint64)
    return np.bitwise_count(x).astype(np.int64)
