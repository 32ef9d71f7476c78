"""The build's status table and the rows its shards take, as tasks per uid bucket and per part group.

``statuses`` (per uid bucket) gathers every decision about the bucket's uids — the row decisions before
download and the URL duplicates (pipeline/stages/row_stages.py), the part rows, the exact and near image
duplicates (pipeline/stages/image_stages.py) and the curation stage's relabels — and writes:

- the bucket's file of the status table, ``metadata/status.parquet/<bucket>.parquet``: one row per input
  row, the rows decided before download first (in read order) then the part rows, sorted by uid (stable),
  as ``status_table.status_table_of`` makes it for the whole pool (buckets are uid ranges, so the files
  in name order are the table sorted by uid, invalid uids aside: those are hashed to buckets);
- the bucket's pool rows with their final pre-download status, for the filters;
- its successes bucketed by part group, which ``group_survivors`` gathers per group, by part and uid:
  the order the final shards take them in (part by part, each part's tar in uid order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import storage
from pipeline.stages.buckets import read_bucket, uid_buckets, write_buckets
from pipeline.stages.image_stages import PART
from pipeline.stages.layout import Parts
from pipeline.stages.row_stages import FILE, PRE, ROW

STATUS_COLUMNS = [S.UID, S.STATUS, "error", S.WIDTH, S.HEIGHT, S.IMAGE_SHA256, S.DUPLICATE_OF, S.LEAK_OF]


@dataclass(frozen=True)
class Finish:
    """What the status stage reads and writes besides the stage layout."""

    parts: Parts
    status_dir: str  # metadata/status.parquet (a directory of one file per uid bucket)
    curated: bool  # the curation stage ran (its relabels exist)

    def status_file(self, b: int) -> str:
        return storage.join(self.status_dir, f"{b:05d}.parquet")

    def pool_rows(self, b: int) -> str:
        return self.parts.at("pool_rows", f"{b:05d}.parquet")


def _set(status: pa.Array, hit: pa.Array | np.ndarray, label: str | pa.Array) -> pa.Array:
    hit = pa.array(hit) if isinstance(hit, np.ndarray) else hit
    value = label if isinstance(label, (pa.Array, pa.ChunkedArray)) else pa.scalar(label, pa.string())
    return pc.if_else(hit, value, status)


def _in(t: pa.Table, uids: pa.Table) -> pa.Array:
    if not uids.num_columns or not uids.num_rows:
        return pa.array(np.zeros(t.num_rows, bool))
    return pc.is_in(t.column(S.UID), value_set=uids.column(S.UID).combine_chunks())


def final_part_rows(job: Finish, b: int) -> pa.Table:
    """Bucket ``b``'s part rows with the image dedupe and curation applied."""
    p = job.parts
    t = read_bucket([p.by_uid(g) for g in range(p.n_groups)], b, p.store)
    if not t.num_columns:
        return pa.table({c: pa.array([], pa.string()) for c in STATUS_COLUMNS}).append_column(
            PART, pa.array([], pa.int64())
        )
    ok = pc.fill_null(pc.equal(t.column(S.STATUS), S.STATUS_SUCCESS), False)
    status = t.column(S.STATUS).combine_chunks().cast(pa.string())
    exact = read_bucket([p.exact(e) for e in range(p.n_sha)], b, p.store)
    status = _set(status, pc.and_(ok, _in(t, exact)), S.STATUS_DUPLICATE_IMAGE)
    if p.near:
        near = read_bucket([p.near_dups()], b, p.store)
        ok = pc.equal(status, S.STATUS_SUCCESS)
        status = _set(status, pc.and_(ok, _in(t, near)), S.STATUS_NEAR_DUPLICATE)
    dup_of = pa.nulls(t.num_rows, pa.string())
    leak_of = pa.nulls(t.num_rows, pa.string())
    if job.curated:
        rel = read_bucket([p.curated()], b, p.store)
        if rel.num_columns and rel.num_rows:
            at = pc.index_in(t.column(S.UID), value_set=rel.column(S.UID).combine_chunks())
            hit = at.is_valid()
            status = _set(status, hit, rel.column(S.STATUS).combine_chunks().take(at))
            dup_of = rel.column(S.DUPLICATE_OF).combine_chunks().take(at)
            leak_of = rel.column(S.LEAK_OF).combine_chunks().take(at)
    t = t.set_column(t.column_names.index(S.STATUS), S.STATUS, status)
    return t.append_column(S.DUPLICATE_OF, dup_of).append_column(S.LEAK_OF, leak_of)


def statuses(job: Finish, b: int) -> dict:
    """The status stage for uid bucket ``b`` (module docstring); → counts per status and the pieces of the
    status digest (pipeline/filters/rerun_cache.py)."""
    from pipeline.filters.rerun_cache import status_words

    p = job.parts
    rows = p.store.read_parquet(p.pool.rows(b))
    if rows.num_rows:
        url = read_bucket([p.pool.url_dups(c, "uid") for c in range(p.pool.n_url)], b, p.store)
        if url.num_columns and url.num_rows:
            key = lambda t: pc.add(pc.multiply(t.column(FILE).cast(pa.int64()), 1 << 40), t.column(ROW))  # noqa: E731
            hit = pc.is_in(key(rows), value_set=key(url).combine_chunks())
            rows = rows.set_column(
                rows.column_names.index(PRE), PRE, _set(rows.column(PRE), hit, S.STATUS_DUPLICATE_URL)
            )
        p.store.write_parquet(rows, job.pool_rows(b))
        decided = rows.filter(pc.not_equal(rows.column(PRE), ""))
        pre = pa.table({S.UID: decided.column(S.UID), S.STATUS: decided.column(PRE),
                        "error": pa.array([""] * decided.num_rows, pa.string())})  # fmt: skip
    else:
        p.store.write_parquet(rows, job.pool_rows(b))
        pre = pa.table({S.UID: pa.array([], pa.string()), S.STATUS: pa.array([], pa.string()),
                        "error": pa.array([], pa.string())})  # fmt: skip
    parts = final_part_rows(job, b)
    errors = parts.column("error") if "error" in parts.column_names else pa.nulls(parts.num_rows, pa.string())
    parts = parts.set_column(
        parts.column_names.index("error"), "error", pc.fill_null(errors.cast(pa.string()), "")
    )
    table = pa.concat_tables([pre, parts.select([c for c in STATUS_COLUMNS if c in parts.column_names])],
                             promote_options="permissive")  # fmt: skip
    table = table.sort_by(S.UID) if table.num_rows else table
    p.store.write_parquet(table, job.status_file(b))
    ok = parts.filter(pc.equal(parts.column(S.STATUS), S.STATUS_SUCCESS)).select([S.UID, PART])
    group = (ok.column(PART).to_numpy() // p.group_parts) if ok.num_rows else np.zeros(0, np.int64)
    write_buckets(ok, group, p.survivors(b), p.store)
    counts = pc.value_counts(table.column(S.STATUS)).to_pylist() if table.num_rows else []
    n, total, xor = status_words(table)
    return {"status": {c["values"]: c["counts"] for c in counts}, "words": [n, str(total), str(xor)]}


def group_survivors(job: Finish, g: int) -> dict:
    """Group ``g``'s successes by part and uid (the final shards' order); → each part's count."""
    p = job.parts
    t = read_bucket([p.survivors(b) for b in range(p.pool.n_buckets)], g, p.store)
    if not t.num_columns:
        t = pa.table({S.UID: pa.array([], pa.string()), PART: pa.array([], pa.int64())})
    t = t.sort_by([(PART, "ascending"), (S.UID, "ascending")]) if t.num_rows else t
    p.store.write_parquet(t, p.group_survivors(g))
    parts, counts = np.unique(t.column(PART).to_numpy(), return_counts=True) if t.num_rows else ([], [])
    return {"parts": {str(int(a)): int(c) for a, c in zip(parts, counts, strict=True)}}


@dataclass(frozen=True)
class Curation:
    """The curation stage's inputs: the statuses' layout and the build's config and metadata files."""

    finish: Finish
    cfg: object  # the BuildConfig
    files: tuple[str, ...]


def curation_rows(job: Curation, b: int) -> pa.Table:
    """Bucket ``b``'s part rows after the image dedupe as the curation stage reads them: ``uid``, ``status``,
    ``phash`` and the keep-first score (the metadata's CLIP L/14 score, NaN when there is none)."""
    from pipeline.dedup.curation_rules import PRIORITY

    p = job.finish.parts
    t = final_part_rows(Finish(p, job.finish.status_dir, curated=False), b)
    phash = t.column(S.PHASH) if S.PHASH in t.column_names else pa.nulls(t.num_rows, pa.int64())
    score = pa.nulls(t.num_rows, pa.float64())
    if job.cfg.dedupe.semantic and t.num_rows:
        pool = p.store.read_parquet(p.pool.rows(b))
        if S.CLIP_L14 in pool.column_names:
            at = pc.index_in(t.column(S.UID), value_set=pool.column(S.UID).combine_chunks())
            score = pool.column(S.CLIP_L14).combine_chunks().cast(pa.float64()).take(at)
    return pa.table({S.UID: t.column(S.UID), S.STATUS: t.column(S.STATUS), S.PHASH: phash, PRIORITY: score})


def curate_parts(job: Curation, _key: int = 0) -> dict:
    """Eval-set decontamination and semantic dedup (``dedup.curation_stage.curate_buckets``): candidates
    from the embeddings files, facts from one task per uid bucket, in this one planning task, which holds
    the candidates and no column of the pool (docs/decisions/0102); its relabels bucketed by uid;
    → its counts."""
    from functools import partial

    from pipeline.dedup import curation_stage as CS

    p, cfg = job.finish.parts, job.cfg
    rows = partial(curation_rows, job)
    out, cand = CS.curate_buckets(cfg, job.files, p.pool.n_buckets, rows, p.store, print, p.at("curation"))
    rel = out.relabels
    write_buckets(rel, uid_buckets(rel.column(S.UID), p.pool.n_buckets), p.curated(), p.store)
    return {
        "eval_leaks": out.leaks_by_task,
        "semantic_duplicates": out.n_semantic,
        "clusters": cand.n_clusters,
    }
