"""Semantic duplicates (SemDeDup) over image embeddings: pure functions, no Ray.

**SemDeDup** (Abbas et al., "SemDeDup: Data-efficient learning at web-scale through semantic
deduplication", 2023): cluster the image embeddings with k-means, then call two rows duplicates when their
cosine similarity exceeds ``threshold`` (the paper's 1 − ε). The paper compares only rows of one cluster,
and misses the pairs k-means splits (17.6% of the pairs above 0.9 on a continuum of concepts). Here every
row is also a *guest* of the clusters whose border it is within √(2 − 2t) of (``assign_with_guests``), so
the pairs found per cluster are every pair above the threshold, and the greedy rule over their union is
the all-pairs rule exactly (docs/decisions/0087-exact-semantic-dedup.md). A guest meets a cluster's
members first in a 64-d basis whose product bounds the cosine from above (``screen_basis``, ``project``;
docs/decisions/0096), so the guests cost a fraction of the members' products. Clustering and assignment
are faiss's spherical k-means on a seeded sample and our own blocked distances, so the clusters are a
function of the data and the seed; a cluster's work and memory are bounded by its members and guests
(``cluster_candidates``), never by the pool; the Ray stage (``pipeline/dedup/curation_stage.py``) runs the
clusters as tasks.

The kept row of each duplicate group is chosen deterministically: rows are ranked by ``priority``
(descending; e.g. the pair's CLIP score, so the best-captioned copy stays), ties by uid ascending; in that
order a row is dropped when it is above the threshold with an earlier *kept* row, and it records the uid
of the most similar such row (``duplicate_of``). Row order and batching never change the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ASSIGN_CELLS = 1 << 22  # rows × centroids per assignment block (16 MiB of float32 scores, whatever k is)
_BLOCK = 4096  # query rows per similarity block: a (block, cluster) float32 matrix at a time


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length as float32 (a zero row stays zero)."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.where(norms > 0, norms, 1.0)


def kmeans_centroids(
    vectors: np.ndarray, k: int, seed: int = 0, niter: int = 20, unit: bool = False
) -> np.ndarray:
    """``k`` spherical k-means centroids (faiss), trained on at most 256·k rows drawn with ``seed``;
    ``unit``: the rows are unit float32 already and are trained on in place (no copy of the sample)."""
    import faiss

    x = np.ascontiguousarray(vectors, dtype=np.float32) if unit else normalize(vectors)
    k = max(1, min(int(k), len(x)))
    if k == 1:
        c = x.mean(axis=0, keepdims=True)
        return normalize(c)
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=int(seed), spherical=True, max_points_per_centroid=256)
    km.train(x)
    return np.ascontiguousarray(km.centroids, dtype=np.float32)


def assign_clusters(vectors: np.ndarray, centroids: np.ndarray, block: int = 1 << 18) -> np.ndarray:
    """Per row, the centroid with the largest inner product (faiss ``IndexFlatIP``), in blocks."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    out = np.empty(len(vectors), dtype=np.int64)
    for a in range(0, len(vectors), block):
        _, idx = index.search(normalize(vectors[a : a + block]), 1)
        out[a : a + block] = idx[:, 0]
    return out


def rank_order(uids: np.ndarray, priority: np.ndarray | None) -> np.ndarray:
    """Positions in keep-first order: ``priority`` descending (NaN last), ties by uid ascending."""
    uids = np.asarray(uids).astype(str)
    if priority is None:
        return np.argsort(uids, kind="stable")
    p = np.asarray(priority, dtype=np.float64)
    key = np.where(np.isfinite(p), -p, np.inf)
    return np.lexsort((uids, key))


_GUEST_CHUNK = 256  # guests compared at once, nearest the border first
_SCREEN_CHUNK = 4096  # guests screened at once against all of a cluster's members: one large product
_SCREEN_PASS = 0.02  # above this fraction of a block let through, its exact cosines cost more than a product
SCREEN_SAMPLE = 20_000  # rows the guests' screen basis is fitted on (it moves cost, never a decision)
_SCREEN = 1e-4  # float32 screen margin below the threshold; the decision is the float64 cosine
_GREEDY_CHUNK = 1 << 16  # rows the greedy walks between conversions of their pair ranges to Python ints
_TEMP_BYTES = 64 << 20  # a block's temporaries: at 768-d 2¹⁶ pairs gathered in float64 were 1.2 GB


def _rows_for(row_bytes: int) -> int:
    """Rows of a block whose temporaries take ``row_bytes`` a row: within ``_TEMP_BYTES``, at least 64."""
    return max(64, _TEMP_BYTES // max(1, row_bytes))


def _exact_cosines(x: np.ndarray, y: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Cosines of the pairs (x[i], y[j]) in float64: one rule for every path, independent of blocking."""
    out = np.empty(len(i), dtype=np.float64)
    step = _rows_for(x.shape[1] * 24)  # both ends gathered in float32, then float64
    for a in range(0, len(i), step):
        sl = slice(a, a + step)
        out[sl] = np.einsum("ij,ij->i", x[i[sl]].astype(np.float64), y[j[sl]].astype(np.float64))
    return out


def cross_pairs(
    x: np.ndarray, y: np.ndarray, threshold: float, same: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (i, j) of a row of ``x`` and a row of ``y`` with cosine > ``threshold`` (float64 cosine of
    the unit float32 rows), blocked; ``same``: ``x`` is ``y`` and only i < j is wanted."""
    return _unit_pairs(normalize(x), normalize(y), threshold, same)


def _unit_pairs(
    x: np.ndarray, y: np.ndarray, threshold: float, same: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``cross_pairs`` of rows already unit float32."""
    found_i, found_j = [], []
    block = min(_BLOCK, _rows_for(len(y) * 5))  # float32 products and their mask
    for a in range(0, len(x), block):
        sims = x[a : a + block] @ y.T  # (B, m)
        i, j = np.nonzero(sims > threshold - _SCREEN)
        i += a
        keep = j > i if same else np.ones(len(i), bool)
        found_i.append(i[keep])
        found_j.append(j[keep])
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    i, j = np.concatenate(found_i).astype(np.int64), np.concatenate(found_j).astype(np.int64)
    s = _exact_cosines(x, y, i, j)
    above = s > threshold
    return i[above], j[above], s[above]


def cluster_pairs(vectors: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (i < j) of rows with cosine > ``threshold``, with its cosine: exact, blocked."""
    return cross_pairs(vectors, vectors, threshold, same=True)


def greedy_duplicates(rank: np.ndarray, i: np.ndarray, j: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The greedy rule over the pairs above the threshold (i, j, cosine s): per row the row it duplicates,
    −1 for a kept row. In ``rank`` order (0 first) a row drops when it pairs with an earlier *kept* row and
    names the most similar one (the better-ranked on a tie). Only a row's pairs decide it, so the union of
    every pair above the threshold gives the all-pairs rule exactly, whatever found them."""
    dup_of = np.full(len(rank), -1, dtype=np.int64)
    if not len(i):
        return dup_of
    ri, rj = rank[i], rank[j]
    swap = rj < ri
    a, b = np.where(swap, j, i), np.where(swap, i, j)  # the better-ranked end, the other
    ra, rb = np.where(swap, rj, ri), np.where(swap, ri, rj)
    del ri, rj, swap  # temporaries freed as they go: the planning task's bytes a pair (decision 0107)
    by = np.lexsort((-s, ra, rb))
    del ra, rb
    a, b, s = a[by], b[by], s[by]
    del by
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = np.append(starts[1:], len(b))
    kept = np.ones(len(rank), dtype=bool)
    for c in range(0, len(starts), _GREEDY_CHUNK):  # Python ints a chunk at a time, not a list per row
        for lo, hi in zip(
            starts[c : c + _GREEDY_CHUNK].tolist(), ends[c : c + _GREEDY_CHUNK].tolist(), strict=True
        ):
            if hi - lo == 1:  # one better-ranked neighbour: most rows
                if kept[a[lo]]:
                    kept[b[lo]] = False
                    dup_of[b[lo]] = a[lo]
                continue
            alive = kept[a[lo:hi]]
            if alive.any():
                cand = np.arange(lo, hi)[alive]
                best = cand[np.argmax(s[cand])]  # the most similar kept row (first on a tie: better rank)
                kept[b[lo]] = False
                dup_of[b[lo]] = a[best]
    return dup_of


def dedup_cluster(
    vectors: np.ndarray, uids: np.ndarray, priority: np.ndarray | None, threshold: float
) -> np.ndarray:
    """One cluster's decisions: per row the position (in this cluster) of the kept row it duplicates,
    −1 for a kept row (module docstring: greedy in rank order against kept rows only)."""
    m = len(uids)
    if m < 2:
        return np.full(m, -1, dtype=np.int64)
    order = rank_order(uids, priority)
    rank = np.empty(m, dtype=np.int64)
    rank[order] = np.arange(m)
    return greedy_duplicates(rank, *cluster_pairs(vectors, threshold))


# --- complete candidate pairs: every row is a guest of the clusters whose border it is near ---------------


def reach(threshold: float) -> float:
    """The Euclidean distance of two unit rows at cosine ``threshold`` (√(2 − 2t)), with a little slack for
    float32 rows whose norm is 1 only to rounding: a pair above the threshold is closer than this."""
    return float(np.sqrt(2.0 - 2.0 * threshold + 1e-5))


class _Centroids:
    """The centroids as the assignment meets rows: a row's score for centroid c is x·c − |c|²/2 (the
    larger, the nearer). Float32 products over every centroid screen; float64 products over the few
    candidates they leave decide (docs/decisions/0109). ``err`` bounds how far a float32 score of a unit
    row lies from its exact one: γ_d·|x|·|c| for the product in any summation order, the subtraction's
    rounding and the float32 copy of |c|²/2, twice over."""

    def __init__(self, centroids: np.ndarray) -> None:
        self.c = np.ascontiguousarray(centroids, dtype=np.float64)
        self.cn = (self.c * self.c).sum(axis=1)
        self.half = self.cn / 2.0
        self.c32 = self.c.astype(np.float32)
        self.half32 = self.half.astype(np.float32)
        top = max(1.0, float(self.cn.max())) if len(self.c) else 1.0
        self.err = 2.0 * (self.c.shape[1] + 8) * 2.0**-24 * top + 1e-12
        self.tie = 4e-9 * top  # wider than cluster_cosines' tie on any best score

    def scores(self, x: np.ndarray) -> np.ndarray:
        """Float32 scores (B, k) of unit float64 rows ``x``, each within ``err`` of the exact one."""
        v = x.astype(np.float32) @ self.c32.T
        v -= self.half32[None, :]
        return v

    def exact(self, x: np.ndarray, r: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The float64 scores of rows ``x[r]`` for centroids ``b``."""
        return _row_dots(x, r, self.c, b) - self.half[b]

    def dots(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """c[a] · c[b] in float64, for matched centroids."""
        return _row_dots(self.c, a, self.c, b)

    def nearest(
        self, x: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per row of ``x`` (scores ``v``) the centroids whose exact score may tie with the row's best (within
        twice ``err`` and the tie tolerance in float32), with their exact scores, as (rows r, centroids b,
        scores s); and per row the best exact score and the lowest centroid that has it (the nearest). A
        row with no finite score (a non-finite vector) goes to centroid 0 with a NaN score, so it is
        nobody's guest and no cosine with it passes a threshold."""
        r, b = np.nonzero(v >= (v.max(axis=1) - 2.0 * self.err - self.tie)[:, None])
        s = self.exact(x, r, b)
        order = np.lexsort((b, -s, r))
        first = order[np.unique(r[order], return_index=True)[1]]
        best, home = np.full(len(x), np.nan), np.zeros(len(x), np.int64)
        best[r[first]], home[r[first]] = s[first], b[first]
        return r, b, s, best, home


def _row_dots(x: np.ndarray, i: np.ndarray, y: np.ndarray, j: np.ndarray) -> np.ndarray:
    """x[i] · y[j] in float64 for matched rows, gathered ~16 MiB at a time."""
    out = np.empty(len(i), np.float64)
    step = max(256, (16 << 20) // (8 * max(1, x.shape[1])))
    for p in range(0, len(i), step):
        out[p : p + step] = np.einsum("ij,ij->i", x[i[p : p + step]], y[j[p : p + step]])
    return out


def _block_rows(k: int, block: int) -> int:
    return max(16, min(block, _ASSIGN_CELLS // max(1, k)))  # (block, k) float32 arrays flat in k


def cluster_cosines(
    vectors: np.ndarray, centroids: np.ndarray, block: int = 4096, subs: np.ndarray | None = None
) -> np.ndarray:
    """Per cluster the smallest cosine of a member to its unit centroid (1 for an empty cluster), each row
    counted in every cluster it is nearest to up to rounding (an exact score within 10⁻⁹ of its best),
    so any assignment of a tie is covered. Given ``subs`` (k, s, d: ``sub_directions``), (k, 1 + s):
    then column 1 + j holds the smallest product with b's sub-direction j of the members nearest to it
    among b's (2 where none is). The minimum over several blocks or files is the minimum of their figures."""
    cs = _Centroids(centroids)
    k = len(cs.c)
    out = np.ones(k if subs is None else (k, 1 + subs.shape[1]), dtype=np.float64)
    if subs is not None:
        out[:, 1:] = 2.0  # no member near it: its cone holds nobody's neighbour
    step = _block_rows(k, block)
    for lo in range(0, len(vectors), step):
        x = normalize(vectors[lo : lo + step]).astype(np.float64)
        r, b, s, best, _ = cs.nearest(x, cs.scores(x))
        tie = s >= best[r] - 0.5e-9 * (1.0 + 2.0 * np.abs(best[r]))
        r, b = r[tie], b[tie]
        cos = (s[tie] + cs.half[b]) / np.sqrt(np.maximum(cs.cn[b], 1e-300))
        if subs is None:
            np.minimum.at(out, b, cos)
            continue
        np.minimum.at(out[:, 0], b, cos)
        near = _sub_cosines(x, r, b, subs)
        j = np.argmax(near, axis=1)
        np.minimum.at(out, (b, 1 + j), near[np.arange(len(r)), j])
    return out


def _sub_cosines(x: np.ndarray, r: np.ndarray, b: np.ndarray, subs: np.ndarray) -> np.ndarray:
    """x[r] · subs[b, j] in float64 (of the float32 directions as they are), (len(r), s)."""
    return np.stack([_row_dots(x, r, subs[:, j], b) for j in range(subs.shape[1])], axis=1)


def sub_directions(
    sample: np.ndarray, centroids: np.ndarray, s: int = 2, rounds: int = 5, unit: bool = False
) -> np.ndarray:
    """(k, s, d) unit directions per cluster that its members split between (docs/decisions/0111): a few
    rounds of spherical s-means over the ``sample``'s members of each cluster, started from the member
    farthest from the centroid and then each next farthest from those chosen. A cluster that spans two
    concepts has a wide cone about its centroid but two narrow ones about these; any directions keep the
    guests complete (their extents are measured over every member), good ones keep them few. ``unit``: the
    rows are unit float32 already (no copy of the sample)."""
    x = np.ascontiguousarray(sample, dtype=np.float32) if unit else normalize(sample)
    c = normalize(centroids)
    home = assign_clusters(x, c, block=1 << 14)  # a block's unit copy, not the sample's
    order = np.argsort(home, kind="stable")
    edges = np.searchsorted(home[order], np.arange(len(c) + 1))
    out = np.repeat(c[:, None, :], s, axis=1)
    for b in range(len(c)):
        m = x[order[edges[b] : edges[b + 1]]]
        if len(m) < 2:
            continue
        pick = [int(np.argmin(m @ c[b]))]
        for _ in range(s - 1):
            pick.append(int(np.argmin((m @ m[pick].T).max(axis=1))))
        d = m[pick].copy()
        for _ in range(rounds):
            near = np.argmax(m @ d.T, axis=1)
            for j in range(s):
                if (near == j).any():
                    d[j] = normalize(m[near == j].sum(axis=0, keepdims=True))[0]
        out[b] = d
    return out


def assign_with_guests(
    vectors: np.ndarray,
    centroids: np.ndarray,
    threshold: float,
    block: int = 4096,
    member_cos: np.ndarray | None = None,
    subs: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row its nearest centroid (``primary``), and the rows' guest memberships (``guest_row``,
    ``guest_cluster``): row x of cluster a is a guest of cluster b > a when its distance to the bisecting
    hyperplane of c_a and c_b, (|x − c_b|² − |x − c_a|²) / (2|c_a − c_b|), is at most ``reach(threshold)``
    and, given ``member_cos`` (``cluster_cosines``: every member of b within angle R_b of b's direction),
    its angle to b's direction is at most R_b + arccos(t); given ``subs`` too (``member_cos`` then from
    ``cluster_cosines(…, subs=subs)``: every member of b within R_bj of one of b's sub-directions s_bj),
    its angle to some s_bj is at most R_bj + arccos(t) (docs/decisions/0111).

    Complete: for a pair x ∈ a, y ∈ b, a ≠ b, closer than the reach, the segment xy crosses the hyperplane,
    so both ends lie within the reach of it; the lower-numbered cluster's end is a guest of the other. And
    the angle from x to b's direction is at most angle(x, y) + angle(y, b) ≤ arccos(t) + R_b (the triangle
    inequality on the sphere), so the second test drops no such pair, nor the third (y lies within R_bj of
    its own s_bj): they keep rows off the borders of clusters they cannot reach, which the first alone lets
    in when clusters lie within the reach of each other everywhere (unstructured or high-dimensional data;
    docs/decisions/0103).

    The tests are decided in float64 on the pairs that pass them in float32 with each score moved by its
    error bound, so the float32 products only screen (docs/decisions/0109)."""
    cs = _Centroids(centroids)
    k, d = len(cs.c), reach(threshold)
    ks = np.arange(k)
    cone = sub_lim = None
    if member_cos is not None:  # x · c_b ≥ |c_b| cos(R_b + arccos t), as a score
        whole = member_cos if subs is None else member_cos[:, 0]
        cone = _cone_cos(whole, threshold) * np.sqrt(np.maximum(cs.cn, 0.0))
        cone = cone - cs.half - 1e-9
        if subs is not None:  # x · s_bj ≥ |s_bj| cos(R_bj + arccos t), the float32 s_bj's norm exactly
            norm = np.sqrt(np.einsum("kjd,kjd->kj", subs, subs, dtype=np.float64))
            sub_lim = _cone_cos(member_cos[:, 1:] / np.maximum(norm, 1e-300), threshold) * norm - 1e-9
            sub_lim[member_cos[:, 1:] > 1.5] = np.inf
    primary = np.empty(len(vectors), dtype=np.int64)
    g_row, g_cl = [], []
    step = _block_rows(k, block)
    for lo in range(0, len(vectors), step):
        x = normalize(vectors[lo : lo + step]).astype(np.float64)
        v = cs.scores(x)
        _, _, _, sa, a = cs.nearest(x, v)
        primary[lo : lo + len(x)] = a
        r, b = _guests_of_block(cs, x, v, a, sa, d, cone, ks)
        if sub_lim is not None and len(r):
            inside = _in_sub_cones(x, r, b, subs, sub_lim)
            r, b = r[inside], b[inside]
        g_row.append(r + lo)
        g_cl.append(b)
    if not g_row:
        return primary, np.zeros(0, np.int64), np.zeros(0, np.int64)
    return primary, np.concatenate(g_row).astype(np.int64), np.concatenate(g_cl).astype(np.int64)


# pairs per (row, cluster) cell of a block past which one product beats a gather a pair
_GATHER_SHARE = 1 / 64


def _in_sub_cones(
    x: np.ndarray, r: np.ndarray, b: np.ndarray, subs: np.ndarray, sub_lim: np.ndarray
) -> np.ndarray:
    """Per pair (row r of ``x``, cluster b): x · s_bj ≥ ``sub_lim[b, j]`` for some j. Screened by float32
    products, each within γ_d·|x|·|s| of the exact one — a gather a pair where the pairs are few, else the
    product of the block's rows with the sub-directions of the clusters its pairs name (memory-bound
    gathers cost more past ``_GATHER_SHARE`` of those cells) — and the pairs it leaves undecided in float64."""
    x32 = x.astype(np.float32)  # exact: the rows are float32 values
    used, at = np.unique(b, return_inverse=True)
    top = float(np.sqrt(np.einsum("kjd,kjd->kj", subs[used], subs[used], dtype=np.float64).max()))
    err = 2.0 * (x.shape[1] + 8) * 2.0**-24 * max(1.0, top) + 1e-12
    dense = len(r) > _GATHER_SHARE * len(x) * len(used)
    inside, maybe = np.zeros(len(r), bool), np.zeros(len(r), bool)
    for j in range(subs.shape[1]):
        if dense:
            v = (x32 @ subs[used, j].T)[r, at].astype(np.float64)
        else:
            v = _row_dots(x32, r, subs[:, j], b)
        lim = sub_lim[b, j]
        inside |= v >= lim + err
        maybe |= v >= lim - err
    ask = np.flatnonzero(maybe & ~inside)
    if len(ask):
        inside[ask] = (_sub_cosines(x, r[ask], b[ask], subs) >= sub_lim[b[ask]]).any(axis=1)
    return inside


def _cone_cos(member_cos: np.ndarray, threshold: float) -> np.ndarray:
    """cos(R + arccos t) for extents cos R, widened by 10⁻⁶ rad; −2 (every row) where it reaches π."""
    angle = np.arccos(np.clip(member_cos, -1.0, 1.0)) + np.arccos(np.clip(threshold, -1.0, 1.0)) + 1e-6
    return np.where(angle >= np.pi, -2.0, np.cos(np.minimum(angle, np.pi)))


_DENSE_SHARE = 1 / 32  # past this share of a block's cells through the cheap screen, decide in float32 first


def _guests_of_block(
    cs: _Centroids,
    x: np.ndarray,
    v: np.ndarray,
    a: np.ndarray,
    sa: np.ndarray,
    d: float,
    cone: np.ndarray | None,
    ks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``assign_with_guests``' tests on one block (float32 scores ``v``, homes ``a`` and their exact
    scores ``sa``) → the (row, cluster) guest memberships, row-major. In scores the hyperplane test is
    s_a − s_b ≤ d·|c_a − c_b| and the cone test s_b ≥ cone_b; a float32 score is within ``err`` of s."""
    m = 3.0 * cs.err  # two scores' errors, and float32's rounding of the comparison itself
    top = 2.0 * float(np.sqrt(cs.cn.max()))  # |c_a − c_b| ≤ |c_a| + |c_b|
    va = v[np.arange(len(x)), a]
    near = v >= (va - d * top - m)[:, None]
    near &= ks[None, :] > a[:, None]
    if cone is not None:
        near &= v >= (cone - m).astype(np.float32)[None, :]
    sure = None  # pairs the float32 separations already decide
    if np.count_nonzero(near) > _DENSE_SHARE * near.size:  # rows near many borders: the separations too
        cc = cs.c32[a] @ cs.c32.T  # within err/2 of c_a · c_b, so |c_a − c_b|² within 2·err
        sep2 = cs.cn[a].astype(np.float32)[:, None] + cs.cn.astype(np.float32)[None, :] - 2.0 * cc
        gap = va[:, None] - v
        sure = near & (gap + m <= d * np.sqrt(np.maximum(sep2 - 2.0 * cs.err, 0.0)))
        near &= gap - m <= d * np.sqrt(sep2 + 2.0 * cs.err)
        if cone is not None:
            sure &= v >= (cone + m).astype(np.float32)[None, :]
        del cc, sep2, gap
    r, b = np.nonzero(near)
    keep = sure[r, b] if sure is not None else np.zeros(len(r), bool)
    ask = np.flatnonzero(~keep)  # decided in float64
    sb = cs.exact(x, r[ask], b[ask])
    ca = a[r[ask]]
    sep = np.sqrt(np.maximum(cs.cn[ca] + cs.cn[b[ask]] - 2.0 * cs.dots(ca, b[ask]), 1e-300))  # |c_a − c_b|
    yes = (sa[r[ask]] - sb) / sep <= d
    if cone is not None:
        yes &= sb >= cone[b[ask]]
    keep[ask] = yes
    return r[keep], b[keep]


def screen_basis(sample: np.ndarray, dims: int = 64) -> np.ndarray | None:
    """An orthonormal (d, ``dims``) basis of the sample's top principal directions (uncentred), for the
    guests' screen; None when ``dims`` is not well below d (the full product is as cheap)."""
    x = normalize(sample).astype(np.float64)
    if not len(x) or 2 * dims > x.shape[1]:
        return None
    _, vecs = np.linalg.eigh(x.T @ x)
    return np.ascontiguousarray(vecs[:, ::-1][:, :dims])


def project(x: np.ndarray, basis: np.ndarray | None) -> np.ndarray | None:
    """Unit rows as their coordinates in ``basis`` followed by an upper bound on the norm of what the basis
    misses (float32; the 1e-5 under the root covers the float32 rounding of |x|² − |Px|²): the product of
    two such rows is ⟨Px, Py⟩ + |x − Px|·|y − Py| ≥ ⟨x, y⟩ (Cauchy–Schwarz). None without a basis."""
    if basis is None:
        return None
    x = np.asarray(x, dtype=np.float32)
    out = np.empty((len(x), basis.shape[1] + 1), dtype=np.float32)
    p = out[:, :-1]
    np.matmul(x, basis.astype(np.float32), out=p)
    rest = np.einsum("ij,ij->i", x, x) - np.einsum("ij,ij->i", p, p)
    out[:, -1] = np.sqrt(np.maximum(rest, 0.0) + 1e-5)
    return out


def cluster_candidates(
    members: np.ndarray,
    guests: np.ndarray,
    guest_from: np.ndarray,
    cluster: int,
    centroids: np.ndarray,
    threshold: float,
    screen: tuple[np.ndarray, np.ndarray] | None = None,
    member_pairs: bool = True,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One cluster's pairs above the threshold: ((i, j, s) member–member, i < j, positions in ``members``;
    (g, j, s) guest–member, positions in ``guests`` and ``members``), cosines in float64. A guest from
    cluster a meets only the members within the reach of the a|b hyperplane: a pair across it has both
    ends there. With a ``screen`` (the members' and the guests' ``project``) every guest meets every
    member in the basis's few dimensions instead, by the bound ⟨Px, Py⟩ + |x − Px|·|y − Py| ≥ ⟨x, y⟩, and
    only the pairs it lets through get their exact cosine (``guests`` is then read at those rows only).
    Without ``member_pairs`` the member–member pairs are left to another task (none returned)."""
    um = normalize(members)
    none = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    mi, mj, ms = _unit_pairs(um, um, threshold, same=True) if member_pairs else none
    gi_all, gj_all, gs_all = [], [], []
    if screen is not None and len(guests) and len(members):
        qm, qg = screen
        chunk = min(_SCREEN_CHUNK, _rows_for(len(qm) * 6))  # float32 products, their mask and its copy
        for lo in range(0, len(qg), chunk):
            hi = min(lo + chunk, len(qg))
            passed = qg[lo:hi] @ qm.T > threshold - _SCREEN
            some = np.flatnonzero(passed.any(axis=1))  # most guests have no partner at all
            gi, gj = np.nonzero(passed[some])
            gi = some[gi] + lo
            if len(gi) > _SCREEN_PASS * (hi - lo) * len(qm):
                # the basis misses too much of these rows: the full product costs less than the cosines
                gi, gj, gs = _unit_pairs(normalize(guests[np.arange(lo, hi)]), um, threshold)
                gi += lo
            else:
                rows, at = np.unique(gi, return_inverse=True)
                gs = _exact_cosines(normalize(guests[rows]), um, at, gj)  # guests' vectors read lazily
                above = gs > threshold
                gi, gj, gs = gi[above], gj[above], gs[above]
            gi_all.append(gi)
            gj_all.append(gj)
            gs_all.append(gs)
    elif len(guests) and len(members):
        ug = normalize(guests[np.arange(len(guests))])
        c = np.asarray(centroids, dtype=np.float32)
        srcs, at = np.unique(guest_from, return_inverse=True)
        normal = c[cluster][None, :] - c[srcs]  # (s, d): towards b, one per guests' home cluster
        sep = np.linalg.norm(normal.astype(np.float64), axis=1)
        off = (
            (c[srcs].astype(np.float64) ** 2).sum(1) - float((c[cluster].astype(np.float64) ** 2).sum())
        ) / 2
        # (|y − c_a|² − |y − c_b|²) / 2|c_a − c_b|: the members' distance to each a|b hyperplane (≥ 0), and
        # the guests' to their own (float32 products: the slack covers their rounding)
        side_m = (um @ normal.T + off) / sep  # (m, s)
        side_g = -(np.einsum("ij,ij->i", ug, normal[at]) + off[at]) / sep[at]
        d = reach(threshold) + 1e-4
        for k in range(len(srcs)):
            rows = np.flatnonzero(at == k)
            # the pair's distance is at least the sum of its ends' distances to the hyperplane
            rows = rows[np.argsort(side_g[rows], kind="stable")]
            for lo in range(0, len(rows), _GUEST_CHUNK):
                chunk = rows[lo : lo + _GUEST_CHUNK]
                border = np.flatnonzero(side_m[:, k] < d - side_g[chunk[0]])
                if not len(border):
                    break
                gi, gj, gs = _unit_pairs(ug[chunk], um[border], threshold)
                gi_all.append(chunk[gi])
                gj_all.append(border[gj])
                gs_all.append(gs)
    if gi_all:
        g = (np.concatenate(gi_all), np.concatenate(gj_all), np.concatenate(gs_all))
    else:
        g = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))
    return (mi, mj, ms), g


@dataclass(frozen=True)
class SemanticResult:
    duplicate_of: np.ndarray  # (n,) object: the uid a row duplicates, "" for kept rows
    cluster: np.ndarray  # (n,) int64: each row's k-means cluster
    n_clusters: int
    n_guests: int = 0  # guest memberships: rows compared in a second cluster across a border

    @property
    def dropped(self) -> np.ndarray:
        return self.duplicate_of != ""


def _clustered(
    uids: np.ndarray, vectors: np.ndarray, cluster_rows: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uid order, the unit vectors in that order, k-means centroids at about ``cluster_rows`` rows a
    cluster): k-means sees the rows in uid order, so row order never matters."""
    canon = np.argsort(uids, kind="stable")
    x = normalize(np.asarray(vectors)[canon])
    return canon, x, kmeans_centroids(x, max(1, -(-len(uids) // int(cluster_rows))), seed)


def screen_sample(n: int, seed: int, rows: int = SCREEN_SAMPLE) -> np.ndarray:
    """Sorted positions of the rows (of ``n`` in uid order) the screen basis is fitted on."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 2]))
    return np.sort(rng.choice(n, size=min(n, rows), replace=False))


def semantic_duplicates(
    uids: np.ndarray,
    vectors: np.ndarray,
    threshold: float,
    priority: np.ndarray | None = None,
    cluster_rows: int = 1000,
    seed: int = 0,
) -> SemanticResult:
    """The all-pairs greedy rule in one process: k-means with about ``cluster_rows`` rows per cluster, each
    row in its nearest cluster and a guest of the clusters whose border it is near (``assign_with_guests``),
    the pairs above the threshold per cluster (``cluster_candidates``), then ``greedy_duplicates`` over their
    union. The Ray stage runs the same per-cluster step as tasks."""
    uids = np.asarray(uids).astype(str)
    n = len(uids)
    out = np.full(n, "", dtype=object)
    if n == 0:
        return SemanticResult(out, np.zeros(0, np.int64), 0)
    canon, x, centroids = _clustered(uids, vectors, cluster_rows, seed)
    basis = screen_basis(x[screen_sample(n, seed)])
    subs = sub_directions(x[screen_sample(n, seed, 256 * len(centroids))], centroids)
    primary, g_row, g_cl = assign_with_guests(
        x, centroids, threshold, member_cos=cluster_cosines(x, centroids, subs=subs), subs=subs
    )
    i, j, s = candidate_pairs_of(x, primary, g_row, g_cl, centroids, threshold, basis=basis)
    order = rank_order(uids[canon], None if priority is None else np.asarray(priority)[canon])
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    dup = greedy_duplicates(rank, i, j, s)
    hit = dup >= 0
    out[canon[hit]] = uids[canon[dup[hit]]]
    cluster = np.empty(n, dtype=np.int64)
    cluster[canon] = primary
    return SemanticResult(out, cluster, len(centroids), len(g_row))


class _Take:
    """Rows ``idx`` of ``x``, gathered only when indexed (the screen reads few guests' vectors)."""

    def __init__(self, x: np.ndarray, idx: np.ndarray) -> None:
        self.x, self.idx = x, idx

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        return self.x[self.idx[rows]]


def candidate_pairs_of(
    x: np.ndarray,
    primary: np.ndarray,
    guest_row: np.ndarray,
    guest_cluster: np.ndarray,
    centroids: np.ndarray,
    threshold: float,
    clusters: np.ndarray | None = None,
    basis: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair above the threshold among ``x``'s rows found by ``clusters`` (default: all), as row
    positions (i, j) and float64 cosines: members with members, guests with members."""
    members = cluster_members(primary)
    ids = np.unique(primary)
    guests = cluster_members(guest_cluster)
    g_ids = np.unique(guest_cluster)
    g_at = dict(zip(g_ids.tolist(), range(len(g_ids)), strict=True))
    wanted = ids if clusters is None else clusters
    at = dict(zip(ids.tolist(), range(len(ids)), strict=True))
    fi, fj, fs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.float64)]
    proj = project(x, basis)
    for cl in np.asarray(wanted).tolist():
        if cl not in at:
            continue
        rows = members[at[cl]]
        grows = guest_row[guests[g_at[cl]]] if cl in g_at else np.zeros(0, np.int64)
        screen = None if proj is None else (proj[rows], proj[grows])
        (mi, mj, ms), (gi, gj, gs) = cluster_candidates(
            x[rows], _Take(x, grows), primary[grows], cl, centroids, threshold, screen
        )
        fi += [rows[mi], grows[gi]]
        fj += [rows[mj], rows[gj]]
        fs += [ms, gs]
    return np.concatenate(fi), np.concatenate(fj), np.concatenate(fs)


def single_assignment_duplicates(
    uids: np.ndarray,
    vectors: np.ndarray,
    threshold: float,
    priority: np.ndarray | None = None,
    cluster_rows: int = 1000,
    seed: int = 0,
) -> SemanticResult:
    """SemDeDup as the paper runs it, each row in its nearest cluster only: pairs across two clusters are
    never seen (the baseline ``semantic_duplicates`` is measured against)."""
    uids = np.asarray(uids).astype(str)
    n = len(uids)
    out = np.full(n, "", dtype=object)
    canon, x, centroids = _clustered(uids, vectors, cluster_rows, seed)
    cluster = np.empty(n, dtype=np.int64)
    cluster[canon] = assign_clusters(x, centroids)
    for rows in cluster_members(cluster):
        p = None if priority is None else np.asarray(priority)[rows]
        local = dedup_cluster(np.asarray(vectors)[rows], uids[rows], p, threshold)
        hit = local >= 0
        out[rows[hit]] = uids[rows[local[hit]]]
    return SemanticResult(out, cluster, len(centroids))


def cluster_members(cluster: np.ndarray) -> list[np.ndarray]:
    """Row positions of each non-empty cluster, clusters in id order, rows ascending."""
    order = np.argsort(cluster, kind="stable")
    sc = cluster[order]
    if not len(sc):
        return []
    cuts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]])
    return [order[lo:hi] for lo, hi in zip(cuts.tolist(), np.r_[cuts[1:], len(sc)].tolist(), strict=True)]
