"""The build's image dedupe after download, as tasks: exact duplicates by image sha256, near duplicates by
pHash, each equal to ``status_table.decide_image_duplicates`` over every part at once.

1. ``map_parts`` (per part group): the group's part rows bucketed by uid (for the status table) and its
   successes bucketed by image sha256.
2. ``exact_dups`` (per sha bucket): ``decisions.exact_duplicates`` (the smallest uid keeps the bytes);
   the duplicates bucketed by uid.
3. ``band_rows`` (per uid bucket): the successes left, each once per pHash band. The rule is greedy in
   uid order (a hash within ``t`` bits of an earlier *kept* one goes), so only the candidate pairs need
   the whole pool: two hashes within ``t`` bits agree exactly on one of ``t + 1`` bands (pigeonhole), so
   hashing (band, band value) to buckets brings every near pair together at least once.
4. ``near_pairs_of`` (per band bucket): in each band's rows, a hash held by several uids keeps its
   smallest uid (the others always go: ``decisions.near_duplicates``), and ``decisions.near_pairs`` finds
   the pairs of distinct hashes within ``t`` bits; a pair is written only by the band it agrees on first,
   so each pair once.
5. ``near_greedy`` (one task): the greedy over the pairs, in uid order (a node with no pair is kept). Its
   memory is the pairs' (two uids each), not the pool's: docs/decisions/0086-the-build-on-tasks.md.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.dedup.decisions import bands, exact_duplicates, near_pairs
from pipeline.stages.buckets import hash_bucket, read_bucket, string_buckets, uid_buckets, write_buckets
from pipeline.stages.layout import Parts
from pipeline.subsets.uid_files import arrow_u8pairs

PART, BAND = "part", "band"
PART_READ = [S.UID, S.STATUS, "error", S.WIDTH, S.HEIGHT, S.IMAGE_SHA256, S.PHASH]
_UIDS = pa.schema([pa.field(S.UID, pa.string())])


def _success(t: pa.Table) -> np.ndarray:
    return pc.fill_null(pc.equal(t.column(S.STATUS), S.STATUS_SUCCESS), False).to_numpy(zero_copy_only=False)


def map_parts(job: Parts, g: int) -> dict:
    """Stage 1 for part group ``g``; → its rows per status and its successes per part."""
    tables = []
    for p in job.group(g):
        t = job.store.read_parquet(job.part_file(p, "parquet"))
        t = t.select([c for c in PART_READ if c in t.column_names])
        tables.append(t.append_column(PART, pa.array(np.full(t.num_rows, p, np.int64))))
    t = pa.concat_tables(tables, promote_options="permissive")
    for c, typ in ((S.IMAGE_SHA256, pa.string()), (S.PHASH, pa.int64())):
        if c not in t.column_names:
            t = t.append_column(c, pa.nulls(t.num_rows, typ))
    write_buckets(t, uid_buckets(t.column(S.UID), job.pool.n_buckets), job.by_uid(g), job.store)
    ok = t.filter(pa.array(_success(t))).select([S.UID, S.IMAGE_SHA256])
    sha = pc.utf8_lower(ok.column(S.IMAGE_SHA256).cast(pa.string()))
    write_buckets(ok, string_buckets(sha, job.n_sha), job.by_sha(g), job.store)
    counts = pc.value_counts(t.column(S.STATUS)).to_pylist()
    return {"rows": t.num_rows, "status": {c["values"]: c["counts"] for c in counts}}


def exact_dups(job: Parts, e: int) -> dict:
    """Stage 2 for sha bucket ``e``; → the number of duplicates."""
    t = read_bucket([job.by_sha(g) for g in range(job.n_groups)], e, job.store)
    if t.num_columns and t.num_rows:
        dup = exact_duplicates(t.column(S.UID).combine_chunks(), t.column(S.IMAGE_SHA256).combine_chunks())
        out = t.filter(pa.array(dup)).select([S.UID])
    else:
        out = _UIDS.empty_table()
    write_buckets(out, uid_buckets(out.column(S.UID), job.pool.n_buckets), job.exact(e), job.store)
    return {S.STATUS_DUPLICATE_IMAGE: out.num_rows}


def _minus(t: pa.Table, uids: pa.Table) -> pa.Table:
    if not uids.num_columns or not uids.num_rows:
        return t
    gone = pc.is_in(t.column(S.UID), value_set=uids.column(S.UID).combine_chunks())
    return t.filter(pc.invert(gone))


def band_rows(job: Parts, b: int) -> dict:
    """Stage 3 for uid bucket ``b``; → the rows written (one per band)."""
    t = read_bucket([job.by_uid(g) for g in range(job.n_groups)], b, job.store, [S.UID, S.STATUS, S.PHASH])
    exact = read_bucket([job.exact(e) for e in range(job.n_sha)], b, job.store)
    if t.num_columns and t.num_rows:
        t = _minus(t.filter(pa.array(_success(t))), exact)
        t = t.filter(t.column(S.PHASH).is_valid()).select([S.UID, S.PHASH])
    else:
        t = pa.table({S.UID: pa.array([], pa.string()), S.PHASH: pa.array([], pa.int64())})
    h = t.column(S.PHASH).to_numpy().astype(np.int64).view(np.uint64)
    pieces, keys = [], []
    for k, (shift, width) in enumerate(bands(job.phash_threshold + 1)):
        value = (h >> np.uint64(shift)) & np.uint64((1 << width) - 1)
        pieces.append(t.append_column(BAND, pa.array(np.full(t.num_rows, k, np.int8))))
        keys.append(hash_bucket(value, job.n_band, salt=k))
    out = pa.concat_tables(pieces) if pieces else t
    write_buckets(out, np.concatenate(keys) if keys else np.zeros(0, np.int64), job.by_band(b), job.store)
    return {"rows": out.num_rows}


def _first_shared_band(a: np.ndarray, b: np.ndarray, threshold: int) -> np.ndarray:
    """Per pair of uint64 hashes, the first band (of ``threshold + 1``) they agree on, or -1."""
    first = np.full(len(a), -1, np.int64)
    for k, (shift, width) in reversed(list(enumerate(bands(threshold + 1)))):
        mask = np.uint64(((1 << width) - 1) << shift)
        first[(a & mask) == (b & mask)] = k
    return first


def near_pairs_of(job: Parts, n: int) -> dict:
    """Stage 4 for band bucket ``n``; → the copies and pairs found."""
    t = read_bucket([job.by_band(b) for b in range(job.pool.n_buckets)], n, job.store)
    copies, first, second = [], [], []
    if t.num_columns and t.num_rows:
        band = t.column(BAND).to_numpy()
        for k in np.unique(band).tolist():
            sub = t.filter(pa.array(band == k))
            order = pc.sort_indices(sub, sort_keys=[(S.PHASH, "ascending"), (S.UID, "ascending")]).to_numpy()
            uids = np.asarray(sub.column(S.UID).take(pa.array(order)).to_pylist(), dtype=object)
            h = sub.column(S.PHASH).to_numpy()[order].astype(np.int64)
            rep = np.concatenate([[True], h[1:] != h[:-1]]) if len(h) else np.zeros(0, bool)
            if k == 0:  # every holder of a hash meets in band 0's bucket of it: copies are written once
                copies.extend(uids[~rep].tolist())
            hr, ur = h[rep], uids[rep]
            i, j = near_pairs(hr, job.phash_threshold)
            hu = hr.view(np.uint64)
            own = _first_shared_band(hu[i], hu[j], job.phash_threshold) == k
            i, j = i[own], j[own]
            lo = np.where(ur[i] < ur[j], ur[i], ur[j])
            hi = np.where(ur[i] < ur[j], ur[j], ur[i])
            first.extend(lo.tolist())
            second.extend(hi.tolist())
    out = pa.table({"a": pa.array(first, pa.string()), "b": pa.array(second, pa.string())})
    job.store.write_parquet(out, job.pairs(n))
    job.store.write_parquet(pa.table({S.UID: pa.array(copies, pa.string())}), job.pairs(n) + ".copies")
    return {"pairs": out.num_rows, "copies": len(copies)}


def greedy_drops(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The nodes the uid-order greedy drops, given its edges ``a < b`` (``u8,u8`` uids, which sort as the
    uids do): a node goes when an earlier neighbour is kept."""
    if not len(a):
        return np.zeros(0, S.UID_DTYPE)
    nodes, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
    ia, ib = inv[: len(a)], inv[len(a) :]
    order = np.lexsort((ia, ib))
    ia, ib = ia[order], ib[order]
    keep = np.ones(len(nodes), dtype=bool)
    targets, starts = np.unique(ib, return_index=True)
    ends = np.append(starts[1:], len(ib))
    for j, s, e in zip(targets.tolist(), starts.tolist(), ends.tolist(), strict=True):
        if keep[ia[s:e]].any():
            keep[j] = False
    return nodes[~keep]


def near_greedy(job: Parts, _key: int = 0) -> dict:
    """Stage 5: the near duplicates of the whole pool, bucketed by uid; → their number."""
    files = [job.pairs(n) for n in range(job.n_band)]
    pairs = job.store.read_parquet(files)
    copies = job.store.read_parquet([f + ".copies" for f in files]).column(S.UID)
    dropped = greedy_drops(arrow_u8pairs(pairs.column("a")), arrow_u8pairs(pairs.column("b")))
    uids = pa.concat_arrays([pa.array(S.u8pairs_to_uids(dropped), pa.string()), copies.combine_chunks()])
    out = pa.table({S.UID: uids})
    write_buckets(out, uid_buckets(out.column(S.UID), job.pool.n_buckets), job.near_dups(), job.store)
    return {S.STATUS_NEAR_DUPLICATE: out.num_rows}
