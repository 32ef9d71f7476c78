"""Semantic duplicates (SemDeDup) and eval-set leaks over image embeddings: pure functions, no Ray.

**SemDeDup** (Abbas et al., "SemDeDup: Data-efficient learning at web-scale through semantic
deduplication", 2023): cluster the image embeddings with k-means, then inside each cluster call two rows
duplicates when their cosine similarity exceeds ``threshold`` (the paper's 1 − ε). Clustering, centroid
assignment and nearest-neighbour search are faiss's (``faiss.Kmeans``, ``IndexFlatIP``): spherical
k-means on a seeded sample, so the clusters are a function of the data and the seed. Only pairs inside
one cluster are compared, so the work and the memory of one step are bounded by the cluster's size
(``cluster_pairs``), never by the pool's; the Ray stage (``pipeline/dedup/curation_stage.py``) runs the
clusters as tasks.

The kept row of each duplicate group is chosen deterministically: rows are ranked by ``priority``
(descending; e.g. the pair's CLIP score, so the best-captioned copy stays), ties by uid ascending; in that
order a row is dropped when it is above the threshold with an earlier *kept* row, and it records the uid
of the most similar such row (``duplicate_of``). Row order and batching never change the result.

**Leaks** (``eval_leaks``): a pool row leaks an evaluation picture when its embedding's cosine with the
picture's reaches ``embedding_threshold`` or its 64-bit pHash is within ``phash_threshold`` bits of the
picture's (the build's near-duplicate rule, ``pipeline/dedup/decisions.py``); the row is attributed to
the task of its best match (the embedding match first). DataComp removed such near-duplicates of its
evaluation images from its pool (Gadre et al. 2023, §3.3, App. F).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.dedup.decisions import near_pairs

_BLOCK = 4096  # query rows per similarity block: a (block, cluster) float32 matrix at a time


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length as float32 (a zero row stays zero)."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.where(norms > 0, norms, 1.0)


def kmeans_centroids(vectors: np.ndarray, k: int, seed: int = 0, niter: int = 20) -> np.ndarray:
    """``k`` spherical k-means centroids (faiss), trained on at most 256·k rows drawn with ``seed``."""
    import faiss

    x = normalize(vectors)
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


def cluster_pairs(vectors: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (i < j) of rows with cosine > ``threshold``, with its cosine: exact, blocked."""
    x = normalize(vectors)
    found_i, found_j, found_s = [], [], []
    for a in range(0, len(x), _BLOCK):
        sims = x[a : a + _BLOCK] @ x.T  # (B, m)
        i, j = np.nonzero(sims > threshold)
        i += a
        later = j > i
        found_i.append(i[later])
        found_j.append(j[later])
        found_s.append(sims[i[later] - a, j[later]])
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(found_i), np.concatenate(found_j), np.concatenate(found_s)


def dedup_cluster(
    vectors: np.ndarray, uids: np.ndarray, priority: np.ndarray | None, threshold: float
) -> np.ndarray:
    """One cluster's decisions: per row the position (in this cluster) of the kept row it duplicates,
    −1 for a kept row (module docstring: greedy in rank order against kept rows only)."""
    m = len(uids)
    dup_of = np.full(m, -1, dtype=np.int64)
    if m < 2:
        return dup_of
    order = rank_order(uids, priority)
    rank = np.empty(m, dtype=np.int64)
    rank[order] = np.arange(m)
    i, j, s = cluster_pairs(vectors, threshold)
    if not len(i):
        return dup_of
    # Orient every pair as (better-ranked a, worse-ranked b); decide b in rank order.
    a = np.where(rank[i] < rank[j], i, j)
    b = np.where(rank[i] < rank[j], j, i)
    by = np.lexsort((-s, rank[a], rank[b]))
    a, b, s = a[by], b[by], s[by]
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = np.r_[starts[1:], len(b)]
    kept = np.ones(m, dtype=bool)
    for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
        alive = kept[a[lo:hi]]
        if alive.any():
            cand = np.arange(lo, hi)[alive]
            best = cand[np.argmax(s[cand])]  # the most similar kept row (first on a tie: better rank)
            kept[b[lo]] = False
            dup_of[b[lo]] = a[best]
    return dup_of


@dataclass(frozen=True)
class SemanticResult:
    duplicate_of: np.ndarray  # (n,) object: the uid a row duplicates, "" for kept rows
    cluster: np.ndarray  # (n,) int64: each row's k-means cluster
    n_clusters: int

    @property
    def dropped(self) -> np.ndarray:
        return self.duplicate_of != ""


def semantic_duplicates(
    uids: np.ndarray,
    vectors: np.ndarray,
    threshold: float,
    priority: np.ndarray | None = None,
    cluster_rows: int = 1000,
    seed: int = 0,
) -> SemanticResult:
    """SemDeDup over the whole set in one process: k-means with about ``cluster_rows`` rows per cluster,
    then ``dedup_cluster`` per cluster. The Ray stage runs the same per-cluster step as tasks."""
    uids = np.asarray(uids).astype(str)
    n = len(uids)
    out = np.full(n, "", dtype=object)
    if n == 0:
        return SemanticResult(out, np.zeros(0, np.int64), 0)
    canon = np.argsort(uids, kind="stable")  # k-means sees the rows in uid order: row order never matters
    x = np.asarray(vectors)[canon]
    k = max(1, -(-n // int(cluster_rows)))
    centroids = kmeans_centroids(x, k, seed)
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
    cuts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]])
    return [order[lo:hi] for lo, hi in zip(cuts.tolist(), np.r_[cuts[1:], len(sc)].tolist(), strict=True)]


# --- eval-set leaks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalReference:
    """The evaluation pictures a pool is checked against: per picture its task, key, pHash and (optional)
    embedding in the pool embeddings' space."""

    task: np.ndarray  # (m,) str
    key: np.ndarray  # (m,) str
    phash: np.ndarray  # (m,) int64
    vectors: np.ndarray | None = None  # (m, d) float32, or None: pHash only


def eval_leaks(
    phash: np.ndarray | None,
    vectors: np.ndarray | None,
    ref: EvalReference,
    phash_threshold: int = 4,
    embedding_threshold: float = 0.95,
    block: int = 1 << 16,
) -> tuple[np.ndarray, np.ndarray]:
    """Per pool row: the task of the evaluation picture it leaks ("" for none) and that picture's key.

    ``phash``: the pool rows' pHashes (int64, every row hashed), or None to match by embedding alone;
    ``vectors``: their embeddings, or None to match by pHash alone."""
    n = len(phash) if phash is not None else len(vectors)
    task = np.full(n, "", dtype=object)
    key = np.full(n, "", dtype=object)
    if vectors is not None and ref.vectors is not None and len(ref.task):
        best, sim = _nearest(vectors, ref.vectors, block)
        hit = sim >= embedding_threshold
        task[hit], key[hit] = ref.task[best[hit]], ref.key[best[hit]]
    if phash is not None and len(ref.task):
        h = np.concatenate([np.asarray(phash, np.int64), np.asarray(ref.phash, np.int64)])
        i, j = near_pairs(h, phash_threshold)
        cross = (i < n) & (j >= n)  # i < j always: a pool row before a reference picture
        i, j = i[cross], j[cross] - n
        order = np.lexsort((j, i))
        i, j = i[order], j[order]
        first = np.r_[True, i[1:] != i[:-1]] if len(i) else np.zeros(0, bool)
        i, j = i[first], j[first]
        free = task[i] == ""
        task[i[free]], key[i[free]] = ref.task[j[free]], ref.key[j[free]]
    return task, key


_EXACT_MAX = 20_000  # reference pictures searched exactly; above, an inverted-file index


def _nearest(vectors: np.ndarray, ref: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row the reference row with the largest cosine and that cosine. Exact (``IndexFlatIP``) for up
    to ``_EXACT_MAX`` reference rows; above, faiss's ``IndexIVFFlat`` over 4·√m cells searching 16 of them:
    a near-copy (cosine ≥ 0.9) falls in its original's cell or a neighbouring one, and the cost per pool
    row drops from m to ~4√m + 16·m/(4√m) inner products (bench/curation_scale.py measures its recall)."""
    import faiss

    ref = normalize(ref)
    d = ref.shape[1]
    if len(ref) <= _EXACT_MAX:
        index = faiss.IndexFlatIP(d)
    else:
        nlist = int(4 * np.sqrt(len(ref)))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = 0  # seeded training: the same reference gives the same cells
        index.train(ref)
        index.nprobe = 16
    index.add(ref)
    best = np.empty(len(vectors), dtype=np.int64)
    sim = np.empty(len(vectors), dtype=np.float32)
    for a in range(0, len(vectors), block):
        s, idx = index.search(normalize(vectors[a : a + block]), 1)
        best[a : a + block], sim[a : a + block] = idx[:, 0], s[:, 0]
    sim[best < 0] = -1.0  # an empty probe: no match
    best[best < 0] = 0
    return best, sim
