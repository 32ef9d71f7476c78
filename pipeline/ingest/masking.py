"""Masked-variant selection for the ProLIP inclusion loss L_inc(x ⊂ x_masked) (paper §4.1, Eq. 6).

Pure numpy, used by the training-ingest stage:

- ``select_for_masking``: which samples of each batch get a masked variant — exactly
  round(fraction·b) per batch of b (default 12.5%, §4.1), chosen by ranking a 64-bit hash of
  (uid, epoch, seed), so the choice is reproducible from the uid alone, independent of row order within
  the batch and of the worker that computes it, and changes from epoch to epoch.
- ``mask_text_tokens``: replace exactly round(ratio·n_content) content tokens per row with [MASK]
  (default 75%, §4.1, BERT-style [MASK] of Devlin et al.); padding, the end token and any
  ``protected_ids`` (e.g. CLIP's start token) are never masked.
- ``choose_kept_patches``: per-sample sorted indices of the K = round(keep_ratio·N) patches to keep
  (default 25% kept = 75% dropped, §4.1, MAE token drop; the official code keeps 75% — a bug, docs/math.md).

Rounding is half-up (``floor(x + 0.5)``), so a batch of 4 at 12.5% still gets one masked sample. Every
random choice ranks i.i.d. keys with ``argsort`` — no per-token Python loops.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from pipeline.common.hashing import splitmix64

_HEX_LUT = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_NIBBLE_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)  # (16,) bit offsets of 16 hex digits


def round_half_up(x: float | np.ndarray) -> np.ndarray:
    """floor(x + 0.5) as int64: the count rule used by every function here."""
    return np.floor(np.asarray(x, dtype=np.float64) + 0.5).astype(np.int64)


def _uid_words(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 words per key: integers as they are, 32-hex uids parsed, other strings hashed."""
    if keys.dtype.kind in "iu":
        return keys.astype(np.int64).view(np.uint64), np.zeros(len(keys), dtype=np.uint64)
    strings = keys.astype(str)
    if len(strings) and (np.char.str_len(strings) == 32).all():
        try:
            raw = np.frombuffer(strings.astype("S32").tobytes(), dtype=np.uint8).reshape(-1, 32)  # (n, 32)
        except UnicodeEncodeError:
            raw = np.full((len(strings), 32), ord("z"), dtype=np.uint8)  # not hex: take the hash path
        nibbles = _HEX_LUT[raw]  # (n, 32)
        if (nibbles >= 0).all():
            words = (nibbles.astype(np.uint64).reshape(-1, 2, 16) << _NIBBLE_SHIFTS).sum(axis=2)  # (n, 2)
            return words[:, 0], words[:, 1]
    # Not DataComp uids: one stable hash per string (Python's hash() is salted per process).
    digests = b"".join(hashlib.blake2b(s.encode(), digest_size=16).digest() for s in strings)
    words = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)  # (n, 2)
    return words[:, 0].copy(), words[:, 1].copy()


def sample_hash(keys: Sequence | np.ndarray, epoch: int, seed: int = 0) -> np.ndarray:
    """uint64 (n,) hash of (key, epoch, seed); keys are 32-hex uids, other strings or integer seeds."""
    keys = np.asarray(keys)
    if keys.ndim != 1:
        raise ValueError(f"keys must be 1-D, got shape {keys.shape}")
    hi, lo = _uid_words(keys)
    with np.errstate(over="ignore"):
        salt = splitmix64(np.array([epoch, seed], dtype=np.int64).view(np.uint64))  # (2,)
        h = splitmix64(lo ^ salt[1])
        h = splitmix64(h ^ hi)
        return splitmix64(h ^ salt[0])


def select_for_masking(
    keys: Sequence | np.ndarray,
    epoch: int,
    batch_size: int | None = None,
    fraction: float = 0.125,
    seed: int = 0,
) -> np.ndarray:
    """bool (n,): exactly round_half_up(fraction·b) True per consecutive batch of b = ``batch_size``.

    ``batch_size=None`` treats all n keys as one batch; the last batch may be shorter. The samples with
    the smallest (key, epoch, seed) hashes in their batch are chosen.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    hashes = sample_hash(keys, epoch, seed)  # (n,)
    n = len(hashes)
    if n == 0:
        return np.zeros(0, dtype=bool)
    bs = n if batch_size is None else int(batch_size)
    if bs <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n_batches = -(-n // bs)
    padded = np.full(n_batches * bs, np.iinfo(np.uint64).max, dtype=np.uint64)
    padded[:n] = hashes
    order = np.argsort(padded.reshape(n_batches, bs), axis=1, kind="stable")  # (nb, bs)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(bs)[None, :].repeat(n_batches, 0), axis=1)  # (nb, bs)
    sizes = np.full(n_batches, bs, dtype=np.int64)
    sizes[-1] = n - bs * (n_batches - 1)
    k = round_half_up(fraction * sizes)  # (nb,)
    return (rank < k[:, None]).reshape(-1)[:n]


def _generator(rng: np.random.Generator | int) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def mask_text_tokens(
    tokens: np.ndarray,
    pad_id: int,
    end_id: int,
    mask_id: int,
    ratio: float = 0.75,
    *,
    rng: np.random.Generator | int,
    protected_ids: Sequence[int] = (),
) -> np.ndarray:
    """Copy of int (B, L) ``tokens`` with exactly round_half_up(ratio·n_content) content tokens per row
    replaced by ``mask_id``; content = not pad, not end, not in ``protected_ids``."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (B, L), got shape {tokens.shape}")
    content = (tokens != pad_id) & (tokens != end_id) & ~np.isin(tokens, list(protected_ids))  # (B, L)
    k = round_half_up(ratio * content.sum(axis=1))  # (B,)
    keys = _generator(rng).random(tokens.shape)  # (B, L) in [0, 1)
    keys[~content] = 2.0  # non-content ranks after every content token
    rank = np.argsort(np.argsort(keys, axis=1, kind="stable"), axis=1, kind="stable")  # (B, L)
    return np.where(rank < k[:, None], mask_id, tokens).astype(tokens.dtype)  # (B, L)


def drop_masked_tokens(tokens: np.ndarray, mask_id: int, pad_id: int) -> np.ndarray:
    """Each row of ``tokens`` (B, L) with its [MASK] positions removed: the other tokens in their order, then
    padding, (B, L). A caption masked this way reads as a shorter caption rather than one with holes."""
    holes = tokens == mask_id
    order = np.argsort(holes, axis=1, kind="stable")  # kept positions first, each group in its order
    out = np.take_along_axis(tokens, order, axis=1)
    out[np.take_along_axis(holes, order, axis=1)] = pad_id
    return out


def choose_kept_patches(
    n_patches: int, batch: int, keep_ratio: float = 0.25, *, rng: np.random.Generator | int
) -> np.ndarray:
    """int64 (B, K) sorted patch indices to keep, K = max(1, round_half_up(keep_ratio·n_patches))."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    k = max(1, int(round_half_up(keep_ratio * n_patches)))
    keys = _generator(rng).random((batch, n_patches))  # (B, N)
    kept = np.argpartition(keys, k - 1, axis=1)[:, :k] if k < n_patches else np.argsort(keys, axis=1)
    return np.sort(kept, axis=1).astype(np.int64)  # (B, K)
