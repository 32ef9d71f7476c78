"""The build's curation stage on Ray: eval-set decontamination, then semantic dedup, over the downloaded rows.

``curate`` runs after the exact and pHash near-duplicate dedupe (``pipeline/source/status_table.py``) on the
rows still ``success``, and relabels some of them, so every input row keeps exactly one status:

1. **decontamination** (``build.decontam``): a row that is a near-copy of an evaluation picture, by pHash
   or by embedding (``pipeline.dedup.eval_leaks.eval_leaks``), becomes ``eval_leak:<task>``;
2. **semantic dedup** (``build.dedupe.semantic``): SemDeDup over the remaining rows' image embeddings;
   a duplicate becomes ``semantic_duplicate`` and names the uid it duplicates in ``duplicate_of``.

The image embeddings are DataComp's precomputed ones (``l14_img`` in the ``.npz`` beside each metadata
parquet) or any uid-keyed file (``dedupe.embeddings``, e.g. ``jobs.embed``'s output of our scorer). The
driver copies the downloaded rows' vectors into a float16 memory map on local disk, one metadata file at
a time; a task fits k-means and the guests' screen basis on a bounded sample (``_FIT_ROWS``), and the
rows are assigned in blocks, each row to its nearest cluster and as a guest to the clusters whose border
it is near (``semantic.assign_with_guests``); then the clusters go to Ray tasks in groups of about
``_GROUP_ROWS`` member rows with their guests, a few groups in flight at once; the tasks return the pairs
above the threshold (guests screened in the basis: docs/decisions/0096), and the greedy rule runs over
their union (docs/decisions/0087-exact-semantic-dedup.md). Neither the stage nor a task holds more than a
group's vectors in memory (the map's pages come and go with the disk cache); the stage holds the pairs.
"""

from __future__ import annotations

import os
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
from pipeline.filters import embedding as E

_GROUP_ROWS = 50_000  # rows of one task's clusters
_IN_FLIGHT = 4  # tasks submitted ahead of the results
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


class _Vectors:
    """The downloaded rows' image embeddings in a float16 memory map, rows in ``uids`` order; ``have``
    marks the rows the embeddings files cover."""

    def __init__(self, uids: np.ndarray, sources: Sequence[str], key: str, store: Storage) -> None:
        self.dir = tempfile.mkdtemp(prefix="prolip-semdedup-")
        self.uids = uids
        self.have = np.zeros(len(uids), dtype=bool)
        self.map: np.ndarray | None = None
        at = pa.array(uids.tolist(), pa.string())
        for src in sources:
            got, arrays = E.load_embedding_set(src, (key,), store)
            vec = arrays[key]
            if self.map is None and len(vec):
                path = os.path.join(self.dir, "vectors.f16")
                self.map = np.memmap(path, dtype=np.float16, mode="w+", shape=(len(uids), vec.shape[1]))
            pos = pc.index_in(pa.array(got, pa.string()), value_set=at).to_numpy(zero_copy_only=False)
            found = ~np.isnan(pos.astype(np.float64))
            rows = pos[found].astype(np.int64)
            if len(rows):
                self.map[rows] = SD.normalize(vec[found]).astype(np.float16)
                self.have[rows] = True

    def rows(self, idx: np.ndarray) -> np.ndarray:
        return np.asarray(self.map[idx], dtype=np.float32)

    def close(self) -> None:
        self.map = None
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


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
) -> CurationResult:
    """Relabel the ``success`` rows of ``parts`` (module docstring). ``priority(uids)``: the score that
    decides which copy of a semantic group stays (larger first), or None for uid order."""
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
    vectors = None
    if want_semantic or (ref is not None and ref.vectors is not None):
        sources = _embedding_sources(cfg, metadata_files, store)
        vectors = _Vectors(uids.astype(str), sources, cfg.dedupe.embedding_key, store)
    try:
        alive = np.ones(len(ok), dtype=bool)
        if want_leaks:
            task, key = _leaks(cfg, ref, parts.column(S.PHASH).combine_chunks().take(taken), vectors)
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
            rows = np.flatnonzero(alive & vectors.have)
            target, n_clusters = semantic_stage(vectors, rows, priority(uids[rows].astype(str)), cfg.dedupe)
            hit = target >= 0
            labels[ok[rows[hit]]] = S.STATUS_SEMANTIC_DUPLICATE
            dup_of[ok[rows[hit]]] = uids[rows[target[hit]]]
            result.n_semantic, result.n_clusters = int(hit.sum()), n_clusters
            log(
                f"semantic dedup: {result.n_semantic} of {len(rows)} downloaded images duplicate another "
                f"({n_clusters} clusters, cosine > {cfg.dedupe.semantic_threshold:g})"
            )
    finally:
        if vectors is not None:
            vectors.close()
    result.status = pa.array(labels.tolist(), pa.string())
    result.duplicate_of = pa.array(dup_of.tolist(), pa.string())
    result.leak_of = pa.array(leak_of.tolist(), pa.string())
    return result


def _leaks(
    cfg: BuildConfig, ref: EL.EvalReference, phash: pa.Array, vectors: _Vectors | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per downloaded row the task and key of the eval picture it leaks ("" for none). Rows without a
    pHash are matched by embedding only; rows without an embedding by pHash only."""
    d = cfg.decontam
    task = np.full(len(phash), "", dtype=object)
    key = np.full(len(phash), "", dtype=object)
    hashed = phash.is_valid().to_numpy(zero_copy_only=False)
    h = pc.fill_null(phash.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
    if hashed.any():
        task[hashed], key[hashed] = EL.eval_leaks(
            h[hashed], None, ref, d.phash_threshold, d.embedding_threshold
        )
    if vectors is not None and vectors.have.any() and ref.vectors is not None:
        rows = np.flatnonzero(vectors.have & (task == ""))
        for a in range(0, len(rows), 1 << 16):
            block = rows[a : a + (1 << 16)]
            task[block], key[block] = EL.eval_leaks(
                None, vectors.rows(block), ref, d.phash_threshold, d.embedding_threshold
            )
    return task, key


def semantic_stage(
    vectors: _Vectors, rows: np.ndarray, priority: np.ndarray | None, cfg: DedupeConfig
) -> tuple[np.ndarray, int]:
    """SemDeDup of ``rows`` of ``vectors`` with the clusters on Ray tasks: per row the index (into
    ``rows``) of the kept row it duplicates, −1 for a kept row; and the number of clusters."""
    n = len(rows)
    target = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return target, min(n, 1)
    # k-means sees the rows in uid order, so the parts' row order never moves a decision
    canon = np.argsort(vectors.uids[rows], kind="stable")
    sorted_target, n_clusters = _semantic_sorted(
        vectors, rows[canon], None if priority is None else priority[canon], cfg
    )
    hit = sorted_target >= 0
    target[canon[hit]] = canon[sorted_target[hit]]
    return target, n_clusters


def _semantic_sorted(
    vectors: _Vectors, rows: np.ndarray, priority: np.ndarray | None, cfg: DedupeConfig
) -> tuple[np.ndarray, int]:
    import ray

    n = len(rows)
    t = cfg.semantic_threshold
    k = max(1, -(-n // cfg.semantic_cluster_rows))
    rng = np.random.default_rng(np.random.SeedSequence([cfg.semantic_seed, 1]))
    sample = np.sort(rng.choice(n, size=min(n, 256 * k, _FIT_ROWS), replace=False))
    fit = ray.remote(num_cpus=1)(_fit).remote(vectors.rows(rows[sample]), k, cfg.semantic_seed)
    centroids, basis = ray.get(fit)
    primary, g_row, g_cl = [], [], []
    for a in range(0, n, 1 << 16):
        p, gr, gc = SD.assign_with_guests(vectors.rows(rows[a : a + (1 << 16)]), centroids, t)
        primary.append(p)
        g_row.append(gr + a)
        g_cl.append(gc)
    primary, g_row, g_cl = np.concatenate(primary), np.concatenate(g_row), np.concatenate(g_cl)
    guests = dict(zip(np.unique(g_cl).tolist(), (g_row[m] for m in SD.cluster_members(g_cl)), strict=True))
    pairs_task = ray.remote(num_cpus=1)(_pairs_group)
    cref = ray.put(centroids)
    pending: list = []
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for group in _groups(SD.cluster_members(primary)):
        ids = [int(primary[m[0]]) for m in group]
        gs = [guests.get(c, np.zeros(0, np.int64)) for c in ids]
        flat = np.concatenate([x for m, g in zip(group, gs, strict=True) for x in (m, g)])
        sizes = [(len(m), len(g)) for m, g in zip(group, gs, strict=True)]
        pending.append(
            pairs_task.remote(vectors.rows(rows[flat]), flat, primary[flat], sizes, ids, cref, t, basis)
        )
        while len(pending) > _IN_FLIGHT:
            done, pending = ray.wait(pending, num_returns=1)
            found.append(ray.get(done[0]))
    found += [ray.get(ref) for ref in pending]
    i, j, s = (np.concatenate(c) for c in zip(*found, strict=True)) if found else (np.zeros(0, np.int64),) * 3
    order = SD.rank_order(vectors.uids[rows], priority)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    return SD.greedy_duplicates(rank, i, j, s.astype(np.float64)), len(centroids)


def _fit(sample: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """One task: k-means centroids and the guests' screen basis from the bounded sample."""
    return SD.kmeans_centroids(sample, k, seed), SD.screen_basis(sample[SD.screen_sample(len(sample), seed)])


def _groups(members: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Clusters in order, packed into groups of about ``_GROUP_ROWS`` rows."""
    out: list[list[np.ndarray]] = [[]]
    size = 0
    for m in members:
        if size and size + len(m) > _GROUP_ROWS:
            out.append([])
            size = 0
        out[-1].append(m)
        size += len(m)
    return [g for g in out if g]


def _pairs_group(
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
