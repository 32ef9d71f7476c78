"""Compose the dataset build from the pure stages: metadata → row checks → download parts → shards → subsets.

The one Ray-aware module of the build. Global decisions (row checks, URL, exact-image and near-duplicate
dedupe; filter thresholds over the whole pool) are made in the driver on narrow columns (uid, url, two
short strings: ~150 bytes a row); everything that touches bytes or models runs in Ray (the download actors, Ray Data).

Order of a run: check the metadata files' schemas (each file named), the filter specs and the columns
they need; read the narrow columns in the driver with pyarrow (pipeline/source/metadata.py) and decide every row
that can be decided before download (pipeline/source/row_checks.py); check and record the run fingerprint
(pipeline/source/run_state.py: a different pool, row order or part settings are refused); download the parts not
committed yet (or, with ``retry_failed``, re-fetch the transient rows of committed ones); then derive the
status table, the shards and the subsets from the committed parts. Resume unit = a download *part*: the
live rows in read order cut into consecutive ranges of ``part_size``, so the assignment depends only on
the metadata (and the fingerprint pins its order), and a resumed build ends with what an uninterrupted
one would. The driver ships each part's row positions only; the download actors read the rows' columns
from the files themselves, so there is no pass over the rows and no shuffle before the first part
starts. A part is committed by the driver when it receives the part's rows, never by the actor that wrote
it (pipeline/source/run_state.py explains why and how stale files are ignored).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.config import BuildConfig
from pipeline.dedup import curation_stage as CS
from pipeline.download.phase import PoolRows, download_parts
from pipeline.filters import rerun_cache as FR
from pipeline.filters.specs import apply_filters, check_build_filters, needs_language, parse_filter_specs
from pipeline.source import run_state as R
from pipeline.source.content import COLUMNS as CONTENT_COLUMNS
from pipeline.source.content import content_digests, served_hosts
from pipeline.source.metadata import Metadata, open_metadata, read_columns
from pipeline.source.output_lock import exclusive
from pipeline.source.row_checks import CAPTION_STATUS, ROW_KEY, pre_statuses
from pipeline.source.status_table import decide_image_duplicates, status_table_of
from pipeline.subsets import eligibility as SR
from pipeline.subsets.reshard import ReshardResult, reshard
from pipeline.subsets.uid_files import arrow_u8pairs, write_subset

_FILTER_COLUMNS = [S.UID, S.TEXT, S.ORIGINAL_WIDTH, S.ORIGINAL_HEIGHT, S.CLIP_B32, S.CLIP_L14, ROW_KEY]
_NARROW = [S.UID, S.URL, CAPTION_STATUS, ROW_KEY]
_LANG_BLOCK = 200_000


@dataclass
class BuildResult:
    output: str
    n_input: int
    status_counts: dict[str, int]
    filter_counts: dict[str, int]  # uids in each subset .npy (its filters.subset_scope)
    subsets: dict[str, str]
    shards: list[str]
    parts_done_before: int
    timings: dict[str, float] = field(default_factory=dict)
    n_retried: int = 0
    # per subset: "metadata" = pool uids that pass (DataComp's count), "downloaded" = those in the shards
    subset_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    # eval leaks per task, semantic duplicates and k-means clusters (pipeline/dedup/curation_stage.py)
    curation: dict[str, object] = field(default_factory=dict)


def run_paths(output: str) -> dict[str, str]:
    return R.run_dirs(output)


# --- the build ----------------------------------------------------------------------------------------


@dataclass
class _Pool:
    """The metadata: its checked files, its narrow columns in read order and the pre-download statuses."""

    meta: Metadata
    narrow: pa.Table  # uid, url, caption_status, row_key
    status_pre: np.ndarray  # "" = goes on to download
    max_caption_bytes: int
    store: Storage
    served: tuple[str, ...]  # the run's served hosts (pipeline/source/content.py)

    def live(self) -> np.ndarray:
        return self.status_pre == ""

    def columns(self, names: list[str]) -> pa.Table:
        """``names`` of every row in read order, prepared (read again from the files: cheap, and the
        driver never holds the wide columns longer than a stage needs them)."""
        return read_columns(self.meta, names, self.max_caption_bytes, self.store, self.served)


def build(
    cfg: BuildConfig,
    log: Callable[[str], None] = print,
    store: Storage | None = None,
    allow_hosts: Sequence[str] = (),
) -> BuildResult:
    """Run the whole build for ``cfg`` (Ray must be initialised). Idempotent; resumes at part granularity.

    ``store``: the run's storage as the job built it; by default resolved here, once, from ``cfg.s3_endpoint``.
    ``allow_hosts``: ``download.allow_hosts`` entries for this run only, outside its config and fingerprint
    (the demo pool's server: pipeline/demo/source.py).
    """
    store = store if store is not None else Storage.from_env(cfg.s3_endpoint)
    t0 = time.perf_counter()
    pool = _read_pool(cfg, store, log, served_hosts([*cfg.download.allow_hosts, *allow_hosts]))
    content = pool_content(pool)
    # One build per output, from the fingerprint check to the last file (pipeline/source/output_lock.py).
    with exclusive(cfg.output, store, log) as lock:
        return _build_locked(cfg, log, store, (pool, content), lock, t0, allow_hosts)


def _build_locked(
    cfg: BuildConfig,
    log: Callable[[str], None],
    store: Storage,
    read: tuple,
    lock,
    t0: float,
    allow_hosts: Sequence[str] = (),
) -> BuildResult:
    """The build once the output is ours: ``read`` = (the pool, its content digests)."""
    pool, content = read
    paths = run_paths(cfg.output)
    timings: dict[str, float] = {}
    fp = R.fingerprint(cfg, pool.narrow.column(S.UID), pool.live(), content)
    R.claim(cfg, fp, store, log)
    timings["metadata_and_row_checks"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    rows = PoolRows(pool.meta, pool.narrow.column(S.UID), pool.live(), content)
    n_parts, done, n_retried = download_parts(rows, cfg, store, paths, log, allow_hosts)
    lock.check()
    R.record(cfg, fp, store)  # every part now holds this pool's content
    timings["download"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    status_table, curated = _decide_statuses(pool, cfg, store, paths, n_parts, log)
    counts = {c["values"]: c["counts"] for c in pc.value_counts(status_table.column(S.STATUS)).to_pylist()}
    timings["image_dedupe"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    res = _write_shards(status_table, cfg, store, paths, n_parts)
    timings["shards"] = time.perf_counter() - t3
    log(f"shards: {res.n_written} samples in {len(res.shards)} shards")

    t4 = time.perf_counter()
    subset_sizes, subsets = run_filters(pool, cfg, status_table, paths, log, store)
    scope = cfg.filters.subset_scope
    timings["filters"] = time.perf_counter() - t4
    if cfg.tokenizer_vocab > 0:
        train_build_tokenizer(pool, status_table, cfg, log, store)
    timings["total"] = time.perf_counter() - t0
    return BuildResult(
        output=cfg.output,
        n_input=pool.narrow.num_rows,
        status_counts=dict(sorted(counts.items())),
        filter_counts={name: sizes[scope] for name, sizes in subset_sizes.items()},
        subsets=subsets,
        shards=list(res.shards),
        parts_done_before=done,
        timings=timings,
        n_retried=n_retried,
        subset_sizes=subset_sizes,
        curation={
            "eval_leaks": curated.leaks_by_task,
            "semantic_duplicates": curated.n_semantic,
            "clusters": curated.n_clusters,
        },
    )


def _read_pool(
    cfg: BuildConfig, store: Storage, log: Callable[[str], None], served: tuple[str, ...] = ()
) -> _Pool:
    """Read and check the metadata and the filters it must feed; decide the rows that need no download."""
    meta = open_metadata(cfg.metadata, store)
    for name, columns in zip(meta.files, meta.names, strict=True):
        check_build_filters(cfg.filters, columns, name)
    CS.check_curation(cfg, meta.files, store)
    narrow = read_columns(meta, _NARROW, cfg.max_caption_bytes, store, served)
    status_pre = pre_statuses(narrow)
    log(
        f"metadata: {narrow.num_rows} rows in {len(meta.files)} files; "
        f"{int((status_pre != '').sum())} decided before download"
    )
    return _Pool(meta, narrow, status_pre, cfg.max_caption_bytes, store, served)


def pool_content(pool: _Pool) -> np.ndarray:
    """Every live row's content digest (0 for rows decided before download), read as the parts read them."""
    content = np.zeros(pool.narrow.num_rows, np.uint64)
    live = np.flatnonzero(pool.live())
    if len(live):
        rows = pool.columns([S.UID, *CONTENT_COLUMNS]).take(pa.array(live))
        content[live] = content_digests(rows, pool.served)
    return content


def _part_files(paths: dict[str, str], n_parts: int, store: Storage, ext: str) -> list[str]:
    done = R.committed(paths["parts"], store)
    return [R.part_file(paths["parts"], p, done[p], ext) for p in range(n_parts) if p in done]


def _decide_statuses(
    pool: _Pool, cfg: BuildConfig, store: Storage, paths: dict[str, str], n_parts: int, log=print
) -> tuple[pa.Table, CS.CurationResult]:
    """Every part's rows (this run's and earlier runs'), image dedupe, the curation stage (eval leaks,
    semantic duplicates), the status table of every input row."""
    part_files = _part_files(paths, n_parts, store, "parquet")
    parts = store.read_parquet(part_files) if part_files else pa.table({S.UID: pa.array([], pa.string())})
    status = decide_image_duplicates(parts, cfg.dedupe)
    priority = CS.clip_priority(pool.columns([S.UID, S.CLIP_L14])) if cfg.dedupe.semantic else None
    curated = CS.curate(parts, status, cfg, pool.meta.files, priority, store, log)
    if parts.num_rows:
        parts = parts.append_column(S.DUPLICATE_OF, curated.duplicate_of).append_column(
            S.LEAK_OF, curated.leak_of
        )
    status_table = status_table_of(pool.narrow, pool.status_pre, parts, curated.status)
    store.write_parquet(status_table, paths["status"])
    n_input = pool.narrow.num_rows
    if status_table.num_rows != n_input:
        raise RuntimeError(f"accounting: {status_table.num_rows} statuses for {n_input} input rows")
    return status_table, curated


def _write_shards(
    status_table: pa.Table, cfg: BuildConfig, store: Storage, paths: dict[str, str], n_parts: int
) -> ReshardResult:
    """The final shards: the successful uids resharded out of the download parts (none: an empty dir)."""
    success = pc.filter(status_table.column(S.UID), pc.equal(status_table.column(S.STATUS), S.STATUS_SUCCESS))
    success_pairs = np.sort(arrow_u8pairs(success))
    part_tars = _part_files(paths, n_parts, store, "tar")
    if not part_tars or not len(success_pairs):
        store.remove_files(store.list_files(paths["shards"]))  # an earlier run's shards are not this one's
        store.makedirs(paths["shards"])
        empty = np.zeros(0, S.UID_DTYPE)
        z = np.zeros(0, np.int64)
        return ReshardResult(0, 0, 0, [], empty, z, z, z, cfg.samples_per_shard)
    return reshard(
        part_tars,
        success_pairs,
        paths["shards"],
        samples_per_shard=cfg.samples_per_shard,
        store=store,
        overwrite=True,
    )


# --- filters and subsets ------------------------------------------------------------------------------


class _LangTag:
    """Ray Data UDF: fastText language label per caption, the model loaded once per actor."""

    def __init__(self, model_path: str = "") -> None:
        from pipeline.filters.language import LanguageId

        self.lid = LanguageId(model_path or None)

    def __call__(self, batch: pa.Table) -> pa.Table:
        labels, _scores = self.lid(batch.column(S.TEXT).to_pylist())
        keys = {c: batch.column(c) for c in (S.UID, ROW_KEY)}
        return pa.table({**keys, "lang": pa.array(list(labels), pa.string())})


def run_filters(
    pool: _Pool, cfg: BuildConfig, status_table: pa.Table, paths: dict[str, str], log, store: Storage = LOCAL
) -> tuple[dict, dict]:
    """Apply each requested filter to the whole pool. A subset lists the passing uids of its
    ``filters.subset_scope``, each once: all of them ("metadata", DataComp's filter outputs) or the downloaded
    ones; a repeated uid counts with one row only. Returns each subset's sizes in both scopes, and its path.
    When nothing the results derive from changed since the last run, that run's files are reused
    (pipeline/filters/rerun_cache.py)."""
    specs = parse_filter_specs(list(cfg.filters.names), "filters.names")
    stamp = FR.filter_stamp(cfg, specs, status_table, store)
    earlier = FR.reusable(stamp, paths, store)
    if earlier is not None:
        log(f"filters: metadata, filters and statuses unchanged; reusing {len(earlier['subsets'])} subsets")
        return earlier["sizes"], earlier["subsets"]
    FR.forget(paths, store)
    meta = pool.columns(_FILTER_COLUMNS)
    lang = _language_labels(cfg, meta) if needs_language(specs) and meta.num_rows else None
    results = (
        apply_filters(meta, cfg.filters, lang=lang, store=store, metadata=pool.meta.files)
        if meta.num_rows
        else {}
    )
    live = SR.LiveRows.of(pool.narrow, pool.live(), status_table)
    live_rows = live.rows(meta)
    success = SR.eligible(live, meta, live_rows)
    listable = SR.listable(meta, live_rows) & ~CS.leaked_rows(meta, status_table)
    eligible = listable if cfg.filters.subset_scope == "metadata" else success
    columns: dict[str, pa.Array] = {S.UID: meta.column(S.UID)}
    sizes, subsets = {}, {}
    store.makedirs(paths["subsets"])
    for spec in specs:
        name = spec.label
        res = results.get(name)
        keep = np.asarray(res.keep, dtype=bool) if res is not None else np.zeros(0, dtype=bool)
        columns[f"keep_{name}"] = pa.array(keep, pa.bool_())
        columns[f"reason_{name}"] = pa.array(res.reason if res is not None else [], pa.string())
        chosen = SR.uids_where(meta, keep & eligible)
        path = FR.subset_path(paths, name)
        with store.open_output(path) as fh:
            write_subset(chosen, fh)
        sizes[name] = {
            "metadata": len(SR.uids_where(meta, keep & listable)),
            "downloaded": len(SR.uids_where(meta, keep & success)),
        }
        subsets[name] = path
        log(
            f"filter {name}: {int(keep.sum())} of {len(keep)} pool rows pass; {cfg.filters.subset_scope} "
            f"subset {len(chosen)} uids, {sizes[name]['downloaded']} of them downloaded"
        )
    _remove_stale_subsets(subsets, paths, store)
    store.write_parquet(pa.table(columns), paths["filters"])
    FR.remember(stamp, sizes, subsets, paths, store)
    return sizes, subsets


def _language_labels(cfg: BuildConfig, meta: pa.Table) -> pa.Array:
    """fastText's label of every row of ``meta`` (in its order), predicted in one Ray actor (the model is
    loaded there, not in the driver) over blocks of the table the driver read."""
    import ray
    import ray.data

    from pipeline.shards.ray_reader import from_arrow_scoped

    captions = meta.select([S.UID, S.TEXT, ROW_KEY])
    # Blocks of _LANG_BLOCK rows: the actor streams through the pool instead of receiving it as one object.
    blocks = [captions.slice(i, _LANG_BLOCK) for i in range(0, captions.num_rows, _LANG_BLOCK)]
    ds = from_arrow_scoped(blocks, cfg.data_label_selector).map_batches(
        _LangTag,
        fn_constructor_args=(cfg.filters.language_model,),
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_format="pyarrow",
    )
    return SR.align_labels(meta, pa.concat_tables(ray.get(ds.to_arrow_refs())))


def _remove_stale_subsets(subsets: dict[str, str], paths: dict[str, str], store: Storage) -> None:
    """A subset an earlier build run wrote for a filter no longer asked for is not derived from this run's
    statuses: remove it. Only the build's own (listed in work/): other jobs write subsets here too.
    Names, not paths: a run directory that was copied or moved must never reach back into the original."""
    listed = storage.join(paths["work"], "subsets.json")
    before = store.read_json(listed) if store.exists(listed) else []
    stale = {os.path.basename(str(p)) for p in before} - {f"{n}.npy" for n in subsets}
    store.remove_files([storage.join(paths["subsets"], n) for n in sorted(stale)])
    store.write_json(sorted(f"{n}.npy" for n in subsets), listed)


def train_build_tokenizer(
    pool: _Pool, status_table: pa.Table, cfg: BuildConfig, log, store: Storage = LOCAL
) -> str:
    """Offline BPE tokenizer on the captions of successful rows, saved beside the shards for training."""
    import tempfile

    from pipeline.ingest.tokenizer import train_tokenizer

    out = storage.join(cfg.output, "tokenizer")
    # A re-run with the same captions (metadata files and the status of every row) keeps the tokenizer:
    # training it is the only step of a finished build's re-run that would grow with the pool.
    stamp = {
        "vocab": cfg.tokenizer_vocab,
        "max_caption_bytes": cfg.max_caption_bytes,
        "metadata": FR.file_stamps(pool.meta.files, store),
        "status": FR.status_digest(status_table),
    }
    stamp_file = storage.join(run_paths(cfg.output)["work"], "tokenizer_stamp.json")
    if store.exists(stamp_file) and store.read_json(stamp_file) == stamp and store.list_files(out):
        log(f"tokenizer: unchanged captions, kept {out}")
        return out
    if store.exists(stamp_file):
        store.remove(stamp_file)
    meta = pool.columns([S.UID, S.TEXT, ROW_KEY])
    ok = SR.eligible(SR.LiveRows.of(pool.narrow, pool.live(), status_table), meta)
    texts = pc.filter(meta.column(S.TEXT), pa.array(ok, pa.bool_()))
    captions = [t for t in texts.to_pylist() if t]
    tok = train_tokenizer(captions, vocab_size=cfg.tokenizer_vocab)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as fh:
                store.write_bytes(fh.read(), storage.join(out, name))
    store.write_json(stamp, stamp_file)
    log(f"tokenizer: BPE vocab {tok.vocab_size} trained on {len(captions)} captions → {out}")
    return out
