"""Duplicate decisions over narrow columns, made once in the driver: URL, exact-image and near-image dedupe.

Every rule is "keep the smallest uid of each group": the decision depends only on the data, never on
row order, so a resumed or re-partitioned build decides identically. Each function returns a boolean
mask, True for the rows to drop; the caller turns it into a status (``duplicate_url``,
``duplicate_image``, ``near_duplicate``). Nulls are never duplicates.

Grouping is vectorised (Arrow sorts, numpy run detection), URL normalisation too (Arrow string kernels;
only URLs outside the common http(s) shape go through ``urlnorm.normalize_url`` one by one).
Near duplicates use multi-index hashing (Norouzi et al., "Fast Search in Hamming Space with Multi-Index
Hashing", CVPR 2012): cutting 64-bit hashes into ``t + 1`` bands, two hashes within Hamming distance
``t`` agree exactly on at least one band (pigeonhole), so only hashes sharing a band value are compared.
Those ~13-bit buckets (t = 4) fill up as n grows (candidates ~ n²/2^13), so past ~10⁵–10⁶ distinct
hashes the code switches, by measured bucket sizes, to ``⌈(t+1)/2⌉`` ~21-bit bands searched at radius 1.
Both are exact. The default threshold (4 of 64 bits) is in ``pipeline.config.DedupeConfig``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.dedup.phash import hamming
from pipeline.dedup.urlnorm import normalize_urls

# Candidate pairs compared per step: bounds the (pairs, 64) bit matrix ``hamming`` builds to ~64 MB.
_PAIR_CHUNK = 1 << 20


def _strings(values: Sequence | np.ndarray | pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):  # large_string stays: a column past 2 GiB does not fit 32-bit offsets
        return values if pa.types.is_large_string(values.type) else values.cast(pa.string())
    if isinstance(values, np.ndarray) and values.dtype.kind in "US":
        values = values.astype(str).tolist()
    return pa.array(list(values), type=pa.string())


def _dropped_within_groups(keys: pa.Array, uids: pa.Array) -> np.ndarray:
    """True for rows whose non-null key is shared with a row that sorts first by (lower-cased) uid."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=bool)
    if len(uids) != n:
        raise ValueError(f"uids ({len(uids)}) and keys ({n}) differ in length")
    # 32-hex uids compare as strings exactly as they do as 128-bit integers once lower-cased.
    table = pa.table({"k": keys, "u": pc.utf8_lower(uids)})
    order = pc.sort_indices(table, sort_keys=[("k", "ascending"), ("u", "ascending")]).to_numpy()
    sorted_keys = keys.take(pa.array(order))
    same = pc.fill_null(pc.equal(sorted_keys.slice(1), sorted_keys.slice(0, n - 1)), False)
    dropped = np.zeros(n, dtype=bool)
    dropped[order[1:]] = same.to_numpy(zero_copy_only=False)
    return dropped


def url_duplicates(
    uids: Sequence[str] | np.ndarray | pa.Array, urls: Sequence[str | None] | pa.Array
) -> np.ndarray:
    """Rows whose normalised URL already belongs to a smaller uid (DataComp dedupes its pool by URL)."""
    return _dropped_within_groups(normalize_urls(_strings(urls)), _strings(uids))


def url_key_duplicates(keys: pa.Array, uids: pa.Array) -> np.ndarray:
    """``url_duplicates`` over URLs already normalised (``urlnorm.normalize_urls``): rows whose key belongs
    to a smaller uid."""
    return _dropped_within_groups(_strings(keys), _strings(uids))


def exact_duplicates(
    uids: Sequence[str] | np.ndarray | pa.Array, image_sha256: Sequence[str | None] | np.ndarray | pa.Array
) -> np.ndarray:
    """Rows whose downloaded bytes (sha256 hex) equal those of a smaller uid; null/"" never match."""
    keys = pc.utf8_lower(_strings(image_sha256))
    keys = pc.if_else(pc.equal(keys, ""), pa.scalar(None, pa.string()), keys)
    return _dropped_within_groups(keys, _strings(uids))


# --- near duplicates ----------------------------------------------------------------------------------


def _hashes(phash: Sequence | np.ndarray | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, validity) from an Arrow array, an integer array or an object array with None."""
    if isinstance(phash, pa.ChunkedArray):
        phash = phash.combine_chunks()
    if isinstance(phash, pa.Array):
        valid = phash.is_valid().to_numpy(zero_copy_only=False)
        if not (pa.types.is_integer(phash.type) or pa.types.is_null(phash.type)):
            raise TypeError(f"phash must be an integer column, got {phash.type}")
        values = pc.fill_null(phash.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return values.astype(np.int64, copy=False), valid
    arr = np.asarray(phash)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64, copy=False).view(np.int64), np.ones(len(arr), dtype=bool)
    if arr.dtype.kind == "i":
        return arr.astype(np.int64, copy=False), np.ones(len(arr), dtype=bool)
    if arr.dtype.kind == "f":
        # float64 keeps 53 bits: a 64-bit hash that went through it is silently wrong.
        raise TypeError(
            "phash arrived as floats (an int64 column with nulls turned to_numpy?): pass the pyarrow "
            "column itself or an int64 array"
        )
    valid = np.array([v is not None for v in arr.tolist()], dtype=bool)
    values = np.array([int(v) if v is not None else 0 for v in arr.tolist()], dtype=np.int64)
    return values, valid


def near_duplicates(
    uids: Sequence[str] | np.ndarray | pa.Array,
    phash: Sequence[int | None] | np.ndarray | pa.Array,
    threshold: int,
) -> np.ndarray:
    """Greedy clustering in uid order: a row is dropped when its pHash is within ``threshold`` bits of an
    earlier *kept* row. Equal to the O(n²) definition; cost ~O(n + candidate pairs) with multi-index
    hashing. Null hashes are never duplicates."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    uid_arr = _strings(uids)
    values, valid = _hashes(phash)
    n = len(values)
    if len(uid_arr) != n:
        raise ValueError(f"uids ({len(uid_arr)}) and phash ({n}) differ in length")
    dropped = np.zeros(n, dtype=bool)
    rows = np.flatnonzero(valid)
    if len(rows) == 0:
        return dropped
    order = pc.sort_indices(pc.utf8_lower(uid_arr.take(pa.array(rows)))).to_numpy()
    rows = rows[order]  # valid rows in uid order
    h = values[rows]
    # Rows repeating an earlier hash (distance 0) are always dropped: either their first holder is
    # kept, or it was dropped for a kept row that is then within threshold of them too.
    _, first = np.unique(h, return_index=True)
    reps = np.sort(first)
    kept_reps = reps[_greedy_keep(h[reps], threshold)]
    dropped[rows] = True
    dropped[rows[kept_reps]] = False
    return dropped


def near_pairs(h: np.ndarray, threshold: int) -> tuple[np.ndarray, np.ndarray]:
    """Every index pair i < j of int64 hashes ``h`` within ``threshold`` bits, each once (exact)."""
    h = np.ascontiguousarray(h, dtype=np.int64)
    if threshold >= 64:
        i, j = np.triu_indices(len(h), 1)
        return i.astype(np.int64), j.astype(np.int64)
    return _near_pairs(h, threshold)


def bands(m: int) -> list[tuple[int, int]]:
    """(shift, width) of ``m`` bands, as even as possible, over 64 bits."""
    widths = [64 // m + (1 if b < 64 % m else 0) for b in range(m)]
    shifts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(int).tolist()
    return list(zip(shifts, widths, strict=True))


def _greedy_keep(h: np.ndarray, threshold: int, radius: int | None = None) -> np.ndarray:
    """Kept mask over distinct hashes ``h`` given in uid order."""
    m = len(h)
    keep = np.ones(m, dtype=bool)
    if m < 2:
        return keep
    if threshold >= 64:
        keep[1:] = False  # every pair of 64-bit hashes is within 64 bits
        return keep
    i_all, j_all = _near_pairs(h, threshold, radius)
    if len(i_all) == 0:
        return keep
    # Decide in uid order; only rows with an earlier near neighbour need a look (a sparse set).
    by_j = np.lexsort((i_all, j_all))
    i_all, j_all = i_all[by_j], j_all[by_j]
    js, starts = np.unique(j_all, return_index=True)
    ends = np.append(starts[1:], len(j_all))
    for j, a, b in zip(js.tolist(), starts.tolist(), ends.tolist(), strict=True):
        if keep[i_all[a:b]].any():
            keep[j] = False
    return keep


def _band_keys(bits: np.ndarray, shift: int, width: int) -> np.ndarray:
    return (bits >> np.uint64(shift)) & np.uint64((1 << width) - 1)


def _collisions(keys: np.ndarray) -> int:
    """Pairs sharing a key (the candidate count of one exact-match pass)."""
    if len(keys) and int(keys.max()) < (1 << 24):
        counts = np.bincount(keys.astype(np.int64))
    else:
        counts = np.unique(keys, return_counts=True)[1]
    counts = counts.astype(np.int64)
    return int((counts * (counts - 1) // 2).sum())


def _plan(bits: np.ndarray, threshold: int) -> int:
    """Search radius per band, 0 or 1, whichever the bucket sizes say is cheaper.

    Generalised pigeonhole: with ``b`` bands, two hashes within ``t`` are within ``r`` on some band
    if ``b·(r+1) > t``. Radius 0 (``t+1`` exact bands) is one sort per band, but its ~``64/(t+1)``-bit
    buckets grow with n, so candidates grow as n²/2^w. Radius 1 (``⌈(t+1)/2⌉`` wider bands, one pass
    per band bit with that bit masked) costs ~w sorts per band but far fewer candidates at scale.
    Cost = candidates + one unit per row per sort (measured: a sort step ≈ a candidate check)."""
    n = len(bits)
    cost0 = n * (threshold + 1) + sum(_collisions(_band_keys(bits, s, w)) for s, w in bands(threshold + 1))
    if threshold < 1:
        return 0
    bands1 = bands((threshold + 2) // 2)
    cost1 = sum(w * (n + 2 * _collisions(_band_keys(bits, s, w))) for s, w in bands1)
    return 0 if cost0 <= cost1 else 1


def _near_pairs(h: np.ndarray, threshold: int, radius: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All index pairs i < j with hamming(h[i], h[j]) <= threshold, each once."""
    m = len(h)
    bits = h.view(np.uint64)
    radius = _plan(bits, threshold) if radius is None else radius
    found_i: list[np.ndarray] = []
    found_j: list[np.ndarray] = []
    for shift, width in bands(-(-(threshold + 1) // (radius + 1))):
        key = _band_keys(bits, shift, width)
        full = (1 << width) - 1
        # Radius 1: masking bit p puts keys differing only at p (and equal keys) into one bucket.
        masks = [full] if radius == 0 else [full ^ (1 << p) for p in range(width)]
        for mask in masks:
            for i, j in _bucket_pairs(key & np.uint64(mask)):
                close = hamming(h[i], h[j]) <= threshold
                found_i.append(i[close])
                found_j.append(j[close])
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pair = np.unique(np.concatenate(found_i).astype(np.int64) * m + np.concatenate(found_j))
    return pair // m, pair % m


def _bucket_pairs(key: np.ndarray):
    """Yield chunks (i, j), i < j, of every pair of positions sharing a key, ≤ ``_PAIR_CHUNK`` at once."""
    m = len(key)
    order = np.argsort(key, kind="stable")  # stable: within a bucket, positions ascend
    sk = key[order]
    starts = np.flatnonzero(np.concatenate([[True], sk[1:] != sk[:-1]]))
    ends = np.append(starts[1:], m)
    partners = np.repeat(ends, ends - starts) - np.arange(m) - 1  # later members of the same bucket
    cum = np.cumsum(partners)
    lo = int(np.searchsorted(cum, 0, side="right"))  # skip the leading rows without partners
    while lo < m and cum[-1] > (cum[lo - 1] if lo else 0):
        done = int(cum[lo - 1]) if lo else 0
        hi = max(int(np.searchsorted(cum, done + _PAIR_CHUNK, side="right")), lo + 1)
        counts = partners[lo:hi]
        src = np.repeat(np.arange(lo, hi), counts)
        offset = np.arange(len(src)) - np.repeat(np.cumsum(counts) - counts, counts) + 1
        yield order[src], order[src + offset]
        lo = hi
