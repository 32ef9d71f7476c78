"""The curation stage's task bodies over embeddings files: each reads one file in blocks, in place.

A row is named by its position in the stage's uid-sorted row list (``canon``), so every task finds its
rows with one ``index_in`` and no task or driver copies the pool's vectors anywhere but into the
clusters' bucket files (docs/decisions/0097-curation-off-the-driver.md):

- ``sample_file``: the file's rows the stage wants, counted, and those whose uid hash falls under the
  fit's rate, as float16 rows (the k-means sample is drawn by uid, so it does not depend on the files);
- ``leak_file``: decontamination by embedding of the file's rows;
- ``assign_file``: each row to its nearest cluster and as a guest to the clusters whose border it is
  near (``semantic.assign_with_guests``), written to one bucketed file, a bucket per cluster group;
- ``group_pairs``: one group's bucket → its clusters' pairs above the threshold (``pairs_group``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.common.storage import Storage
from pipeline.dedup import eval_leaks as EL
from pipeline.dedup import semantic as SD
from pipeline.filters import embedding as E
from pipeline.filters.datacomp import uid_hash
from pipeline.stages.buckets import BucketWriter, read_bucket

_BLOCK = 1 << 16  # rows read, normalized and assigned at once
_SAMPLE_SALT = 0x5EED  # the fit sample's uid hash differs from every other use of uid_hash


def rows_of(src: str, key: str, canon: pa.Array, store: Storage) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The file's rows that ``canon`` lists, a block at a time: (their positions in ``canon``, their
    normalized vectors as float16 then float32, the precision every task compares in)."""
    for uids, arrays in E.iter_embedding_blocks(src, (key,), store, _BLOCK):
        pos = pc.index_in(pa.array(uids, pa.string()), value_set=canon)
        found = pos.is_valid().to_numpy(zero_copy_only=False)
        if found.any():
            at = pc.drop_null(pos).to_numpy().astype(np.int64)
            yield at, SD.normalize(arrays[key][found]).astype(np.float16).astype(np.float32)


def sample_hash(canon: pa.Array, at: np.ndarray, seed: int) -> np.ndarray:
    return uid_hash(canon.take(pa.array(at)), seed ^ _SAMPLE_SALT)


def sample_file(
    src: str, key: str, canon: pa.Array, cut: int, seed: int, store: Storage
) -> tuple[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """→ (the number of ``canon``'s rows the file holds, how many it sampled), and its sampled rows: (uid
    hash, position, float16 vector) of those whose hash is below ``cut``."""
    n, hs, ps, vs = 0, [np.zeros(0, np.uint64)], [np.zeros(0, np.int64)], []
    for at, vec in rows_of(src, key, canon, store):
        n += len(at)
        h = sample_hash(canon, at, seed)
        take = h < np.uint64(cut) if cut < (1 << 64) else np.ones(len(h), bool)
        hs.append(h[take])
        ps.append(at[take])
        vs.append(vec[take].astype(np.float16))
    sample = (
        np.concatenate(hs),
        np.concatenate(ps),
        np.concatenate(vs) if vs else np.zeros((0, 0), np.float16),
    )
    return (n, len(sample[0])), sample


def fit_sample(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], m: int) -> np.ndarray:
    """The files' samples → the ``m`` rows of smallest uid hash, in ``canon`` order (float32)."""
    h = np.concatenate([p[0] for p in parts])
    pos = np.concatenate([p[1] for p in parts])
    vec = np.concatenate([p[2] for p in parts if len(p[2])])
    keep = np.argsort(h, kind="stable")[:m]
    keep = keep[np.argsort(pos[keep], kind="stable")]
    return vec[keep].astype(np.float32)


def leak_file(
    src: str, key: str, canon: pa.Array, ref: EL.EvalReference, threshold: float, store: Storage
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """→ (position, task, key) of the file's rows that copy an eval picture by embedding."""
    at_, task_, key_ = [np.zeros(0, np.int64)], [np.zeros(0, object)], [np.zeros(0, object)]
    for at, vec in rows_of(src, key, canon, store):
        task, k = EL.eval_leaks(None, vec, ref, 0, threshold)
        hit = task != ""
        at_.append(at[hit])
        task_.append(task[hit])
        key_.append(k[hit])
    return np.concatenate(at_), np.concatenate(task_), np.concatenate(key_)


def _vector_column(vec: np.ndarray) -> pa.Array:
    raw = np.ascontiguousarray(vec.astype(np.float16))
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(raw.shape[1] * 2), len(raw), [None, pa.py_buffer(raw.tobytes())]
    )


def assign_file(
    src: str,
    key: str,
    canon: pa.Array,
    centroids: np.ndarray,
    threshold: float,
    per_group: int,
    out: str,
    store: Storage,
) -> int:
    """The file's rows' cluster memberships (home, then guest ones), bucketed by cluster group
    (``cluster // per_group``) into ``out`` → the number of memberships written."""
    w = BucketWriter(out, store)
    n = 0
    try:
        for at, vec in rows_of(src, key, canon, store):
            primary, g_row, g_cl = SD.assign_with_guests(vec, centroids, threshold)
            rows = np.concatenate([np.arange(len(at)), g_row])
            cluster = np.concatenate([primary, g_cl])
            t = pa.table({"row": pa.array(at[rows]), "home": pa.array(primary[rows].astype(np.int32)),
                          "cluster": pa.array(cluster.astype(np.int32)), "vec": _vector_column(vec[rows])})  # fmt: skip
            w.add(t, cluster // per_group)
            n += len(rows)
        w.close(pa.schema([("row", pa.int64()), ("home", pa.int32()), ("cluster", pa.int32()),
                           ("vec", pa.binary(centroids.shape[1] * 2))]))  # fmt: skip
    except BaseException:
        w.abort()
        raise
    return n


def group_pairs(
    paths: Sequence[str],
    g: int,
    per_group: int,
    centroids: np.ndarray,
    threshold: float,
    basis: np.ndarray | None,
    store: Storage,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cluster group ``g``'s bucket from every file → its pairs above the threshold (positions in canon)."""
    t = read_bucket(paths, g, store)
    if not t.num_rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    row = t.column("row").to_numpy()
    home = t.column("home").to_numpy().astype(np.int64)
    cluster = t.column("cluster").to_numpy().astype(np.int64)
    raw = t.column("vec").combine_chunks()
    width = raw.type.byte_width
    buf = np.frombuffer(raw.buffers()[1], np.uint8)[raw.offset * width : (raw.offset + len(raw)) * width]
    vec = buf.view(np.float16).reshape(len(raw), -1)
    order = np.lexsort((row, home != cluster, cluster))  # per cluster its members, then its guests, by row
    ids, sizes, flat = [], [], []
    for c in range(g * per_group, min((g + 1) * per_group, len(centroids))):
        pick = order[cluster[order] == c]
        m = int((home[pick] == c).sum())
        if m == 0:
            continue
        ids.append(c)
        sizes.append((m, len(pick) - m))
        flat.append(pick)
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    idx = np.concatenate(flat)
    return pairs_group(
        vec[idx].astype(np.float32), row[idx], home[idx], sizes, ids, centroids, threshold, basis
    )


def pairs_group(
    vecs: np.ndarray,
    flat: np.ndarray,
    home: np.ndarray,
    sizes: list[tuple[int, int]],
    clusters: list[int],
    centroids: np.ndarray,
    threshold: float,
    basis: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One task: ``cluster_candidates`` of each of a group's clusters (per cluster its members, then its
    guests, whose home clusters are ``home``; screened in ``basis``'s dimensions when there is one) → the
    pairs above the threshold as positions ``flat`` holds."""
    fi, fj, fs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.float64)]
    at = 0
    for (m, g), cl in zip(sizes, clusters, strict=True):
        mem, gst = slice(at, at + m), slice(at + m, at + m + g)
        screen = None
        if basis is not None:
            screen = (SD.project(SD.normalize(vecs[mem]), basis), SD.project(SD.normalize(vecs[gst]), basis))
        (mi, mj, ms), (gi, gj, gs) = SD.cluster_candidates(
            vecs[mem], vecs[gst], home[gst], cl, centroids, threshold, screen
        )
        fi += [flat[mem][mi], flat[gst][gi]]
        fj += [flat[mem][mj], flat[mem][gj]]
        fs += [ms, gs]
        at += m + g
    return np.concatenate(fi), np.concatenate(fj), np.concatenate(fs)
