"""The curation stage's task bodies over embeddings files: each reads one file in blocks, in place.

Every task works on all of its file's rows and names them by uid, so no task needs the list of rows the
build curates (which rows count is decided from the uid buckets afterwards) and no task or driver copies
the pool's vectors anywhere but into the clusters' bucket files (docs/decisions/0097):

- ``count_file``: the file's rows (its uids only); ``width_file``: its vectors' width (one block);
- ``sample_file``: those whose uid hash falls under the fit's rate, as float16 rows (the k-means sample
  is drawn by uid, so it does not depend on how the files split the pool); ``centroid_sums``: a Lloyd
  step over a larger sample drawn the same way, when the fit saw fewer than 256 rows a centroid;
- ``leak_file``: decontamination by embedding of the file's rows;
- ``cosines_file``: how far each cluster's members of the file lie from its direction and its
  sub-directions;
- ``assign_file``: each row to its nearest cluster and as a guest to the clusters whose border it is
  near and whose members it can reach (``semantic.assign_with_guests``), written to one bucketed file,
  a bucket per cluster group of the ``GroupPlan``;
- ``group_pairs``: one group's bucket → its clusters' pairs above the threshold, as positions in the
  sorted uids they name.

The ``GroupPlan`` packs clusters into groups of a bounded number of memberships by a sample's estimate
of each cluster's members and guests, and splits a cluster with more guests than a group holds over
several groups, each with all its members and a share of its guests by uid hash, so no task's memory
follows the widest cluster (docs/decisions/0104).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.common.storage import Storage
from pipeline.dedup import eval_leaks as EL
from pipeline.dedup import semantic as SD
from pipeline.filters import embedding as E
from pipeline.filters.datacomp import uid_hash
from pipeline.stages.buckets import BucketWriter, read_bucket

# rows read, normalized and assigned at once (50 MB of float32 at 768-d); memberships in a table
_BLOCK = 1 << 14
_SAMPLE_SALT = 0x5EED  # the fit sample's uid hash differs from every other use of uid_hash
_SLICE_SALT = 0x511CE  # and so does the hash that shares a wide cluster's guests out


def rows_of(src: str, key: str, store: Storage) -> Iterator[tuple[pa.Array, np.ndarray]]:
    """The file's rows a block at a time: (their uids, their normalized vectors as float16 then float32,
    the precision every task compares in)."""
    for uids, arrays in E.iter_embedding_blocks(src, (key,), store, _BLOCK):
        yield pa.array(uids, pa.string()), SD.normalize(arrays[key]).astype(np.float16).astype(np.float32)


def count_file(src: str, store: Storage) -> int:
    """The number of rows the file holds (its uid array read, no vector)."""
    return sum(len(uids) for uids, _ in E.iter_embedding_blocks(src, (), store, _BLOCK))


def width_file(src: str, key: str, store: Storage) -> int:
    """The width of the file's vectors (its first block read; 0 when it has no rows)."""
    return next((vec.shape[1] for _, vec in rows_of(src, key, store)), 0)


def sample_hash(uids: pa.Array, seed: int) -> np.ndarray:
    return uid_hash(uids, seed ^ _SAMPLE_SALT)


def sample_file(src: str, key: str, cut: int, seed: int, store: Storage) -> tuple[np.ndarray, np.ndarray]:
    """The file's sample: (uid hash, float16 vector) of the rows whose hash is below ``cut``."""
    hs, vs = [np.zeros(0, np.uint64)], []
    for uids, vec in rows_of(src, key, store):
        h = sample_hash(uids, seed)
        take = h < np.uint64(cut) if cut < (1 << 64) else np.ones(len(h), bool)
        hs.append(h[take])
        vs.append(vec[take].astype(np.float16))
    return np.concatenate(hs), np.concatenate(vs) if vs else np.zeros((0, 0), np.float16)


def fit_sample(parts: Sequence[tuple[np.ndarray, np.ndarray]], m: int) -> np.ndarray:
    """The files' samples → the ``m`` rows of smallest uid hash, in hash order, as unit float32 rows
    written straight into the one array the fit holds (no float16 copy of the whole sample)."""
    h = np.concatenate([p[0] for p in parts])
    order = np.argsort(h, kind="stable")[:m]
    starts = np.cumsum([0] + [len(p[0]) for p in parts])
    at = np.argsort(order, kind="stable")  # output positions by input row, so by part
    cut = np.searchsorted(order[at], starts)
    width = next((p[1].shape[1] for p in parts if len(p[1])), 0)
    out = np.empty((len(order), width), np.float32)
    for i, (_, vec) in enumerate(parts):
        mine = at[cut[i] : cut[i + 1]]
        out[mine] = vec[order[mine] - starts[i]]
    for a in range(0, len(out), _BLOCK):
        out[a : a + _BLOCK] = SD.normalize(out[a : a + _BLOCK])
    return out


def centroid_sums(
    src: str, key: str, cut: int, seed: int, centroids: np.ndarray, store: Storage
) -> tuple[np.ndarray, np.ndarray]:
    """One Lloyd step over the file's rows whose uid hash is below ``cut``: per centroid the float64 sum
    of those rows nearest it, and their count (k·d·8 bytes whatever the file's size)."""
    sums = np.zeros(centroids.shape, np.float64)
    counts = np.zeros(len(centroids), np.int64)
    for uids, vec in rows_of(src, key, store):
        h = sample_hash(uids, seed)
        take = h < np.uint64(cut) if cut < (1 << 64) else np.ones(len(h), bool)
        if not take.any():
            continue
        v = vec[take]
        near = SD.assign_clusters(v, centroids)
        order = np.argsort(near, kind="stable")
        ids, starts = np.unique(near[order], return_index=True)
        sums[ids] += np.add.reduceat(v[order].astype(np.float64), starts, axis=0)
        counts += np.bincount(near, minlength=len(centroids))
    return sums, counts


def leak_file(
    src: str, key: str, ref: EL.EvalReference, threshold: float, store: Storage
) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """→ (uid, task, key) of the file's rows that copy an eval picture by embedding."""
    uid_, task_, key_ = [pa.array([], pa.string())], [np.zeros(0, object)], [np.zeros(0, object)]
    for uids, vec in rows_of(src, key, store):
        task, k = EL.eval_leaks(None, vec, ref, 0, threshold)
        hit = task != ""
        uid_.append(uids.filter(pa.array(hit)))
        task_.append(task[hit])
        key_.append(k[hit])
    return pa.concat_arrays(uid_), np.concatenate(task_), np.concatenate(key_)


def cosines_file(
    src: str, key: str, centroids: np.ndarray, store: Storage, subs: np.ndarray | None = None
) -> np.ndarray:
    """Per cluster the smallest cosine of the file's members to its direction, and to its sub-directions
    given ``subs`` (``semantic.cluster_cosines``)."""
    # no row yet: the "no member" value of every cell, in the shape the files' rows fold into
    out = SD.cluster_cosines(np.zeros((0, centroids.shape[1]), np.float32), centroids, subs=subs)
    for _, vec in rows_of(src, key, store):
        out = np.minimum(out, SD.cluster_cosines(vec, centroids, subs=subs))
    return out


def _vector_column(vec: np.ndarray) -> pa.Array:
    raw = np.ascontiguousarray(vec.astype(np.float16))
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(raw.shape[1] * 2), len(raw), [None, pa.py_buffer(raw.tobytes())]
    )


def _vectors_of(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A ``_vector_column`` read back: float16 rows, a view of the column's buffer."""
    raw = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    width = raw.type.byte_width
    buf = np.frombuffer(raw.buffers()[1], np.uint8)[raw.offset * width : (raw.offset + len(raw)) * width]
    return buf.view(np.float16).reshape(len(raw), -1)


@dataclass(frozen=True)
class GroupPlan:
    """Cluster c's members go to buckets ``first[c]`` … ``first[c] + slices[c] − 1``, each of them, and each
    of its guests to one of those by uid hash; the task of bucket ``first[c]`` alone pairs c's members
    with each other, so every pair is found once."""

    first: np.ndarray
    slices: np.ndarray

    @property
    def n_buckets(self) -> int:
        return int((self.first + self.slices).max()) if len(self.first) else 0


def plan_groups(members: np.ndarray, guests: np.ndarray, budget: float) -> GroupPlan:
    """Consecutive clusters packed into groups of at most ``budget`` memberships (as estimated: members
    plus guests); a cluster past it on its own, its guests over as many groups as keep each within it
    (at least half the budget of guests each, when its members alone take more than half)."""
    k = len(members)
    first, slices = np.zeros(k, np.int64), np.ones(k, np.int64)
    b, load = 0, 0.0
    for c in range(k):
        m, g = float(members[c]), float(guests[c])
        if m + g > budget:
            b += load > 0
            first[c], slices[c] = b, max(1, int(np.ceil(g / max(budget - m, budget / 2))))
            b, load = b + int(slices[c]), 0.0
            continue
        if load > 0 and load + m + g > budget:
            b, load = b + 1, 0.0
        first[c], load = b, load + m + g
    return GroupPlan(first, slices)


def assign_file(
    src: str,
    key: str,
    centroids: np.ndarray,
    member_cos: np.ndarray,
    threshold: float,
    plan: GroupPlan,
    out: str,
    store: Storage,
    subs: np.ndarray | None = None,
) -> int:
    """The file's rows' cluster memberships (home, then guest ones), bucketed by the ``plan``'s groups
    into ``out`` → the number of memberships written (a wide cluster's members once for each of its
    groups)."""
    w = BucketWriter(out, store)
    n = 0
    try:
        rows_at_once = _BLOCK
        for block_uids, block in rows_of(src, key, store):
            lo = 0
            while lo < len(block_uids):
                uids, vec = block_uids[lo : lo + rows_at_once], block[lo : lo + rows_at_once]
                written = _assign_rows(uids, vec, centroids, member_cos, threshold, plan, w, subs)
                n, lo = n + written, lo + len(uids)
                # a row may be a guest of many clusters: the next rows sized to ~_BLOCK memberships
                rows_at_once = int(np.clip(_BLOCK * len(uids) // max(1, written), 256, _BLOCK))
        w.close(pa.schema([("uid", pa.string()), ("home", pa.int32()), ("cluster", pa.int32()),
                           ("vec", pa.binary(centroids.shape[1] * 2))]))  # fmt: skip
    except BaseException:
        w.abort()
        raise
    return n


def _assign_rows(
    uids: pa.Array,
    vec: np.ndarray,
    centroids: np.ndarray,
    member_cos: np.ndarray,
    threshold: float,
    plan: GroupPlan,
    w: BucketWriter,
    subs: np.ndarray | None,
) -> int:
    """``assign_file`` for one block of rows → the memberships it wrote."""
    primary, g_row, g_cl = SD.assign_with_guests(vec, centroids, threshold, member_cos=member_cos, subs=subs)
    copies = plan.slices[primary]
    home_rows = np.repeat(np.arange(len(uids)), copies)
    nth = np.arange(len(home_rows)) - np.repeat(np.cumsum(copies) - copies, copies)
    share = np.zeros(len(g_row), np.int64)  # which of its cluster's groups a guest goes to
    sliced = plan.slices[g_cl] > 1
    if sliced.any():  # the uids hashed only where a cluster spans several groups
        h = uid_hash(uids.take(pa.array(g_row[sliced])), _SLICE_SALT)
        share[sliced] = (h % plan.slices[g_cl[sliced]].astype(np.uint64)).astype(np.int64)
    every = np.concatenate([home_rows, g_row])
    clusters = np.concatenate([primary[home_rows], g_cl])
    buckets = np.concatenate([plan.first[primary][home_rows] + nth, plan.first[g_cl] + share])
    half = vec.astype(np.float16)
    for a in range(0, len(every), _BLOCK):  # bounded tables
        rows, cluster = every[a : a + _BLOCK], clusters[a : a + _BLOCK]
        t = pa.table({"uid": uids.take(pa.array(rows)), "home": pa.array(primary[rows].astype(np.int32)),
                      "cluster": pa.array(cluster.astype(np.int32)), "vec": _vector_column(half[rows])})  # fmt: skip
        w.add(t, buckets[a : a + _BLOCK])
    return len(every)


def group_pairs(
    paths: Sequence[str],
    g: int,
    first: np.ndarray,
    centroids: np.ndarray,
    threshold: float,
    basis: np.ndarray | None,
    store: Storage,
) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
    """Group ``g``'s bucket from every file → its clusters' pairs above the threshold as (the uids they
    name, sorted and once each; positions i, j in them as int32; cosine); member–member pairs only of the
    clusters whose first group it is (``GroupPlan.first``)."""
    none = pa.array([], pa.string()), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64)
    t = read_bucket(paths, g, store)
    if not t.num_rows:
        return none
    t = t.sort_by("uid")  # rows in uid order, so no file or task order moves a pair
    row = np.arange(t.num_rows)
    home = t.column("home").to_numpy().astype(np.int64)
    cluster = t.column("cluster").to_numpy().astype(np.int64)
    vec = _vectors_of(t.column("vec"))
    order = np.lexsort((row, home != cluster, cluster))  # per cluster its members, then its guests, by row
    ids, starts = np.unique(cluster[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    keep, sizes, flat = [], [], []
    for c, lo, hi in zip(ids.tolist(), starts.tolist(), ends.tolist(), strict=True):
        pick = order[lo:hi]
        m = int((home[pick] == c).sum())
        if m == 0:
            continue
        keep.append(c)
        sizes.append((m, len(pick) - m))
        flat.append(pick)
    if not keep:
        return none
    idx = np.concatenate(flat)
    own = [int(first[c]) == g for c in keep]
    i, j, s = pairs_group(
        vec[idx].astype(np.float32), row[idx], home[idx], sizes, keep, centroids, threshold, basis, own
    )
    uids = t.column("uid").combine_chunks()
    # a uid is a member and a guest in one group: rows sorted by uid, so equal uids are neighbours
    same = np.zeros(len(uids), bool)
    same[1:] = pc.equal(uids.slice(1), uids.slice(0, len(uids) - 1)).to_numpy(zero_copy_only=False)
    name = np.cumsum(~same) - 1  # each row's uid, numbered in uid order
    used, at = np.unique(np.concatenate([name[i], name[j]]), return_inverse=True)
    rows = np.flatnonzero(~same)[used]  # a row of each named uid
    at = at.astype(np.int32)
    return uids.take(pa.array(rows)), at[: len(i)], at[len(i) :], s


def pairs_group(
    vecs: np.ndarray,
    flat: np.ndarray,
    home: np.ndarray,
    sizes: list[tuple[int, int]],
    clusters: list[int],
    centroids: np.ndarray,
    threshold: float,
    basis: np.ndarray | None = None,
    own: Sequence[bool] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One task: ``cluster_candidates`` of each of a group's clusters (per cluster its members, then its
    guests, whose home clusters are ``home``; screened in ``basis``'s dimensions when there is one; the
    members paired with each other where ``own`` says so, every cluster without it) → the pairs above
    the threshold as positions ``flat`` holds."""
    fi, fj, fs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.float64)]
    at = 0
    own = [True] * len(clusters) if own is None else own
    for (m, g), cl, mine in zip(sizes, clusters, own, strict=True):
        mem, gst = slice(at, at + m), slice(at + m, at + m + g)
        screen = None
        if basis is not None:
            screen = (SD.project(SD.normalize(vecs[mem]), basis), SD.project(SD.normalize(vecs[gst]), basis))
        (mi, mj, ms), (gi, gj, gs) = SD.cluster_candidates(
            vecs[mem], vecs[gst], home[gst], cl, centroids, threshold, screen, member_pairs=mine
        )
        fi += [flat[mem][mi], flat[gst][gi]]
        fj += [flat[mem][mj], flat[mem][gj]]
        fs += [ms, gs]
        at += m + g
    return np.concatenate(fi), np.concatenate(fj), np.concatenate(fs)
