"""Semantic dedup and eval-leak detection (pipeline/dedup/semantic.py) against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.dedup import eval_leaks as EL
from pipeline.dedup import semantic as SD
from pipeline.dedup.decisions import near_pairs
from pipeline.dedup.phash import hamming
from tests.fixtures.continuum import brute_force_pairs, continuum


def _uids(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.array([rng.bytes(16).hex() for _ in range(n)])


def _pool(n_base: int, n_copies: int, d: int = 64, seed: int = 0, spread: float = 0.08):
    """Random unit vectors plus ``n_copies`` near-copies (cosine ≈ 1 − spread²/2) of the first rows."""
    rng = np.random.default_rng(seed)
    base = SD.normalize(rng.standard_normal((n_base, d)))
    src = np.arange(n_copies)
    copies = SD.normalize(base[src] + spread / 4 * rng.standard_normal((n_copies, d)))
    vectors = np.concatenate([base, copies])
    return _uids(len(vectors), rng), vectors, src, np.arange(n_base, n_base + n_copies)


def _reference(uids, vectors, priority, threshold):
    """O(n²) definition: in rank order, drop a row above the threshold with an earlier kept row; it
    duplicates the most similar such row."""
    x = SD.normalize(vectors).astype(np.float64)
    order = SD.rank_order(uids, priority)
    kept: list[int] = []
    out = np.full(len(uids), -1)
    for i in order:
        sims = [(float(x[i] @ x[k]), -pos, k) for pos, k in enumerate(kept) if float(x[i] @ x[k]) > threshold]
        if sims:
            out[i] = max(sims)[2]
        else:
            kept.append(i)
    return out


@pytest.mark.parametrize("with_priority", [False, True])
def test_one_cluster_equals_the_quadratic_definition(with_priority):
    uids, vectors, _, _ = _pool(120, 40, seed=1)
    rng = np.random.default_rng(5)
    # chains: copies of copies, so a row may be near two kept rows
    vectors = np.concatenate([vectors, SD.normalize(vectors[120:140] + 0.02 * rng.standard_normal((20, 64)))])
    uids = np.concatenate([uids, _uids(20, rng)])
    priority = rng.random(len(uids)) if with_priority else None
    got = SD.dedup_cluster(vectors, uids, priority, 0.9)
    assert (got >= 0).sum() > 30
    np.testing.assert_array_equal(got, _reference(uids, vectors, priority, 0.9))


def test_decisions_do_not_depend_on_row_order():
    uids, vectors, _, _ = _pool(300, 60, seed=2)
    a = SD.semantic_duplicates(uids, vectors, 0.9, cluster_rows=50, seed=0)
    perm = np.random.default_rng(3).permutation(len(uids))
    b = SD.semantic_duplicates(uids[perm], vectors[perm], 0.9, cluster_rows=50, seed=0)
    got_a = dict(zip(uids, a.duplicate_of, strict=True))
    got_b = dict(zip(uids[perm], b.duplicate_of, strict=True))
    assert got_a == got_b and a.n_clusters == 8  # ⌈360 / 50⌉


def test_clusters_find_planted_copies_and_nothing_else():
    uids, vectors, src, dup = _pool(2000, 100, d=128, seed=4)
    res = SD.semantic_duplicates(uids, vectors, 0.9, cluster_rows=200, seed=0)
    assert res.n_clusters == 11
    pairs = {frozenset((uids[a], uids[b])) for a, b in zip(src, dup, strict=True)}
    found = {frozenset((u, d)) for u, d in zip(uids, res.duplicate_of, strict=True) if d}
    assert found == pairs  # a copy in another cluster than its source is found as a guest
    assert found <= pairs  # precision 1: random 128-d vectors are never above 0.9


def test_priority_keeps_the_best_copy():
    uids, vectors, src, dup = _pool(10, 10, seed=6)
    priority = np.zeros(20)
    priority[dup] = 1.0  # the copies score higher: they stay, the sources go
    res = SD.semantic_duplicates(uids, vectors, 0.9, priority=priority, cluster_rows=100)
    assert list(res.duplicate_of[src]) == list(uids[dup]) and not res.dropped[dup].any()


def test_near_pairs_is_exact():
    rng = np.random.default_rng(7)
    h = rng.integers(-(2**63), 2**63 - 1, 400, dtype=np.int64)
    h[200:260] = h[:60] ^ (1 << rng.integers(0, 64, 60))  # one bit off
    i, j = near_pairs(h, 4)
    d = hamming(h[:, None], h[None, :])
    want = {(a, b) for a, b in zip(*np.nonzero(d <= 4), strict=True) if a < b}
    assert set(zip(i.tolist(), j.tolist(), strict=True)) == want and len(want) >= 60


def test_eval_leaks_by_phash_and_embedding():
    rng = np.random.default_rng(8)
    ref_vec = SD.normalize(rng.standard_normal((6, 32)))
    ref = EL.EvalReference(
        np.array(["shapes", "shapes", "colours", "colours", "retrieval", "retrieval"], dtype=object),
        np.array(["000000", "000001", "000000", "000001", "000000", "000001"], dtype=object),
        rng.integers(-(2**63), 2**63 - 1, 6, dtype=np.int64),
        ref_vec,
    )
    pool_vec = SD.normalize(rng.standard_normal((10, 32)))
    pool_hash = rng.integers(-(2**63), 2**63 - 1, 10, dtype=np.int64)
    pool_vec[1] = SD.normalize((ref_vec[2] + 0.01 * rng.standard_normal(32))[None])[
        0
    ]  # embedding leak of colours/0
    pool_hash[4] = ref.phash[5] ^ 0b111  # pHash leak (3 bits) of retrieval/1
    pool_hash[7] = ref.phash[0] ^ 0b11111  # 5 bits: above the threshold of 4
    task, key = EL.eval_leaks(pool_hash, pool_vec, ref, phash_threshold=4, embedding_threshold=0.95)
    assert task.tolist() == ["", "colours", "", "", "retrieval", "", "", "", "", ""]
    assert key[1] == "000000" and key[4] == "000001"
    only_hash, _ = EL.eval_leaks(pool_hash, None, ref)
    assert only_hash.tolist().count("") == 9


def _exact_rule(uids, vectors, priority, threshold):
    """The all-pairs greedy rule over the brute-force pairs (tests/fixtures/continuum.py)."""
    i, j, s = brute_force_pairs(vectors, threshold)
    order = SD.rank_order(uids, priority)
    rank = np.empty(len(uids), dtype=np.int64)
    rank[order] = np.arange(len(uids))
    dup = SD.greedy_duplicates(rank, i, j, s)
    return np.where(dup >= 0, uids[np.maximum(dup, 0)], ""), len(i)


def test_greedy_over_all_pairs_equals_the_quadratic_definition():
    uids, vectors, _ = continuum(600, 32, seed=11, blob_rows=60)
    priority = np.random.default_rng(12).random(len(uids))
    want = _reference(uids, vectors, priority, 0.9)
    got, _ = _exact_rule(uids, vectors, priority, 0.9)
    assert (want >= 0).sum() > 50
    assert got.tolist() == np.where(want >= 0, uids[np.maximum(want, 0)], "").tolist()


@pytest.mark.parametrize(("d", "cluster_rows"), [(32, 100), (128, 300)])
def test_guests_find_every_pair_the_exact_rule_finds(d, cluster_rows):
    """A continuum that k-means splits: single-assignment SemDeDup misses rows, the guests miss none."""
    uids, vectors, copy_of = continuum(6000, d, seed=d)
    priority = np.random.default_rng(d).random(len(uids))
    want, n_pairs = _exact_rule(uids, vectors, priority, 0.9)
    got = SD.semantic_duplicates(uids, vectors, 0.9, priority=priority, cluster_rows=cluster_rows, seed=0)
    base = SD.single_assignment_duplicates(uids, vectors, 0.9, priority, cluster_rows=cluster_rows)
    assert got.n_clusters == 6000 // cluster_rows and got.n_guests > 0 and n_pairs > 1000
    assert got.duplicate_of.tolist() == want.tolist()  # recall 1.0, precision 1.0, same kept rows named
    planted = copy_of >= 0
    assert (got.dropped[planted] | got.dropped[copy_of[planted]]).all()  # one of each planted pair goes
    missed = (want != "") & ~base.dropped
    assert missed.sum() > 0.01 * (want != "").sum()  # the data does split pairs across clusters


def test_exact_decisions_do_not_depend_on_row_order_or_clusters():
    uids, vectors, _ = continuum(3000, 48, seed=5)
    a = SD.semantic_duplicates(uids, vectors, 0.9, cluster_rows=100, seed=0)
    perm = np.random.default_rng(3).permutation(len(uids))
    b = SD.semantic_duplicates(uids[perm], vectors[perm], 0.9, cluster_rows=700, seed=4)
    assert dict(zip(uids, a.duplicate_of, strict=True)) == dict(zip(uids[perm], b.duplicate_of, strict=True))
    assert a.dropped.sum() > 100


@pytest.mark.parametrize("threshold", [0, 4, 9])
def test_phash_matches_are_every_cross_pair_within_the_threshold(threshold):
    """The pool–reference pHash match by bands equals the brute-force Hamming matrix, without forming a
    pool–pool pair."""
    rng = np.random.default_rng(threshold)
    ref = rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64)
    pool = rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64)
    for k in range(400):  # near copies of reference hashes, 0-12 bits off
        flips = rng.choice(64, size=rng.integers(0, 13), replace=False)
        pool[k] = ref[k % 300] ^ np.bitwise_or.reduce(
            np.left_shift(np.int64(1), flips.astype(np.int64)), initial=0
        )
    pool[400:420] = pool[:20]  # pool-pool duplicates: they must not matter
    i, j = EL.phash_matches(pool, ref, threshold)
    want = set(zip(*np.nonzero(hamming(pool[:, None], ref[None, :]) <= threshold), strict=True))
    assert set(zip(i.tolist(), j.tolist(), strict=True)) == want and len(want) > 20


def test_guest_screen_bounds_every_cosine_from_above():
    """The guests' screen (``screen_basis``, ``project``): ⟨Px, Py⟩ + rest·rest is never below the float64
    cosine, whether the basis holds almost all of the rows (tiny rests) or little of them (isotropic rows)."""
    rng = np.random.default_rng(4)
    _, low, _ = continuum(1500, 160, seed=4)  # a 16-d continuum: rests ≈ 0.1
    wide = SD.normalize(rng.standard_normal((1500, 160)))  # no subspace holds them: rests ≈ 1
    rests = []
    for x in (low, wide, np.concatenate([low[:750], wide[:750]])):
        q = SD.project(x, SD.screen_basis(x[SD.screen_sample(len(x), 0, 500)], 64)).astype(np.float64)
        exact = x.astype(np.float64) @ x.T.astype(np.float64)
        assert (q @ q.T >= exact - SD._SCREEN / 10).all()
        rests.append(np.median(q[:, -1]))
    assert rests[0] < 0.2 < rests[1]  # the screen is tight on the continuum
    assert SD.screen_basis(low[:100, :100], 64) is None  # d below 2·dims: the full product is as cheap


def test_screened_guests_equal_unscreened_guests():
    """``cluster_candidates`` finds the same guest–member pairs with and without the screen."""
    _, vectors, _ = continuum(2500, 160, seed=8)
    x = SD.normalize(vectors)
    centroids = SD.kmeans_centroids(x, 12, seed=0)
    primary, g_row, g_cl = SD.assign_with_guests(x, centroids, 0.9)
    basis = SD.screen_basis(x[SD.screen_sample(len(x), 0)])
    plain = SD.candidate_pairs_of(x, primary, g_row, g_cl, centroids, 0.9)
    screened = SD.candidate_pairs_of(x, primary, g_row, g_cl, centroids, 0.9, basis=basis)
    assert len(plain[0]) > 500 and (primary[plain[0]] != primary[plain[1]]).sum() > 20
    a, b = (np.lexsort((p[1], p[0])) for p in (plain, screened))  # the same pairs, found in another order
    for x, y in zip(plain, screened, strict=True):
        np.testing.assert_array_equal(x[a], y[b])


@pytest.mark.parametrize("data", ["blobs", "continuum"])
def test_the_clusters_extent_keeps_guests_off_clusters_they_cannot_reach(data):
    """On blobs in 64-d whose clusters all lie within the reach of each other (every row near every
    border), far fewer guests with each cluster's extent; there and on a continuum, still every pair above
    the threshold that brute force finds, however k-means split them."""
    rng = np.random.default_rng(3)
    if data == "blobs":
        centres = SD.normalize(rng.standard_normal((40, 64)))
        x = SD.normalize(
            0.85 * centres[rng.integers(0, 40, 6000)] + 0.55 * rng.standard_normal((6000, 64)) / 8
        )
        copies = rng.choice(6000, 300, replace=False)
        x[copies[150:]] = SD.normalize(x[copies[:150]] + 0.25 * rng.standard_normal((150, 64)) / 8)
    else:
        _, x, _ = continuum(6000, 64, seed=3)
    x = x.astype(np.float32)
    centroids = SD.kmeans_centroids(x, 60, seed=0)
    plain = SD.assign_with_guests(x, centroids, 0.9)
    cone = SD.assign_with_guests(x, centroids, 0.9, member_cos=SD.cluster_cosines(x, centroids))
    np.testing.assert_array_equal(plain[0], cone[0])
    if data == "blobs":  # the continuum's clusters reach each other: there it prunes little
        assert len(cone[1]) < len(plain[1]) / 2, (len(cone[1]), len(plain[1]))
    assert len(cone[1]) <= len(plain[1])
    i, j, _ = SD.candidate_pairs_of(x, *cone, centroids, 0.9)
    bi, bj, _ = brute_force_pairs(x, 0.9)
    assert len(bi) > 100 and (
        data == "blobs" or (cone[0][bi] != cone[0][bj]).sum() > 5
    )  # pairs k-means split
    got = set(zip(np.minimum(i, j).tolist(), np.maximum(i, j).tolist(), strict=True))
    assert got == set(zip(bi.tolist(), bj.tolist(), strict=True))


def test_stage_tasks_on_float16_rows_find_every_pair_in_a_basis(tmp_path):
    """The Ray stage's task bodies without Ray (``semantic_stage._fit``, ``semantic_files.assign_file``
    and ``group_pairs``) on the float16 rows they compare, screened in the fitted basis, with the rows
    read from an embeddings file and shuffled through bucket files by cluster group, the wide clusters'
    guests shared over several groups: exactly the brute-force pairs of those rows, named by uid, each
    once."""
    import pyarrow as pa

    from pipeline.common.storage import Storage
    from pipeline.dedup import semantic_files as SF
    from pipeline.dedup import semantic_stage as SS

    uids, vectors, _ = continuum(3000, 160, seed=9)
    np.savez(tmp_path / "e.npz", uid=uids, emb=vectors)
    order = np.argsort(uids.astype(str), kind="stable")
    x = SD.normalize(vectors).astype(np.float16)[order]
    sample = np.sort(np.random.default_rng(0).choice(len(x), 2000, replace=False))
    centroids, basis, subs = SS._fit(x[sample].astype(np.float32), 30, 0)
    assert basis is not None and basis.shape == (160, 64) and subs.shape == (30, 2, 160)
    primary, _, _ = SD.assign_with_guests(x.astype(np.float32), centroids, 0.9)
    store, out = Storage(), str(tmp_path / "assign.parquet")
    member_cos = SF.cosines_file(str(tmp_path / "e.npz"), "emb", centroids, store, subs)
    # the loads of the whole file, so every cluster past 200 memberships shares its guests out
    _, _, g_cl = SD.assign_with_guests(x.astype(np.float32), centroids, 0.9, member_cos=member_cos, subs=subs)
    plan = SF.plan_groups(np.bincount(primary, minlength=30), np.bincount(g_cl, minlength=30), 200)
    assert (plan.slices > 1).sum() >= 3 and plan.n_buckets > 30
    SF.assign_file(str(tmp_path / "e.npz"), "emb", centroids, member_cos, 0.9, plan, out, store, subs)
    found = [
        SF.group_pairs([out], g, plan.first, centroids, 0.9, basis, store) for g in range(plan.n_buckets)
    ]
    where = {u: k for k, u in enumerate(uids.astype(str)[order].tolist())}  # positions in uid order
    for names, gi, gj, _ in found:  # each group names its uids once, in uid order
        assert names.to_pylist() == sorted(set(names.to_pylist()))
        assert len(gi) == 0 or set(np.r_[gi, gj].tolist()) == set(range(len(names)))
    i, j = (
        np.array([where[u] for f in found for u in f[0].take(pa.array(f[side])).to_pylist()], np.int64)
        for side in (1, 2)
    )
    bi, bj, _ = brute_force_pairs(x.astype(np.float32), 0.9)  # in uid order, as the tasks name rows
    assert len(bi) > 1000 and (primary[bi] != primary[bj]).sum() > 20
    assert set(zip(np.minimum(i, j).tolist(), np.maximum(i, j).tolist(), strict=True)) == set(
        zip(bi.tolist(), bj.tolist(), strict=True)
    )
    assert len(i) == len(bi)  # no pair found twice


def test_group_plan_packs_clusters_and_shares_a_wide_clusters_guests_out():
    """Clusters packed in order within the budget; a cluster past it alone, over as many groups as keep
    each within it; a cluster whose members take most of the budget gets half of it for guests a group."""
    from pipeline.dedup import semantic_files as SF

    plan = SF.plan_groups(np.array([40, 40, 30, 10, 60, 90, 20]), np.array([0, 10, 0, 500, 0, 80, 0]), 100)
    #  clusters 0+1 (90), 2 (30; 2+3 > 100), 3 alone: 500 guests over ceil(500 / 90) = 6, 4 (60),
    #  5 alone: 90 members, 80 guests in groups of 50 → 2, 6 (20)
    np.testing.assert_array_equal(plan.first, [0, 0, 1, 2, 8, 9, 11])
    np.testing.assert_array_equal(plan.slices, [1, 1, 1, 6, 1, 2, 1])
    assert plan.n_buckets == 12
    assert SF.plan_groups(np.zeros(0), np.zeros(0), 100).n_buckets == 0


def test_fit_sample_is_the_smallest_hashes_as_unit_rows():
    """The fit's sample from the files' parts: the ``m`` rows of smallest uid hash over all parts, in hash
    order, each the unit float32 row of its float16 vector."""
    from pipeline.dedup import semantic_files as SF

    rng = np.random.default_rng(3)
    parts = []
    for n in (700, 0, 1300, 50):
        vec = (rng.normal(size=(n, 24)) * 3).astype(np.float16)
        parts.append((rng.integers(0, 1 << 63, n, dtype=np.uint64), vec))
    h = np.concatenate([p[0] for p in parts])
    vec = np.concatenate([p[1] for p in parts]).astype(np.float32)
    for m in (1, 999, 5000):
        want = SD.normalize(vec[np.argsort(h, kind="stable")[:m]])
        got = SF.fit_sample(parts, m)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def test_pairs_and_cosines_do_not_depend_on_the_block_size(monkeypatch):
    """The products and the float64 cosines in blocks of 64 rows (``_TEMP_BYTES`` of 1 byte) give the very
    pairs and cosines, bit for bit, of blocks of thousands: a block's size moves memory, never a decision."""
    uids, vectors, _ = continuum(3000, 96, seed=4)
    mem, gst = vectors[:1500], vectors[1500:]
    basis = SD.screen_basis(vectors, dims=16)
    screen = SD.project(SD.normalize(mem), basis), SD.project(SD.normalize(gst), basis)
    args = np.zeros(1500, np.int64), 1, SD.normalize(vectors[:2]), 0.9

    def every_path():
        return [SD.cross_pairs(vectors, vectors, 0.9, same=True), *SD.cluster_candidates(mem, gst, *args),
                *SD.cluster_candidates(mem, gst, *args, screen=screen)]  # fmt: skip

    want = every_path()
    monkeypatch.setattr(SD, "_TEMP_BYTES", 1)
    got = every_path()
    assert len(want[0][0]) > 100 and len(want[2][0]) > 10 and len(want[4][0]) > 10
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_a_lloyd_steps_sums_are_the_sampled_rows_nearest_each_centroid(tmp_path):
    """``centroid_sums``: per centroid the float64 sum and count of the file's rows under the hash cut
    nearest it; a pool split over two files sums to the same."""
    import pyarrow as pa

    from pipeline.common.storage import Storage
    from pipeline.dedup import semantic_files as SF

    uids, vectors, _ = continuum(3000, 40, seed=6)
    centroids = SD.kmeans_centroids(vectors[:500], 12, 0)
    cut, seed, store = 1 << 62, 5, Storage()  # about a quarter of the rows
    np.savez(tmp_path / "all.npz", uid=uids, emb=vectors)
    x = SD.normalize(vectors).astype(np.float16).astype(np.float32)  # as the tasks read rows
    under = SF.sample_hash(pa.array(uids.tolist()), seed) < np.uint64(cut)
    near = SD.assign_clusters(x[under], centroids)
    want = np.zeros((12, 40))
    np.add.at(want, near, x[under].astype(np.float64))
    sums, counts = SF.centroid_sums(str(tmp_path / "all.npz"), "emb", cut, seed, centroids, store)
    assert 500 < counts.sum() < 1000 and (counts > 0).sum() > 8
    np.testing.assert_array_equal(counts, np.bincount(near, minlength=12))
    np.testing.assert_allclose(sums, want, atol=1e-9)
    half = []
    for f in range(2):
        np.savez(tmp_path / f"{f}.npz", uid=uids[f::2], emb=vectors[f::2])
        half.append(SF.centroid_sums(str(tmp_path / f"{f}.npz"), "emb", cut, seed, centroids, store))
    np.testing.assert_array_equal(half[0][1] + half[1][1], counts)
    np.testing.assert_allclose(half[0][0] + half[1][0], sums, atol=1e-9)


def _assignment_in_float64(x, centroids, threshold, member_cos=None, subs=None):
    """``assign_with_guests`` and ``cluster_cosines`` written out densely in float64: (nearest centroid,
    guest (row, cluster) set, per-cluster smallest member cosine with ties up to 10⁻⁹ counted; given
    ``subs``, per sub-direction the smallest product with the members nearest to it too)."""
    x = SD.normalize(x).astype(np.float64)
    c = centroids.astype(np.float64)
    cn = (c * c).sum(axis=1)
    dist2 = cn[None, :] - 2.0 * x @ c.T  # |x − c|² − |x|²
    a = np.argmin(dist2, axis=1)
    best = dist2[np.arange(len(x)), a]
    tie = dist2 <= best[:, None] + 1e-9 * (1.0 + np.abs(best[:, None]))
    cos = (x @ c.T) / np.sqrt(cn)[None, :]
    extent = np.where(tie.any(axis=0), np.where(tie, cos, 2.0).min(axis=0), 1.0)
    sep = np.sqrt(np.maximum(cn[a][:, None] + cn[None, :] - 2.0 * (c[a] @ c.T), 1e-300))
    guest = ((dist2 - best[:, None]) / (2.0 * sep) <= SD.reach(threshold)) & (np.arange(len(c)) > a[:, None])
    if member_cos is not None:
        whole = member_cos if subs is None else member_cos[:, 0]
        angle = np.arccos(np.clip(whole, -1, 1)) + np.arccos(threshold) + 1e-6
        bound = np.where(angle >= np.pi, -2.0, np.cos(np.minimum(angle, np.pi))) * np.sqrt(cn)
        guest &= x @ c.T >= bound[None, :] - 1e-9
    if subs is not None:
        dots = np.einsum("nd,kjd->nkj", x, subs.astype(np.float64))  # (rows, clusters, sub-directions)
        mine = dots.argmax(axis=2)
        low = np.full(subs.shape[:2], 2.0)
        for j in range(subs.shape[1]):
            here = tie & (mine == j)
            low[:, j] = np.where(here.any(axis=0), np.where(here, dots[:, :, j], 2.0).min(axis=0), 2.0)
        extent = np.concatenate([extent[:, None], low], axis=1)
        if member_cos is not None:
            norm = np.linalg.norm(subs.astype(np.float64), axis=2)
            cos = np.clip(member_cos[:, 1:] / norm, -1, 1)
            angle = np.arccos(cos) + np.arccos(threshold) + 1e-6
            bound = np.where(angle >= np.pi, -2.0, np.cos(np.minimum(angle, np.pi))) * norm - 1e-9
            bound[member_cos[:, 1:] > 1.5] = np.inf
            guest &= (dots >= bound[None]).any(axis=2)
    r, b = np.nonzero(guest)
    return a, set(zip(r.tolist(), b.tolist(), strict=True)), extent


@pytest.mark.parametrize("case", ["blobs-768", "crowded-64", "ties"])
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_assignment_screened_in_float32_equals_the_float64_rule(case):
    """The assignment's float32 products only screen: the nearest centroids, guests and extents equal the
    rule computed densely in float64, on data whose rows sit near few borders (the sparse path), near
    many (the dense path), and exactly on centroids that appear twice (ties go to the lower one), with
    two non-finite rows among them."""
    rng = np.random.default_rng(5)
    if case == "blobs-768":
        d, k, n = 768, 300, 3000
        # centres in a 16-d subspace and around it, so clusters border each other
        centre = rng.standard_normal((k, 16)) @ rng.standard_normal((16, d)) / 4 + 0.3 * rng.standard_normal(
            (k, d)
        )
        pick = rng.integers(0, k, n)
        x = SD.normalize(0.85 * centre[pick] + 0.55 * rng.standard_normal((n, d)))
        centroids = SD.normalize(centre + 0.2 * rng.standard_normal((k, d)))
    else:
        d, k, n = 64, 120, 4000
        x = SD.normalize(rng.standard_normal((n, d)))
        centroids = SD.normalize(rng.standard_normal((k, d)))
    if case == "ties":
        centroids[7] = centroids[3]
        x[:20] = centroids[3]
        x[20], x[21] = np.nan, np.inf  # vectors no cosine is defined for: home 0, nobody's guest
    member_cos = SD.cluster_cosines(x, centroids)
    a, _, extent = _assignment_in_float64(x, centroids, 0.9)
    np.testing.assert_allclose(member_cos, extent, rtol=0, atol=1e-12)
    subs = SD.sub_directions(x[np.isfinite(x).all(axis=1)], centroids)
    sub_cos = SD.cluster_cosines(x, centroids, subs=subs)
    np.testing.assert_allclose(
        sub_cos, _assignment_in_float64(x, centroids, 0.9, subs=subs)[2], rtol=0, atol=1e-12
    )
    counts = []
    for cos, sub in ((None, None), (member_cos, None), (sub_cos, subs)):
        want_a, want_g, _ = _assignment_in_float64(x, centroids, 0.9, cos, sub)
        primary, g_row, g_cl = SD.assign_with_guests(x, centroids, 0.9, block=512, member_cos=cos, subs=sub)
        np.testing.assert_array_equal(primary, want_a)
        assert set(zip(g_row.tolist(), g_cl.tolist(), strict=True)) == want_g
        counts.append(len(want_g))
    print(case, "guests: hyperplane, + cone, + sub-cones", counts)
    assert counts[1] > (2000 if case == "blobs-768" else 20 * n) and counts[2] > 200
    if case == "ties":
        assert (a[:20] == 3).all()  # every row of 3 counts in 7's extent too, which has no row of its own
        assert member_cos[7] == member_cos[3] < 0.9 and not (a == 7).any()
        assert (primary[20:22] == 0).all() and not np.isin(g_row, [20, 21]).any()


@pytest.mark.parametrize("dense", [False, True])
def test_rows_on_a_border_or_a_tie_are_decided_in_float64(dense, monkeypatch):
    """Rows whose distance to the bisecting hyperplane is the reach ± 10⁻⁹…10⁻⁵, and rows off the tie
    between the two centroids by as little (far inside float32's error of a 768-d product): a guest
    exactly when within the reach and home at the nearer centroid, as in float64, whichever path the
    block takes (the separations screened in float32 or not)."""
    monkeypatch.setattr(SD, "_DENSE_SHARE", 0.0 if dense else 1.0)
    rng = np.random.default_rng(6)
    d = 768
    c = SD.normalize(rng.standard_normal((2, d))).astype(np.float64)
    normal = (c[0] - c[1]) / np.linalg.norm(c[0] - c[1])
    along = 0.4 * (c[0] + c[1]) / np.linalg.norm(c[0] + c[1])  # on the hyperplane, near both centroids
    offsets = np.concatenate([-np.geomspace(1e-5, 1e-9, 40), np.geomspace(1e-9, 1e-5, 40)])
    h = np.concatenate([SD.reach(0.9) + offsets, offsets])  # 80 rows on the border, 80 on the tie
    w = rng.standard_normal((len(h), d))
    for u in (normal, along / 0.4):  # directions off both
        w -= (w @ u)[:, None] * u[None, :]
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    rows = h[:, None] * normal[None, :] + along[None, :]
    rows += np.sqrt(1.0 - (rows * rows).sum(axis=1))[:, None] * w
    rows, cen = rows.astype(np.float32), c.astype(np.float32)
    primary, g_row, g_cl = SD.assign_with_guests(rows, cen, 0.9)
    want_a, want_g, _ = _assignment_in_float64(rows, cen, 0.9)
    np.testing.assert_array_equal(primary, want_a)
    assert set(zip(g_row.tolist(), g_cl.tolist(), strict=True)) == want_g
    x, c = SD.normalize(rows).astype(np.float64), cen.astype(np.float64)
    side = (c[1] @ c[1] - 2 * x @ c[1]) - (c[0] @ c[0] - 2 * x @ c[0])  # |x − c1|² − |x − c0|²
    assert (want_a == np.where(side >= 0, 0, 1)).all() and 10 < want_a[80:].sum() < 70
    inside = {i for i, _ in want_g if i < 80}  # as placed, past the rows' rounding to float32 (~5·10⁻⁸)
    assert set(range(19)) <= inside and not inside & set(range(61, 80))


@pytest.mark.parametrize("gather", [False, True])
def test_rows_on_a_sub_cones_edge_are_decided_in_float64(gather, monkeypatch):
    """Rows on cluster 1's border whose product with its first sub-direction is the sub-cone's limit
    ± 10⁻⁹…10⁻⁵ (within float32's error of a 768-d product): a guest exactly when the rule in float64
    says so, and both sides of the edge occur; the second sub-direction has no member (nobody's cone);
    screened by a product or by a gather a pair."""
    monkeypatch.setattr(SD, "_GATHER_SHARE", np.inf if gather else 0.0)
    rng = np.random.default_rng(8)
    d = 768
    c = SD.normalize(rng.standard_normal((2, d))).astype(np.float32)
    subs = SD.normalize(rng.standard_normal((4, d))).astype(np.float32).reshape(2, 2, d)
    member_cos = np.array([[-1.0, 2.0, 2.0], [-1.0, 0.35, 2.0]])  # centroid cones hold everyone
    s, n = subs[1, 0].astype(np.float64), np.linalg.norm(subs[1, 0].astype(np.float64))
    angle = np.arccos(0.35 / n) + np.arccos(0.9) + 1e-6
    lim = np.cos(angle) * n - 1e-9
    normal = (c[0] - c[1]).astype(np.float64)
    normal /= np.linalg.norm(normal)
    u = s - (s @ normal) * normal  # the part of s along the bisecting hyperplane
    u /= np.linalg.norm(u)
    offsets = np.concatenate([-np.geomspace(1e-3, 1e-9, 60), np.geomspace(1e-9, 1e-3, 60)])
    w = rng.standard_normal((len(offsets), d))
    for e in (normal, u):
        w -= (w @ e)[:, None] * e[None, :]
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    h = 1e-3  # just on centroid 0's side, well within the reach
    a = ((lim + offsets) / n - h * (s @ normal) / n) / (u @ s / n)  # x · s = lim + offset, x along u by a
    rows = h * normal[None, :] + a[:, None] * u[None, :]
    rows += np.sqrt(1.0 - (rows * rows).sum(axis=1))[:, None] * w
    rows = rows.astype(np.float32)
    primary, g_row, g_cl = SD.assign_with_guests(rows, c, 0.9, member_cos=member_cos, subs=subs)
    want_a, want_g, _ = _assignment_in_float64(rows, c, 0.9, member_cos, subs)
    np.testing.assert_array_equal(primary, want_a)
    assert (primary == 0).all()
    assert set(zip(g_row.tolist(), g_cl.tolist(), strict=True)) == want_g
    inside = {i for i, _ in want_g}
    assert set(np.flatnonzero(offsets > 1e-6).tolist()) <= inside
    assert not inside & set(np.flatnonzero(offsets < -1e-6).tolist())


def test_bucket_space_refuses_a_disk_that_cannot_hold_the_predicted_buckets(tmp_path):
    import shutil

    from pipeline.dedup import semantic_stage as SS

    free = shutil.disk_usage(tmp_path).free
    each = 2 * 768 + SS._MEMBERSHIP_BYTES
    SS.bucket_space(str(tmp_path / "scratch" / "not-made-yet"), free / each / 2, 768)  # room for them
    with pytest.raises(OSError) as err:
        SS.bucket_space(str(tmp_path / "scratch"), 2 * free / each, 768)
    said = str(err.value)
    assert f"need ~{2 * free / 1e9:.1f} GB under {tmp_path / 'scratch'}" in said and "GB free" in said
    SS.bucket_space("s3://bucket/scratch", 1e15, 768)  # the object store's room is not ours to measure
