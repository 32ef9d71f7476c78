"""Eval-set leaks: pool rows that are near-copies of evaluation pictures. Pure functions, no Ray.

``eval_leaks``: a pool row leaks an evaluation picture when its embedding's cosine with the
picture's reaches ``embedding_threshold`` or its 64-bit pHash is within ``phash_threshold`` bits of the
picture's (the build's near-duplicate rule, ``pipeline/dedup/decisions.py``); the row is attributed to
the task of its best match (the embedding match first). DataComp removed such near-duplicates of its
evaluation images from its pool (Gadre et al. 2023, §3.3, App. F). The pHash match pairs pool rows with
reference pictures only (``phash_matches``), never pool rows with each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.dedup.decisions import bands
from pipeline.dedup.phash import hamming
from pipeline.dedup.semantic import normalize


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
        i, j = phash_matches(phash, ref.phash, phash_threshold)
        order = np.lexsort((j, i))
        i, j = i[order], j[order]
        first = np.r_[True, i[1:] != i[:-1]] if len(i) else np.zeros(0, bool)
        i, j = i[first], j[first]
        free = task[i] == ""
        task[i[free]], key[i[free]] = ref.task[j[free]], ref.key[j[free]]
    return task, key


def phash_matches(pool: np.ndarray, ref: np.ndarray, threshold: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (pool row, reference picture) whose int64 pHashes are within ``threshold`` bits, as index
    arrays. Two such hashes agree on one of ``threshold + 1`` bands (pigeonhole), so each band's pool
    values are looked up among the reference's sorted values: no pool–pool pair is ever formed."""
    pool = np.ascontiguousarray(pool, dtype=np.int64)
    ref = np.ascontiguousarray(ref, dtype=np.int64)
    if threshold >= 64:
        i, j = np.indices((len(pool), len(ref))).reshape(2, -1)
        return i.astype(np.int64), j.astype(np.int64)
    found = []
    for shift, width in bands(threshold + 1):
        mask = np.uint64((1 << width) - 1)
        pv = (pool.view(np.uint64) >> np.uint64(shift)) & mask
        rv = (ref.view(np.uint64) >> np.uint64(shift)) & mask
        order = np.argsort(rv, kind="stable")
        lo = np.searchsorted(rv[order], pv, "left")
        counts = np.searchsorted(rv[order], pv, "right") - lo
        i = np.repeat(np.arange(len(pool), dtype=np.int64), counts)
        at = np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo, counts)
        found.append(i * len(ref) + order[at])
    ij = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
    i, j = ij // max(len(ref), 1), ij % max(len(ref), 1)
    close = hamming(pool[i], ref[j]) <= threshold
    return i[close], j[close]


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
