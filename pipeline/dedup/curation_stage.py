"""The build's curation stage on Ray: eval-set decontamination, then semantic dedup, over the downloaded rows.

``curate`` runs after the exact and pHash near-duplicate dedupe (``pipeline/source/status_table.py``) on the
rows still ``success``, and relabels some of them, so every input row keeps exactly one status:

1. **decontamination** (``build.decontam``): a row that is a near-copy of an evaluation picture, by pHash
   or by embedding (``pipeline.dedup.eval_leaks.eval_leaks``), becomes ``eval_leak:<task>``;
2. **semantic dedup** (``build.dedupe.semantic``): SemDeDup over the remaining rows' image embeddings;
   a duplicate becomes ``semantic_duplicate`` and names the uid it duplicates in ``duplicate_of``.

The image embeddings are DataComp's precomputed ones (``l14_img`` in the ``.npz`` beside each metadata
parquet) or any uid-keyed file (``dedupe.embeddings``, e.g. ``jobs.embed``'s output of our scorer), read in
place, a block at a time, by one task per file (``semantic_files``; docs/decisions/0097): the embedding
half of decontamination; a count and the k-means sample, drawn by uid hash (at most ``_FIT_ROWS`` rows),
that one task fits k-means and the guests' screen basis on; then the assignment of each row to its nearest
cluster and as a guest to the clusters whose border it is near (``semantic.assign_with_guests``), written
to bucket files by cluster group (``_GROUP_ROWS`` rows as k-means is asked for them), on ``scratch``.
One task per group reads its bucket and returns the pairs above the threshold (guests screened in the
basis: docs/decisions/0096); the greedy rule runs over their union (docs/decisions/0087). Ray schedules
every task; the stage holds the uids, the centroids and the pairs, never a vector of the pool.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig, DedupeConfig
from pipeline.dedup import eval_leaks as EL
from pipeline.dedup import semantic as SD
from pipeline.dedup import semantic_files as SF

_GROUP_ROWS = 50_000  # rows of one task's clusters, as k-means is asked for them
_FIT_ROWS = 1 << 21  # k-means and the screen's basis see at most this many rows (a sampled fit)


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
    """Relabel the ``success`` rows of ``parts`` (module docstring). ``priority(uids)``: the score that
    decides which copy of a semantic group stays (larger first), or None for uid order. ``scratch``: a
    directory every host reaches for the clusters' bucket files (a local temporary one when None)."""
    status = status.cast(pa.string())
    dup_of = np.full(len(status), None, dtype=object)
    leak_of = np.full(len(status), None, dtype=object)
    result = CurationResult(
        status, pa.array(dup_of.tolist(), pa.string()), pa.array(leak_of.tolist(), pa.string())
    )
    want_semantic, want_leaks = cfg.dedupe.semantic, bool(cfg.decontam.reference)
    if not (want_semantic or want_leaks) or parts.num_rows == 0:
        return result
    ok = np.flatnonzero(
        pc.fill_null(pc.equal(status, S.STATUS_SUCCESS), False).to_numpy(zero_copy_only=False)
    )
    taken = pa.array(ok, pa.int64())
    uids = np.asarray(parts.column(S.UID).combine_chunks().take(taken).to_pylist(), dtype=object)
    labels = np.asarray(status.to_pylist(), dtype=object)
    ref = load_reference(reference_path(cfg), store) if want_leaks else None
    sources: list[str] = []
    if want_semantic or (ref is not None and ref.vectors is not None):
        sources = _embedding_sources(cfg, metadata_files, store)
    alive = np.ones(len(ok), dtype=bool)
    if want_leaks:
        phash = parts.column(S.PHASH).combine_chunks().take(taken)
        task, key = _leaks(cfg, ref, phash, uids.astype(str), sources, store)
        leaked = task != ""
        labels[ok[leaked]] = [S.eval_leak(t) for t in task[leaked]]
        leak_of[ok[leaked]] = [f"{t}/{k}" for t, k in zip(task[leaked], key[leaked], strict=True)]
        alive &= ~leaked
        tasks, counts = np.unique(task[leaked].astype(str), return_counts=True)
        result.leaks_by_task = {str(t): int(c) for t, c in zip(tasks, counts, strict=True)}
        log(
            f"decontamination: {int(leaked.sum())} of {len(ok)} downloaded rows leak an eval picture {result.leaks_by_task}"
        )
    if want_semantic:
        rows = np.flatnonzero(alive)
        found = uids[rows].astype(str)
        target, n_clusters, n = semantic_stage(
            sources, cfg.dedupe.embedding_key, found, priority(found), cfg.dedupe, store, scratch
        )
        hit = target >= 0
        labels[ok[rows[hit]]] = S.STATUS_SEMANTIC_DUPLICATE
        dup_of[ok[rows[hit]]] = uids[rows[target[hit]]]
        result.n_semantic, result.n_clusters = int(hit.sum()), n_clusters
        log(
            f"semantic dedup: {result.n_semantic} of {n} downloaded images duplicate another "
            f"({n_clusters} clusters, cosine > {cfg.dedupe.semantic_threshold:g})"
        )
    result.status = pa.array(labels.tolist(), pa.string())
    result.duplicate_of = pa.array(dup_of.tolist(), pa.string())
    result.leak_of = pa.array(leak_of.tolist(), pa.string())
    return result


def _leaks(
    cfg: BuildConfig,
    ref: EL.EvalReference,
    phash: pa.Array,
    uids: np.ndarray,
    sources: Sequence[str],
    store: Storage,
) -> tuple[np.ndarray, np.ndarray]:
    """Per downloaded row the task and key of the eval picture it leaks ("" for none): by pHash here, then
    by embedding in one task per embeddings file for the rows still clean. Rows without a pHash are
    matched by embedding only; rows without an embedding by pHash only."""
    d = cfg.decontam
    task = np.full(len(phash), "", dtype=object)
    key = np.full(len(phash), "", dtype=object)
    hashed = phash.is_valid().to_numpy(zero_copy_only=False)
    h = pc.fill_null(phash.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
    if hashed.any():
        task[hashed], key[hashed] = EL.eval_leaks(
            h[hashed], None, ref, d.phash_threshold, d.embedding_threshold
        )
    rest = np.flatnonzero(task == "")
    if ref.vectors is None or not sources or not len(rest):
        return task, key
    import ray

    leak_task = ray.remote(num_cpus=1)(SF.leak_file)
    canon, ref_ref = ray.put(pa.array(uids[rest].tolist(), pa.string())), ray.put(ref)
    emb_key = cfg.dedupe.embedding_key
    found = [leak_task.remote(s, emb_key, canon, ref_ref, d.embedding_threshold, store) for s in sources]
    for at, t, k in ray.get(found):  # in file order: a uid two files hold takes the later file's answer
        task[rest[at]], key[rest[at]] = t, k
    return task, key


def semantic_stage(
    sources: Sequence[str],
    key: str,
    uids: np.ndarray,
    priority: np.ndarray | None,
    cfg: DedupeConfig,
    store: Storage,
    scratch: str | None = None,
) -> tuple[np.ndarray, int, int]:
    """SemDeDup of the rows ``uids`` names, their vectors read from ``sources`` by tasks: per row the index
    (into ``uids``) of the kept row it duplicates, −1 for a kept row (or one no file holds); the number of
    clusters; the number of rows the files hold."""
    import ray

    target = np.full(len(uids), -1, dtype=np.int64)
    # rows are named by their place in uid order, so the parts' row order never moves a decision
    canon_idx = np.argsort(np.asarray(uids).astype(str), kind="stable")
    names = np.asarray(uids).astype(str)[canon_idx]
    canon = ray.put(pa.array(names.tolist(), pa.string()))
    n, got, sample = _sample(sources, key, canon, len(uids), cfg, store)
    if n < 2:
        return target, min(n, 1), n
    k = max(1, -(-n // cfg.semantic_cluster_rows))
    m = min(n, 256 * k, _FIT_ROWS)
    if got < m // 2:  # the files held far fewer rows than named: draw again at the rate the count asks for
        n, got, sample = _sample(sources, key, canon, n, cfg, store)
    fit = ray.remote(num_cpus=1)(_fit_files).remote(m, k, cfg.semantic_seed, *sample)
    centroids, basis = ray.get(fit)
    own = scratch is None
    root = tempfile.mkdtemp(prefix="prolip-semdedup-") if own else scratch
    try:
        i, j, s = _pairs(sources, key, canon, centroids, basis, cfg, root, store)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    rank = np.empty(len(names), dtype=np.int64)
    rank[SD.rank_order(names, None if priority is None else np.asarray(priority)[canon_idx])] = np.arange(
        len(names)
    )
    sorted_target = SD.greedy_duplicates(rank, i, j, s.astype(np.float64))
    hit = sorted_target >= 0
    target[canon_idx[hit]] = canon_idx[sorted_target[hit]]
    return target, len(centroids), n


def _sample(
    sources: Sequence[str], key: str, canon: object, n_up: int, cfg: DedupeConfig, store: Storage
) -> tuple[int, int, list]:
    """One task per file: its rows counted, and the fit's sample drawn by uid hash at the rate the row
    count before the files were read asks for (an upper bound: ``_fit_files`` trims it) → (rows the files
    hold, rows sampled, the samples' object refs, left on the workers)."""
    import ray

    k_up = max(1, -(-n_up // cfg.semantic_cluster_rows))
    m_up = min(n_up, 256 * k_up, _FIT_ROWS)
    cut = 1 << 64 if m_up >= n_up else min(int(m_up / n_up * float(1 << 64)), (1 << 64) - 1)
    task = ray.remote(num_cpus=1, num_returns=2)(SF.sample_file)
    outs = [task.remote(src, key, canon, cut, cfg.semantic_seed, store) for src in sources]
    counts = np.array(ray.get([o[0] for o in outs]), np.int64).reshape(-1, 2)
    return int(counts[:, 0].sum()), int(counts[:, 1].sum()), [o[1] for o in outs]


def _pairs(
    sources: Sequence[str],
    key: str,
    canon: object,
    centroids: np.ndarray,
    basis: np.ndarray | None,
    cfg: DedupeConfig,
    root: str,
    store: Storage,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Assignment in one task per file into bucket files of cluster groups (``_GROUP_ROWS`` rows, as k-means
    was asked for), then one task per group → the union of their pairs (positions in uid order)."""
    import ray

    t = cfg.semantic_threshold
    per_group = max(1, _GROUP_ROWS // cfg.semantic_cluster_rows)
    paths = [storage.join(root, "assign", f"{f:05d}.parquet") for f in range(len(sources))]
    cen = ray.put(centroids)
    assign = ray.remote(num_cpus=1)(SF.assign_file)
    ray.get(
        [
            assign.remote(s, key, canon, cen, t, per_group, p, store)
            for s, p in zip(sources, paths, strict=True)
        ]
    )
    pairs = ray.remote(num_cpus=1)(SF.group_pairs)
    groups = range(-(-len(centroids) // per_group))
    found = ray.get([pairs.remote(paths, g, per_group, cen, t, basis, store) for g in groups])
    store.remove_files(paths)
    i, j, s = (np.concatenate(c) for c in zip(*found, strict=True))
    return i, j, s


def _fit_files(m: int, k: int, seed: int, *sample: tuple) -> tuple[np.ndarray, np.ndarray | None]:
    """One task: the files' samples trimmed to ``m`` rows, then ``_fit``."""
    return _fit(SF.fit_sample(sample, m), k, seed)


def _fit(sample: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """One task: k-means centroids and the guests' screen basis from the bounded sample."""
    return SD.kmeans_centroids(sample, k, seed), SD.screen_basis(sample[SD.screen_sample(len(sample), seed)])
