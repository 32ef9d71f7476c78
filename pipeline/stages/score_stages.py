"""The streamed embedding filters of the build: scored per embeddings file, decided per uid bucket.

A row's ``norm_sim`` score and ``image_based`` nearest centroid need only its own vector, so one task per
embeddings file reads that file a block of rows at a time (``embedding.iter_embedding_blocks``: a block's
vectors in memory, never the file's or the pool's) and writes each row's value bucketed by uid; each uid
bucket then reads its rows' values (``with_scores``; the first file holding a uid gives its value, as the
whole-pool filters' concatenation did). ``image_based`` then decides per row (``image_result``).
``norm_sim`` (Wang et al. 2024) keeps the ``round(f·N)`` rows of largest NormSim among the ``N`` pool
rows with an embedding, ties by uid (``filters.embedding.top_fraction``). A row's score needs only its
own vector and the targets, so one task per embeddings file scores that file's rows (``embedding_scores``:
by uid bucket), and the cut is found by ``filter_stages``' radix selection over the buckets
and applied per bucket (``score_cut``). ``neg_clip_loss`` is cut the same way, but a row's score needs
the other rows of its random batches: each embeddings file's task writes the (image, text) vectors by
uid range instead (``group_vectors``; one file per ``RANGES_PER_FILE`` ranges), and one task per range scores the pool's rows in it
(``score_group``) with the batches one process would draw (``embedding.neg_clip_batches``; decision 0098).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.filters import base
from pipeline.filters.base import float_column
from pipeline.filters.registry import FilterError
from pipeline.filters.specs import resolve_params
from pipeline.source.row_checks import valid_uids
from pipeline.stages.buckets import BucketWriter, read_bucket, uid_buckets, write_buckets

STREAMED = ("norm_sim", "image_based", "neg_clip_loss")  # read per embeddings file
RANKED = ("norm_sim", "neg_clip_loss")  # of those, the ones cut at a rank over the buckets
GROUPED = ("neg_clip_loss",)  # of those, the ones whose batches span a uid range: scored per range
_VECTOR_BYTES = 64 << 20  # vectors a grouping task buffers before writing them out
RANGES_PER_FILE = 64  # uid ranges a vectors file holds: a range task reads one file of each source (0098)
_SOURCES = 1_000_000  # a scoring task's key: streamed filter · _SOURCES + embeddings file


def cut_key(name: str, params: dict) -> str:
    """The name of a filter with its parameters: one cut, one score column per distinct key."""
    return f"{name}:{sorted(params.items())}"


def score_column(key: str) -> str:
    return f"score {key}"


def descending_keys(score: np.ndarray) -> np.ndarray:
    """uint64 keys whose ascending order is ``score``'s descending order (NaN as 0: the caller masks)."""
    bits = np.where(np.isnan(score), 0.0, -score).view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


def streamed(job: Any) -> list[tuple[str, str, dict]]:
    """(key, filter, parameters) of each distinct ``STREAMED`` filter of the specs, in a fixed order."""
    found = {}
    for spec in job.specs:
        for name, given in spec.parts:
            if name in STREAMED:
                params = resolve_params(name, given)
                found[cut_key(name, params)] = (name, params)
    return [(k, *found[k]) for k in sorted(found)]


def _sources(job: Any, name: str, params: dict) -> list[str]:
    """The embeddings files a streamed filter reads (``registry._pool_embeddings``' order)."""
    given = params["embeddings_file"]
    return [given] if given or name == "image_based" else list(job.metadata)


_NEEDS = {
    "norm_sim": ("target_file",),
    "image_based": ("embeddings_file", "centroids_file", "centroid_ids_file"),
    "neg_clip_loss": (),
}


def score_tasks(job: Any) -> list[int]:
    """One scoring task per (streamed filter, embeddings file); a missing setting stops the build here."""
    for _, name, params in streamed(job):
        if not _sources(job, name, params):
            raise FilterError(
                f"filter {name!r} needs embeddings_file= (no metadata files to find them beside)"
            )
        for key in _NEEDS[name]:
            if not params[key]:
                raise FilterError(f"filter {name!r} needs {key}=")
    keys = enumerate(streamed(job))
    return [q * _SOURCES + s for q, (_, n, p) in keys for s in range(len(_sources(job, n, p)))]


def _scorer(name: str, params: dict, store: Any) -> tuple[str, Any]:
    """The embeddings key a streamed filter reads, and its value per row of a block of vectors."""
    from pipeline.filters import embedding as E

    if name == "norm_sim":
        targets = E.load_targets(params["target_file"], store, params["target_key"])
        return params["image_key"], lambda v: E.norm_sim_scores(v, targets, params["p"])
    centroids = E.load_centroids(params["centroids_file"], store)
    E.load_centroid_ids(params["centroid_ids_file"], store)  # a bad file stops the stage, not the buckets
    return "embedding", lambda v: E.nearest_centroid(v, centroids).astype(np.float64)


def embedding_scores(job: Any, key: int) -> dict:
    """One embeddings file's rows valued by one streamed filter, a block at a time, written bucketed by
    uid with the file's position."""
    from pipeline.filters import embedding as E

    q, s = divmod(key, _SOURCES)
    _, name, params = streamed(job)[q]
    store, n_buckets = job.finish.parts.store, job.finish.parts.pool.n_buckets
    if name in GROUPED:
        groups = E.neg_clip_groups(job.n_rows, params["batch_size"])
        keys = (params["image_key"], params["text_key"])
        out = functools.partial(job.vectors_file, q, s)
        return group_vectors(_sources(job, name, params)[s], s, keys, groups, out, store)
    out = BucketWriter(job.scores_file(q, s), store)
    rows = 0
    try:
        emb_key, value = _scorer(name, params, store)
        for uids, arrays in E.iter_embedding_blocks(_sources(job, name, params)[s], (emb_key,), store):
            t = pa.table({S.UID: pa.array(uids, pa.string()), "source": pa.array(np.full(len(uids), s, np.int64)),
                          "score": pa.array(value(arrays[emb_key]), pa.float64())})  # fmt: skip
            out.add(t, uid_buckets(t.column(S.UID), n_buckets))
            rows += len(uids)
    except (FileNotFoundError, ValueError) as exc:
        raise FilterError(f"filter {name!r}: {exc}") from exc
    out.close(pa.schema([(S.UID, pa.string()), ("source", pa.int64()), ("score", pa.float64())]))
    return {"rows": rows}


# --- negCLIPLoss: vectors grouped by uid range, scored per range (decision 0098) ------------------------


def overlapping(i: int, n: int, m: int) -> range:
    """The ranges, of ``m`` equal ranges of the uid's high 64 bits, that range ``i`` of ``n`` overlaps."""
    step_n, step_m = -(-(1 << 64) // n), -(-(1 << 64) // m)
    return range(i * step_n // step_m, min(m - 1, ((i + 1) * step_n - 1) // step_m) + 1)


def _fixed(vectors: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel(), pa.float32()), vectors.shape[1])


def _matrix(column: pa.ChunkedArray, n: int) -> np.ndarray:
    return pc.list_flatten(column.combine_chunks()).to_numpy(zero_copy_only=False).reshape(n, -1)


def group_vectors(path: str, s: int, keys: tuple[str, str], groups: int, out: Any, store: Any) -> dict:
    """One embeddings file's (image, text) vectors, a block at a time, written bucketed by uid range
    (``embedding.neg_clip_group_of``) with the file's position, into one file per ``RANGES_PER_FILE``
    ranges (``out(block)``: a range task reads footers that do not grow with the pool); rows without a
    valid uid are left out."""
    from pipeline.filters import embedding as E

    blocks = -(-groups // RANGES_PER_FILE)
    writers: dict[int, BucketWriter] = {}
    rows = 0
    try:
        for uids, arrays in E.iter_embedding_blocks(path, keys, store):
            ok = valid_uids(pa.array(uids, pa.string()))
            uids = [u for u, v in zip(uids, ok, strict=True) if v]
            image, text = arrays[keys[0]][ok], arrays[keys[1]][ok]
            row_bytes = 4 * (image.shape[1] + text.shape[1]) + 64
            flush = max(1024, _VECTOR_BYTES // row_bytes // blocks)  # all writers: _VECTOR_BYTES
            t = pa.table({S.UID: pa.array(uids, pa.string()), "source": pa.array(np.full(len(uids), s, np.int64)),
                          "image": _fixed(image), "text": _fixed(text)})  # fmt: skip
            group = E.neg_clip_group_of(S.uids_to_u8pairs(uids), groups)
            for blk in np.unique(group // RANGES_PER_FILE).tolist():
                at = np.flatnonzero(group // RANGES_PER_FILE == blk)
                if blk not in writers:
                    writers[blk] = BucketWriter(out(blk), store, flush_rows=flush)
                writers[blk].add(t.take(pa.array(at)), group[at])
            rows += len(uids)
    except (FileNotFoundError, ValueError) as exc:
        raise FilterError(f"filter 'neg_clip_loss': {exc}") from exc
    schema = pa.schema([(S.UID, pa.string()), ("source", pa.int64())])
    for blk in range(blocks):  # every block's file exists, if empty
        (writers.get(blk) or BucketWriter(out(blk), store)).close(schema)
    return {"rows": rows}


def group_tasks(job: Any) -> list[int]:
    """One scoring task per (grouped filter, uid range)."""
    from pipeline.filters import embedding as E

    return [q * _SOURCES + g for q, (_, name, params) in enumerate(streamed(job)) if name in GROUPED
            for g in range(E.neg_clip_groups(job.n_rows, params["batch_size"]))]  # fmt: skip


def group_scores(job: Any, key: int) -> dict:
    """negCLIPLoss of the pool's rows in one uid range (``score_group``)."""
    from pipeline.filters import embedding as E

    q, g = divmod(key, _SOURCES)
    _, name, params = streamed(job)[q]
    p = job.finish.parts
    groups = E.neg_clip_groups(job.n_rows, params["batch_size"])
    vectors = [job.vectors_file(q, s, g // RANGES_PER_FILE) for s in range(len(_sources(job, name, params)))]
    pool = [job.finish.pool_rows(b) for b in overlapping(g, groups, p.pool.n_buckets)]
    return score_group(vectors, pool, g, groups, params, job.group_file(q, g), p.store, p.pool.n_buckets)


def score_group(
    vectors: list[str], pool: list[str], g: int, groups: int, params: dict, out_path: str, store: Any,
    n_buckets: int,
) -> dict:  # fmt: skip
    """Range ``g``'s vectors (the first file holding a uid gives them), of the uids the pool lists
    (``pool``: the pool-row files of the uid buckets the range overlaps), scored with the batches one
    process holding the pool draws (``embedding.neg_clip_loss_scores``); written bucketed by uid."""
    from pipeline.filters import embedding as E

    t = read_bucket(vectors, g, store)
    if t.num_rows:
        t = t.sort_by([("source", "ascending")])
        first = pc.index_in(pc.unique(t.column(S.UID)), value_set=t.column(S.UID).combine_chunks())
        t = t.take(first)
        listed = store.read_parquet(pool, columns=[S.UID]).column(S.UID).combine_chunks()
        t = t.filter(pc.is_in(t.column(S.UID), value_set=listed.cast(pa.string())))
    n = t.num_rows if t.num_columns else 0
    score = np.zeros(0)
    if n:
        uids = t.column(S.UID).to_pylist()
        score = E.neg_clip_loss_scores(
            _matrix(t.column("image"), n), _matrix(t.column("text"), n), S.uids_to_u8pairs(uids),
            tau=params["temperature"], batch_size=params["batch_size"], batches=params["batches"],
            seed=params["seed"], groups=groups,
        )  # fmt: skip
    out = pa.table({S.UID: t.column(S.UID) if n else pa.array([], pa.string()),
                    "source": pa.array(np.zeros(n, np.int64)), "score": pa.array(score, pa.float64())})  # fmt: skip
    write_buckets(out, uid_buckets(out.column(S.UID), n_buckets), out_path, store)
    return {"rows": n}


def with_scores(job: Any, table: pa.Table, b: int) -> pa.Table:
    """Bucket ``b``'s rows with a score column per streamed filter (null: no embedding)."""
    from pipeline.filters import embedding as E

    store = job.finish.parts.store
    for q, (key, name, params) in enumerate(streamed(job)):
        if name in GROUPED:
            groups = E.neg_clip_groups(job.n_rows, params["batch_size"])
            files = [job.group_file(q, g) for g in overlapping(b, job.finish.parts.pool.n_buckets, groups)]
        else:
            files = [job.scores_file(q, s) for s in range(len(_sources(job, name, params)))]
        sc = read_bucket(files, b, store)
        if not sc.num_rows:
            table = table.append_column(score_column(key), pa.nulls(table.num_rows, pa.float64()))
            continue
        sc = sc.sort_by([("source", "ascending")])  # index_in finds the first
        at = pc.index_in(table.column(S.UID), value_set=sc.column(S.UID).combine_chunks())
        table = table.append_column(score_column(key), sc.column("score").combine_chunks().take(at))
    return table


def score_cut(table: pa.Table, name: str, params: dict, cut: Any) -> base.FilterResult:
    """A streamed filter's rows above ``cut`` (a ``filter_stages.Cut``) kept, those below
    ``<name>_not_in_top_<f>%``, those without an embedding ``missing_embedding``."""
    score = float_column(table, score_column(cut_key(name, params)), name)
    present = ~np.isnan(score)
    chosen = np.zeros(table.num_rows, bool)
    if not cut.none:
        key = descending_keys(score)
        tie = pc.is_in(table.column(S.UID), value_set=pa.array(list(cut.ties), pa.string()))
        chosen = (key < np.uint64(cut.value)) | (
            (key == np.uint64(cut.value)) & tie.to_numpy(zero_copy_only=False)
        )
    reason = np.full(table.num_rows, "", dtype=object)
    reason[~present] = "missing_embedding"
    reason[present & ~chosen] = f"{name}_not_in_top_{100 * params['fraction']:g}%"
    return base.FilterResult(reason == "", reason)


def image_result(table: pa.Table, params: dict, lang: Any, store: Any) -> base.FilterResult:
    """DataComp's ``image_based`` over a bucket's rows from their nearest centroids (``datacomp.image_based``:
    the caption rule, and the nearest centroid among the targets)."""
    from pipeline.filters import datacomp as F
    from pipeline.filters import embedding as E

    nearest = float_column(table, score_column(cut_key("image_based", params)), "image_based")
    present = ~np.isnan(nearest)
    target = E.load_centroid_ids(params["centroid_ids_file"], store)
    inside = present & np.isin(nearest, np.asarray(target, np.float64))
    member = base.from_drops(table.num_rows, [(~present, "missing_embedding"), (~inside, "not_in_centroid")])
    return base.intersect(F.image_caption(table, lang), member)


def result(table: pa.Table, name: str, params: dict, cut: Any, ctx: Any) -> base.FilterResult:
    """A streamed filter's result over a bucket's rows (``ctx``: the bucket's ``registry.Context``)."""
    if name in RANKED:
        return score_cut(table, name, params, cut)
    return image_result(table, params, ctx.lang, ctx.store)
