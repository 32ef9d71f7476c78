"""Perceptual hash shared by the download stage, near-duplicate dedupe and the demo pool generator.

One definition so the generator's guarantee ("unrelated images are far apart") is made with the very hash
the pipeline uses. DCT pHash, 64 bits (imagehash's default 8×8), returned as a signed int64 so it fits
Arrow/numpy int64 columns; Hamming distance is computed on the raw bits.
"""

from __future__ import annotations

import imagehash
import numpy as np
from PIL import Image


def phash64(image: Image.Image) -> int:
    bits = imagehash.phash(image, hash_size=8).hash.flatten()  # (64,) bool
    value = int("".join("1" if b else "0" for b in bits), 2)
    return value - (1 << 64) if value >= (1 << 63) else value


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise Hamming distance of int64 hashes (broadcasts)."""
    # Count on the unsigned view: for signed ints bitwise_count counts the bits of the absolute value.
    x = np.bitwise_xor(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)).view(np.uint64)
    return np.bitwise_count(x).astype(np.int64)
