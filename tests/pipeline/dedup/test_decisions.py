"""Dedupe decisions: keep the smallest uid, independent of row order; multi-index hashing == brute force."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.dedup import decisions as D
from pipeline.dedup.decisions import exact_duplicates, near_duplicates, url_duplicates

U = [f"{i:032x}" for i in range(8)]


def test_url_duplicates_keep_smallest_uid_after_normalisation():
    uids = [U[5], U[2], U[7], U[1], U[3], U[4], U[6], U[0]]
    urls = [
        "http://Example.com:80/a.jpg#frag",  # == row 3's URL once normalised
        "http://example.com/b.jpg",
        "http://example.com/b.jpg",
        " HTTP://example.com/a.jpg",
        "http://example.com/A.jpg",  # paths are case-sensitive: unique
        None,
        None,  # nulls never group
        "https://example.com:443/b.jpg",  # https default port == https://example.com/b.jpg, alone
    ]
    assert url_duplicates(uids, urls).tolist() == [True, False, True, False, False, False, False, False]


def test_url_duplicates_independent_of_row_order():
    rng = np.random.default_rng(0)
    uids = [f"{v:032x}" for v in rng.integers(0, 2**62, size=500)]
    urls = [f"http://h{v}.example.com/x.jpg" for v in rng.integers(0, 120, size=500)]
    base = url_duplicates(uids, urls)
    perm = rng.permutation(500)
    again = url_duplicates(np.array(uids)[perm], pa.array(np.array(urls)[perm]))
    assert np.array_equal(again, base[perm])
    kept = {}
    for u, url, d in zip(uids, urls, base, strict=True):
        if not d:
            kept[url] = u
    assert len(kept) == len(set(urls))
    assert all(kept[url] <= u for u, url in zip(uids, urls, strict=True))


def test_exact_duplicates_smallest_uid_and_nulls():
    uids = np.array([U[3], U[1], U[2], U[0], U[4], U[5]], dtype=object)
    sha = np.array(["aa", "AA", "bb", None, "", ""], dtype=object)
    assert exact_duplicates(uids, sha).tolist() == [True, False, False, False, False, False]
    assert exact_duplicates(uids[::-1], sha[::-1]).tolist() == [False, False, False, False, False, True]


def brute_force(uids: list[str], phash: list[int | None], t: int) -> np.ndarray:
    """The definition, O(n²): in uid order, drop a hash within t of any earlier kept hash. Distances by
    ``np.bitwise_count`` — independent of the ``hamming`` the code under test uses."""
    idx = np.array(sorted((i for i in range(len(uids)) if phash[i] is not None), key=lambda k: uids[k]))
    h = np.array([phash[i] for i in idx], dtype=np.int64).view(np.uint64)  # unsigned: bitwise_count
    near = np.bitwise_count(h[:, None] ^ h[None, :]) <= t  # (m, m); of signed ints it counts |x|'s bits
    kept = np.zeros(len(h), dtype=bool)
    for k in range(len(h)):
        kept[k] = not near[k, :k][kept[:k]].any()
    dropped = np.zeros(len(uids), dtype=bool)
    dropped[idx[~kept]] = True
    return dropped


def flip(h: int, bits: list[int]) -> int:
    v = np.array([h], dtype=np.int64).view(np.uint64)[0]
    for b in bits:
        v ^= np.uint64(1) << np.uint64(b)
    return int(np.array([v], dtype=np.uint64).view(np.int64)[0])


def planted(n: int, seed: int) -> tuple[list[str], list[int | None]]:
    """Random hashes plus near copies (1..6 bits off), chains of copies, exact copies and nulls."""
    rng = np.random.default_rng(seed)
    hashes = [int(v) for v in rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)]
    for _ in range(n // 10):
        src, dst = rng.integers(0, n, size=2)
        bits = rng.choice(64, size=int(rng.integers(0, 7)), replace=False).tolist()
        hashes[dst] = flip(hashes[src], bits)  # may build chains: a copy of a copy
    phash: list[int | None] = list(hashes)
    for k in rng.choice(n, size=n // 50, replace=False):
        phash[k] = None
    uids = [f"{v:032x}" for v in rng.integers(0, 2**62, size=n)]
    return uids, phash


@pytest.mark.parametrize("threshold", [0, 1, 4, 6, 10])
def test_near_duplicates_equal_brute_force(threshold):
    uids, phash = planted(2000, seed=threshold)
    expected = brute_force(uids, phash, threshold)
    got = near_duplicates(uids, pa.array(phash, pa.int64()), threshold)
    assert expected.sum() > 0
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("radius", [0, 1])
@pytest.mark.parametrize("threshold", [1, 3, 4, 9])
def test_both_search_radii_find_exactly_the_near_pairs(threshold, radius):
    uids, phash = planted(1500, seed=100 + threshold)
    h = np.unique(np.array([p for p in phash if p is not None], dtype=np.int64))
    i, j = D._near_pairs(h, threshold, radius)
    u = h.view(np.uint64)
    bi, bj = np.nonzero(np.triu(np.bitwise_count(u[:, None] ^ u[None, :]) <= threshold, k=1))
    assert len(bi) > 0
    assert sorted(zip(i.tolist(), j.tolist(), strict=True)) == sorted(
        zip(bi.tolist(), bj.tolist(), strict=True)
    )


def test_near_duplicates_greedy_chain():
    a = 0
    b = flip(a, [0, 1, 2])  # 3 from a
    c = flip(b, [3, 4, 5])  # 3 from b, 6 from a
    uids = [U[0], U[1], U[2]]
    # b goes (near kept a); c stays: its only near neighbour b was dropped
    assert near_duplicates(uids, np.array([a, b, c]), 4).tolist() == [False, True, False]
    assert near_duplicates(uids[::-1], np.array([c, b, a]), 4).tolist() == [False, True, False]


def test_near_duplicates_inputs_nulls_and_extremes():
    uids = [U[2], U[0], U[1], U[3]]
    assert near_duplicates(uids, np.array([5, 5, None, 5], dtype=object), 0).tolist() == [
        True,
        False,
        False,
        True,
    ]
    assert near_duplicates(uids, np.array([1, 2, 3, 4], dtype=np.uint64), 64).tolist() == [
        True,
        False,
        True,
        True,
    ]
    assert near_duplicates([], np.zeros(0, np.int64), 4).tolist() == []
    with pytest.raises(TypeError, match="floats"):
        near_duplicates(uids, np.array([1.0, 2.0, np.nan, 3.0]), 4)
    with pytest.raises(ValueError, match="threshold"):
        near_duplicates(uids, np.arange(4), -1)


def test_near_duplicates_independent_of_row_order():
    uids, phash = planted(1000, seed=42)
    base = near_duplicates(uids, pa.array(phash, pa.int64()), 4)
    perm = np.random.default_rng(1).permutation(1000)
    again = near_duplicates([uids[i] for i in perm], pa.array([phash[i] for i in perm], pa.int64()), 4)
    assert np.array_equal(again, base[perm])


@pytest.mark.slow
def test_near_duplicates_100k():
    rng = np.random.default_rng(0)
    n = 100_000
    h = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
    src = rng.choice(n, size=n // 100, replace=False)
    dst = rng.choice(n, size=n // 100, replace=False)
    h[dst] = [flip(int(h[s]), rng.choice(64, size=3, replace=False).tolist()) for s in src]
    uids = [f"{v:032x}" for v in rng.integers(0, 2**62, size=n)]
    dropped = near_duplicates(uids, h, 4)
    assert 0.008 * n < dropped.sum() <= 0.01 * n + 5
