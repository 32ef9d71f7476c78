"""The streamed embedding filters of the build: scored per embeddings file, cut over the uid buckets.

``norm_sim`` (Wang et al. 2024) keeps the ``round(f·N)`` rows of largest NormSim among the ``N`` pool
rows with an embedding, ties by uid (``filters.embedding.top_fraction``). A row's score needs only its
own vector and the targets, so one task per embeddings file scores that file's rows (``embedding_scores``:
one file's vectors in memory, never the pool's) and writes them bucketed by uid; each uid bucket then
reads its rows' scores (``with_scores``; the first file holding a uid gives its score, as the whole-pool
filter's concatenation did), and the cut is found by ``filter_stages``' radix selection over the buckets
and applied per bucket (``score_cut``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.filters import base
from pipeline.filters.base import float_column
from pipeline.filters.registry import FilterError, config_params
from pipeline.filters.specs import resolve_params
from pipeline.stages.buckets import read_bucket, uid_buckets, write_buckets

STREAMED = ("norm_sim",)  # scored per embeddings file, cut over the buckets
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
                params = resolve_params(name, given, config_params(job.filters))
                found[cut_key(name, params)] = (name, params)
    return [(k, *found[k]) for k in sorted(found)]


def _sources(job: Any, params: dict) -> list[str]:
    """The embeddings files a streamed filter reads (``registry._pool_embeddings``' order)."""
    return [params["embeddings_file"]] if params["embeddings_file"] else list(job.metadata)


def score_tasks(job: Any) -> list[int]:
    """One scoring task per (streamed filter, embeddings file); a missing setting stops the build here."""
    for _, name, params in streamed(job):
        if not _sources(job, params):
            raise FilterError(
                f"filter {name!r} needs embeddings_file= (no metadata files to find them beside)"
            )
        if not params["target_file"]:
            raise FilterError(f"filter {name!r} needs target_file=")
    keys = enumerate(streamed(job))
    return [q * _SOURCES + s for q, (_, _, p) in keys for s in range(len(_sources(job, p)))]


def embedding_scores(job: Any, key: int) -> dict:
    """One embeddings file's rows scored by one streamed filter (``embedding.norm_sim_scores``), written
    bucketed by uid with the file's position."""
    from pipeline.filters import embedding as E

    q, s = divmod(key, _SOURCES)
    _, name, params = streamed(job)[q]
    store = job.finish.parts.store
    try:
        targets = E.load_targets(params["target_file"], store, params["target_key"])
        uids, arrays = E.load_embedding_set(_sources(job, params)[s], (params["image_key"],), store)
    except (FileNotFoundError, ValueError) as exc:
        raise FilterError(f"filter {name!r}: {exc}") from exc
    score = E.norm_sim_scores(arrays[params["image_key"]], targets, params["p"])
    t = pa.table({S.UID: pa.array(uids, pa.string()), "source": pa.array(np.full(len(uids), s, np.int64)),
                  "score": pa.array(score, pa.float64())})  # fmt: skip
    n_buckets = job.finish.parts.pool.n_buckets
    write_buckets(t, uid_buckets(t.column(S.UID), n_buckets), job.scores_file(q, s), store)
    return {"rows": len(uids)}


def with_scores(job: Any, table: pa.Table, b: int) -> pa.Table:
    """Bucket ``b``'s rows with a score column per streamed filter (null: no embedding)."""
    store = job.finish.parts.store
    for q, (key, _, params) in enumerate(streamed(job)):
        sc = read_bucket([job.scores_file(q, s) for s in range(len(_sources(job, params)))], b, store)
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
