"""The build's curation stage on Ray: eval-set decontamination, then semantic dedup, over the downloaded rows.

``curate`` runs after the exact and pHash near-duplicate dedupe (``pipeline/source/status_table.py``) on the
rows still ``success``, and relabels some of them, so every input row keeps exactly one status:

1. **decontamination** (``build.decontam``): a row that is a near-copy of an evaluation picture, by pHash
   or by embedding (``pipeline.dedup.eval_leaks.eval_leaks``), becomes ``eval_leak:<task>``;
2. **semantic dedup** (``build.dedupe.semantic``): SemDeDup over the remaining rows' image embeddings;
   a duplicate becomes ``semantic_duplicate`` and names the uid it duplicates in ``duplicate_of``.

The image embeddings are DataComp's precomputed ones (``l14_img`` in the ``.npz`` beside each metadata
parquet) or any uid-keyed file (``dedupe.embeddings``, e.g. ``jobs.embed``'s output of our scorer), read in
place, a block at a time, by tasks over every row of each file (``semantic_files``; docs/decisions/0097
and 0102): the embedding half of decontamination here, SemDeDup's candidate pairs in ``semantic_stage``.
These candidates (the named uids, pairs and leaks) are then checked per uid bucket by one task each
(``bucket_facts``: which named uids are rows the build still holds as ``success``, their keep-first score,
and the bucket's pHash leaks), and ``decide`` runs the greedy rule over the pairs whose two ends remain
(docs/decisions/0087).
No process holds a column of the pool: the stage holds the candidates, the centroids and per-bucket facts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.process_memory import release_free_memory
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig
from pipeline.dedup import curation_rules as CR
from pipeline.dedup import eval_leaks as EL
from pipeline.dedup import semantic_files as SF
from pipeline.dedup.semantic_stage import ray_task, semantic_pairs, since
from pipeline.stages.buckets import uid_buckets


@dataclass
class CurationResult:
    status: pa.Array  # per part row, relabelled
    duplicate_of: pa.Array  # per part row: the uid a semantic duplicate duplicates, else null
    leak_of: pa.Array  # per part row: "<task>/<key>" of the eval picture a leak copies, else null
    leaks_by_task: dict[str, int] = field(default_factory=dict)
    n_semantic: int = 0
    n_clusters: int = 0


def reference_path(cfg: BuildConfig) -> str:
    """``decontam.reference``, with "demo" meaning the demo pool's (generated under ``<output>/pool``)."""
    ref = cfg.decontam.reference
    return storage.join(cfg.output, "pool", "eval", "reference.parquet") if ref == "demo" else ref


def load_reference(path: str, store: Storage) -> EL.EvalReference:
    """An eval reference parquet: ``task``, ``key``, ``phash`` (int64) and, optionally, ``embedding``."""
    try:
        t = store.read_parquet(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"decontam.reference: no such file {path}") from None
    missing = [c for c in ("task", "key", "phash") if c not in t.column_names]
    if missing:
        raise ValueError(f"decontam.reference: {path} lacks column {missing[0]!r}")
    vectors = None
    if "embedding" in t.column_names and t.num_rows:
        flat = pc.list_flatten(t.column("embedding").combine_chunks()).to_numpy(zero_copy_only=False)
        vectors = flat.astype(np.float32).reshape(t.num_rows, -1)
    return EL.EvalReference(
        np.asarray(t.column("task").to_pylist(), dtype=object),
        np.asarray(t.column("key").to_pylist(), dtype=object),
        t.column("phash").to_numpy().astype(np.int64),
        vectors,
    )


def _embedding_sources(cfg: BuildConfig, metadata_files: Sequence[str], store: Storage) -> list[str]:
    """The files to read one at a time: the metadata shards, or ``dedupe.embeddings`` (a directory: its
    parquet files), so the driver never holds more than one file's vectors in float32."""
    src = cfg.dedupe.embeddings
    if not src:
        return list(metadata_files)
    if src.endswith((".npz", ".npy", ".parquet")):
        return [src]
    return store.list_files(src, suffix=".parquet") or [src]


def check_curation(cfg: BuildConfig, metadata_files: Sequence[str], store: Storage) -> None:
    """Before any download: the files the curation stage will read exist (one line naming the setting)."""
    if cfg.decontam.reference and not store.exists(reference_path(cfg)):
        raise FileNotFoundError(f"decontam.reference: no such file {reference_path(cfg)}")
    by_embedding = bool(cfg.decontam.reference) and _reference_has_embeddings(cfg, store)
    if not (cfg.dedupe.semantic or by_embedding):
        return
    for src in _embedding_sources(cfg, metadata_files, store):
        beside = src.endswith(".parquet") and not cfg.dedupe.embeddings  # DataComp's .npz beside its shard
        path = src[: -len(".parquet")] + ".npz" if beside else src
        if not store.exists(path):
            setting = "dedupe.semantic" if cfg.dedupe.semantic else "decontam.reference"
            raise FileNotFoundError(
                f"{setting}: no image embeddings at {path} (set dedupe.embeddings to a uid-keyed file"
                + ("" if cfg.dedupe.semantic else ", or use a reference without an embedding column")
                + ")"
            )


def _reference_has_embeddings(cfg: BuildConfig, store: Storage) -> bool:
    import pyarrow.parquet as pq

    fs, path = store.resolve(reference_path(cfg))
    with fs.open_input_file(path) as fh:
        return "embedding" in pq.ParquetFile(fh).schema_arrow.names


def clip_priority(table: pa.Table) -> Callable[[np.ndarray], np.ndarray | None]:
    """Keep-first scores for ``curate``: the metadata's CLIP L/14 score of each uid (DataComp's; the best
    captioned copy of a semantic group stays), or None (uid order) when the pool has none."""
    if S.CLIP_L14 not in table.column_names or table.column(S.CLIP_L14).null_count == table.num_rows:
        return lambda uids: None
    known = table.column(S.UID).combine_chunks()
    scores = table.column(S.CLIP_L14).combine_chunks().cast(pa.float64())

    def lookup(uids: np.ndarray) -> np.ndarray:
        at = pc.index_in(pa.array(uids.tolist(), pa.string()), value_set=known)
        return pc.fill_null(scores.take(at), np.nan).to_numpy(zero_copy_only=False)

    return lookup


def leaked_rows(table: pa.Table, status_table: pa.Table) -> np.ndarray:
    """Rows of ``table`` whose uid ended as an eval leak: no build subset lists them, in either scope
    (DataComp's pool had its eval near-duplicates removed before anything was listed)."""
    status = status_table.column(S.STATUS)
    leak = pc.starts_with(status, S.EVAL_LEAK + ":")
    uids = pc.filter(status_table.column(S.UID), leak)
    return pc.is_in(table.column(S.UID), value_set=uids.combine_chunks()).to_numpy(zero_copy_only=False)


def find_candidates(
    cfg: BuildConfig,
    sources: Sequence[str],
    ref: EL.EvalReference | None,
    store: Storage,
    scratch: str | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> CR.Candidates:
    """Tasks over every row of the embeddings files: the embedding leaks (when the reference has vectors)
    and the semantic pairs (``dedupe.semantic``) as uids."""
    import ray

    t0 = time.perf_counter()
    cand = CR.Candidates()
    if not sources:
        return cand
    key = cfg.dedupe.embedding_key
    leaks = []
    if ref is not None and ref.vectors is not None and len(ref.task):
        leak_task = ray_task(SF.leak_file)
        ref_ref = ray.put(ref)
        leaks = [leak_task.remote(s, key, ref_ref, cfg.decontam.embedding_threshold, store) for s in sources]
    if cfg.dedupe.semantic:
        (cand.pair_names, cand.pair_i, cand.pair_j, cand.pair_s), cand.n_clusters, cand.n_rows = (
            semantic_pairs(sources, key, cfg.dedupe, store, scratch, log)
        )
    if leaks:
        found = ray.get(leaks)  # in file order: a uid two files hold takes the later file's answer
        cand.leak_uid = pa.concat_arrays([f[0] for f in found])
        cand.leak_task = np.concatenate([f[1] for f in found])
        cand.leak_key = np.concatenate([f[2] for f in found])
        log(f"curation: {len(cand.leak_uid)} rows copy an eval picture by embedding ({since(t0)})")
    return cand


def curate_buckets(
    cfg: BuildConfig,
    metadata_files: Sequence[str],
    n_buckets: int,
    bucket_rows: Callable[[int], pa.Table],
    store: Storage,
    log: Callable[[str], None],
    scratch: str | None = None,
) -> tuple[CR.Decisions, CR.Candidates]:
    """The stage over a pool held in ``n_buckets`` uid buckets: candidates from the files, then one task per
    bucket (``bucket_rows(b)``: its ``uid``, ``status``, ``phash`` and ``priority``, read in the task) for
    its facts, then the rule. → the decisions (relabels only) and the candidates' counts."""
    import ray

    want_semantic, want_leaks = cfg.dedupe.semantic, bool(cfg.decontam.reference)
    if not (want_semantic or want_leaks):
        return CR.decide(CR.Candidates(), [], False), CR.Candidates()
    ref = load_reference(reference_path(cfg), store) if want_leaks else None
    sources: list[str] = []
    if want_semantic or (ref is not None and ref.vectors is not None):
        sources = _embedding_sources(cfg, metadata_files, store)
    cand = find_candidates(cfg, sources, ref, store, scratch, log)
    t0 = time.perf_counter()
    named, pair_at = cand.index()
    release_free_memory()  # the sort's garbage (~150 B a named uid), not under the buckets' peak
    at = uid_buckets(named, n_buckets)
    by_bucket = np.argsort(at, kind="stable")
    edges = np.searchsorted(at[by_bucket], np.arange(n_buckets + 1))
    facts_task = ray_task(_bucket_facts)
    # the buckets match by pHash only: their reference carries no vectors (700k × 768 float32 is 2 GB)
    ref_ref = ray.put(None if ref is None else EL.EvalReference(ref.task, ref.key, ref.phash))
    facts = ray.get(
        [
            facts_task.remote(
                bucket_rows,
                b,
                named.take(pa.array(by_bucket[edges[b] : edges[b + 1]])),
                ref_ref,
                cfg.decontam,
            )
            for b in range(n_buckets)
        ]
    )
    for b, f in enumerate(facts):  # positions in the bucket's named uids → in all of them
        f.live_at = by_bucket[edges[b] : edges[b + 1]][f.live_at]
    log(f"curation: {len(named)} named uids checked in {n_buckets} uid buckets ({since(t0)})")
    del at, by_bucket
    release_free_memory()  # the allocators keep freed pages: not into the rule's peak
    out = CR.decide(cand, facts, want_semantic, (named, pair_at))
    _log_counts(log, cfg, out, cand, want_leaks, want_semantic)
    return out, cand


def _bucket_facts(
    bucket_rows: Callable[[int], pa.Table], b: int, named: pa.Array, ref, decontam
) -> CR.BucketFacts:
    return CR.bucket_facts(bucket_rows(b), named, ref, decontam)


def _log_counts(
    log, cfg: BuildConfig, out: CR.Decisions, cand: CR.Candidates, leaks: bool, semantic: bool
) -> None:
    if leaks:
        n = sum(out.leaks_by_task.values())
        log(f"decontamination: {n} downloaded rows leak an eval picture {out.leaks_by_task}")
    if semantic:
        log(
            f"semantic dedup: {out.n_semantic} downloaded images duplicate another ({cand.n_rows} rows in the "
            f"embeddings files, {cand.n_clusters} clusters, cosine > {cfg.dedupe.semantic_threshold:g})"
        )


def curate(
    parts: pa.Table,
    status: pa.Array,
    cfg: BuildConfig,
    metadata_files: Sequence[str],
    priority: Callable[[np.ndarray], np.ndarray | None],
    store: Storage,
    log: Callable[[str], None],
    scratch: str | None = None,
) -> CurationResult:
    """The stage over one table of part rows (``status`` per row; ``priority(uids)``: the keep-first
    score, or None for uid order), as one bucket → the relabelled status and the uids each row copies."""
    status = status.cast(pa.string())
    uids = parts.column(S.UID).combine_chunks().cast(pa.string())
    score = priority(np.asarray(uids.to_pylist(), dtype=object)) if parts.num_rows else None
    rows = pa.table(
        {
            S.UID: uids,
            S.STATUS: status,
            S.PHASH: parts.column(S.PHASH).combine_chunks()
            if S.PHASH in parts.column_names
            else pa.nulls(len(uids), pa.int64()),
            CR.PRIORITY: pa.array(
                np.full(len(uids), np.nan) if score is None else np.asarray(score, np.float64)
            ),
        }
    )
    out, cand = curate_buckets(cfg, metadata_files, 1, _Rows(rows), store, log, scratch)
    rel = out.relabels
    at = pc.index_in(uids, value_set=rel.column(S.UID).combine_chunks()) if rel.num_rows else None
    if at is None:
        none = pa.nulls(len(uids), pa.string())
        return CurationResult(status, none, none, out.leaks_by_task, out.n_semantic, cand.n_clusters)
    hit = at.is_valid()
    return CurationResult(
        pc.if_else(hit, rel.column(S.STATUS).combine_chunks().take(at), status),
        rel.column(S.DUPLICATE_OF).combine_chunks().take(at),
        rel.column(S.LEAK_OF).combine_chunks().take(at),
        out.leaks_by_task,
        out.n_semantic,
        cand.n_clusters,
    )


@dataclass(frozen=True)
class _Rows:
    """``bucket_rows`` of a pool held as one table."""

    table: pa.Table

    def __call__(self, b: int) -> pa.Table:
        return self.table
