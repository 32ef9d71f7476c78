"""Compose the dataset build from the pure stages: metadata → row checks → download parts → shards → subsets.

The one Ray-aware module of the build. Global decisions (row checks, URL, exact-image and near-duplicate
dedupe; filter thresholds over the whole pool) are made in the driver on narrow columns (uid, url, two
short strings: ~150 bytes a row); everything that touches bytes or models runs in Ray Data.

Order of a run: read the metadata and check its schema (each file named), the filter specs and the columns
they need; decide every row that can be decided before download (pipeline/rows.py); check and record
the run fingerprint (pipeline/runstate.py: a different pool or different part settings are refused);
download the parts not committed yet (or, with ``retry_failed``, re-fetch the transient rows of committed
ones); then derive the status table, the shards and the subsets from the committed parts. Resume unit = a
download *part*: uids are bucketed by their top 32 bits into ``ceil(live rows / part_size)`` parts, so
the assignment depends only on the metadata, and a resumed build ends with what an uninterrupted one
would. A part is committed by the driver when it receives the part's rows, never by the actor that wrote
it (pipeline/runstate.py explains why and how stale files are ignored).
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import filter_reuse as FR
from pipeline import runstate as R
from pipeline import schema as S
from pipeline import storage
from pipeline import subset_rows as SR
from pipeline.config import BuildConfig
from pipeline.filtering import apply_filters, check_build_filters, needs_language, parse_filter_specs
from pipeline.parts import DownloadPart
from pipeline.placement import scope_dataset
from pipeline.reshard import ReshardResult, reshard
from pipeline.rows import CAPTION_STATUS, ROW_KEY, pre_statuses, prepare_batch
from pipeline.status_table import decide_image_duplicates, status_table_of
from pipeline.storage import LOCAL, Storage
from pipeline.subset import arrow_u8pairs, write_subset

_FILTER_COLUMNS = [S.UID, S.TEXT, S.ORIGINAL_WIDTH, S.ORIGINAL_HEIGHT, S.CLIP_B32, S.CLIP_L14, ROW_KEY]


class MetadataError(ValueError):
    """The metadata cannot be read or has the wrong schema; the message names the file."""


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


def run_paths(output: str) -> dict[str, str]:
    return R.run_dirs(output)


def part_of(uids: list[str], n_parts: int) -> np.ndarray:
    """Part index of each uid: top 32 bits of the uid scaled to ``n_parts`` (uids are uniform random hex)."""
    top = np.array([int(u[:8], 16) for u in uids], dtype=np.uint64)
    return ((top * np.uint64(n_parts)) >> np.uint64(32)).astype(np.int64)


# --- metadata -----------------------------------------------------------------------------------------


def read_metadata(path: str, store: Storage = LOCAL):
    """A Ray Dataset over the metadata parquet files; each file's schema is checked here, before any
    download, and an unreadable or mistyped file is a ``MetadataError`` naming it."""
    import ray.data

    files = store.list_files(path, suffix=".parquet")
    if not files:
        raise MetadataError(f"metadata: no parquet files at {path}")
    fs, fs_paths = store.filesystem_for(files)
    for name, fs_path in zip(files, fs_paths, strict=True):
        try:
            schema = pq.read_schema(fs_path, filesystem=fs)
        except (OSError, pa.ArrowException) as exc:
            raise MetadataError(f"{name}: not a readable parquet file ({exc})") from None
        try:
            S.validate_metadata_schema(schema)
        except S.SchemaError as exc:
            raise MetadataError(f"{name}: {exc}") from None
    return ray.data.read_parquet(fs_paths, filesystem=fs)


def _arrow_schema(ds) -> pa.Schema:
    sch = ds.schema()
    base = getattr(sch, "base_schema", None)
    if isinstance(base, pa.Schema):
        return base
    return pa.schema([pa.field(n, t) for n, t in zip(sch.names, sch.types, strict=True)])


def _collect(ds, columns: list[str]) -> pa.Table:
    import ray

    if ds.schema() is None:  # Ray knows no schema for a dataset without rows
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    names = _arrow_schema(ds).names
    present = [c for c in columns if c in names]
    refs = ds.select_columns(present).to_arrow_refs()
    tables = [t for t in ray.get(refs) if t.num_rows]
    if not tables:
        return pa.table({c: pa.array([], pa.string()) for c in present})
    return pa.concat_tables(tables, promote_options="permissive")


# --- the build ----------------------------------------------------------------------------------------


@dataclass
class _Pool:
    """The metadata as read once: the prepared dataset, its narrow columns and the pre-download statuses."""

    ds: Any  # ray.data.Dataset (Ray is imported lazily here)
    narrow: pa.Table  # uid, url, caption_status, row_key
    status_pre: np.ndarray  # "" = goes on to download

    def live(self) -> np.ndarray:
        return self.status_pre == ""


def build(cfg: BuildConfig, log: Callable[[str], None] = print, store: Storage | None = None) -> BuildResult:
    """Run the whole build for ``cfg`` (Ray must be initialised). Idempotent; resumes at part granularity.

    ``store``: the run's storage as the job built it; by default resolved here, once, from ``cfg.s3_endpoint``.
    """
    store = store if store is not None else Storage.from_env(cfg.s3_endpoint)
    paths = run_paths(cfg.output)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pool = _read_pool(cfg, store, log)
    R.claim(cfg, R.fingerprint(cfg, pool.narrow.column(S.UID).to_pylist()), store, log)
    timings["metadata_and_row_checks"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    n_parts, done, n_retried = _download_parts(pool, cfg, store, paths, log)
    timings["download"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    status_table = _decide_statuses(pool, cfg, store, paths, n_parts)
    counts = Counter(status_table.column(S.STATUS).to_pylist())
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
    )


def _read_pool(cfg: BuildConfig, store: Storage, log: Callable[[str], None]) -> _Pool:
    """Read and check the metadata and the filters it must feed; decide the rows that need no download."""
    raw = read_metadata(cfg.metadata, store)
    check_build_filters(cfg.filters, _arrow_schema(raw).names, cfg.metadata)
    max_caption = cfg.max_caption_bytes
    ds = scope_dataset(raw, cfg.data_label_selector).map_batches(  # derived datasets inherit the scope
        lambda b: prepare_batch(b, max_caption), batch_format="pyarrow", zero_copy_batch=True
    )
    narrow = _collect(ds, [S.UID, S.URL, CAPTION_STATUS, ROW_KEY])
    if narrow.num_rows == 0:
        narrow = pa.table({c: pa.array([], pa.string()) for c in (S.UID, S.URL, CAPTION_STATUS, ROW_KEY)})
    status_pre = pre_statuses(narrow)
    log(f"metadata: {narrow.num_rows} rows; {int((status_pre != '').sum())} decided before download")
    return _Pool(ds, narrow, status_pre)


def _download_parts(
    pool: _Pool, cfg: BuildConfig, store: Storage, paths: dict[str, str], log: Callable[[str], None]
) -> tuple[int, int, int]:
    """Download the parts not committed yet (Ray actors) → (parts, parts done before, rows retried)."""
    live = pool.live()
    live_uids = [u for u, ok in zip(pool.narrow.column(S.UID).to_pylist(), live, strict=True) if ok]
    n_parts = math.ceil(len(live_uids) / cfg.part_size)
    store.makedirs(paths["parts"])
    done = R.committed(paths["parts"], store)
    done = {p: t for p, t in done.items() if p < n_parts}
    R.remove_uncommitted(paths["parts"], done, store)
    retry = _transient_rows(paths["parts"], done, store) if cfg.retry_failed else {}
    todo = sorted(set(range(n_parts)) - set(done))
    n_retry = sum(len(u) for u in retry.values())
    log(
        f"download: {n_parts} parts of ≤~{cfg.part_size} rows, {len(done)} already done"
        + (f"; retrying {n_retry} transient rows in {len(retry)} parts" if cfg.retry_failed else "")
    )
    if not todo and not retry:
        return n_parts, len(done), 0
    token = uuid.uuid4().hex[:16]
    results = _download_dataset(pool, cfg, store, paths, live_uids, n_parts, todo, retry, token)
    finished: set[int] = set()
    for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
        new = set(batch.column("part").to_pylist()) - finished
        for part in sorted(new):
            R.commit(paths["parts"], part, token, store)  # the driver is alive: the part counts
        finished |= new
        ok = pc.sum(pc.equal(batch.column(S.STATUS), S.STATUS_SUCCESS)).as_py() or 0
        log(f"  part(s) done: {len(finished)}/{len(todo) + len(retry)} (+{batch.num_rows} rows, {ok} images)")
    R.remove_uncommitted(paths["parts"], R.committed(paths["parts"], store), store)
    return n_parts, len(done), n_retry


def _transient_rows(parts_dir: str, done: dict[int, str], store: Storage) -> dict[int, set[str]]:
    """Committed part → its uids whose status is transient (only parts that have some)."""
    out = {}
    for part, token in sorted(done.items()):
        t = store.read_parquet(R.part_file(parts_dir, part, token, "parquet"), columns=[S.UID, S.STATUS])
        uids = {
            u
            for u, s in zip(t.column(S.UID).to_pylist(), t.column(S.STATUS).to_pylist(), strict=True)
            if S.is_transient(s)
        }
        if uids:
            out[part] = uids
    return out


def _download_dataset(pool, cfg, store, paths, live_uids, n_parts, todo, retry, token):
    """The Ray Data pipeline: canonical live rows of the parts to do (or their transient rows) → parts."""
    import ray.data

    todo_set = set(todo)
    retry_uids = set().union(*retry.values()) if retry else set()
    excluded, canonical = _row_filter(pool)

    def tag(batch: pa.Table) -> pa.Table:
        uids = batch.column(S.UID).to_pylist()
        keys = batch.column(ROW_KEY).to_pylist()
        keep = [
            S.is_valid_uid(u) and u not in excluded and canonical.get(u, k) == k
            for u, k in zip(uids, keys, strict=True)
        ]
        batch = batch.filter(pa.array(keep, pa.bool_()))
        kept = batch.column(S.UID).to_pylist()
        parts = part_of(kept, n_parts) if kept else np.zeros(0, np.int64)
        batch = batch.append_column("part", pa.array(parts, pa.int64()))
        wanted = [
            p in todo_set or (p in retry and u in retry_uids)
            for p, u in zip(parts.tolist(), kept, strict=True)
        ]
        return batch.filter(pa.array(wanted, pa.bool_()))

    n_groups = len(todo_set | set(retry))
    # Few shuffle partitions: a part is the unit of work, more partitions than parts is pure overhead.
    grouped = pool.ds.map_batches(tag, batch_format="pyarrow").groupby(
        "part", num_partitions=min(n_groups, 64)
    )
    return grouped.map_groups(
        DownloadPart,
        # The Storage object travels to the actors with its credentials: their processes need no AWS env.
        fn_constructor_args=(
            cfg.download,
            paths["parts"],
            token,
            {p: _done_token(paths, p, store) for p in retry},
            store,
        ),
        compute=ray.data.ActorPoolStrategy(size=max(1, cfg.download_actors)),
        # Downloads mostly wait on the network: a fractional CPU leaves room for the read and shuffle
        # tasks (a whole CPU per actor deadlocks a 2-CPU machine).
        num_cpus=cfg.download_cpus,
        batch_format="pyarrow",
    )


def _row_filter(pool: _Pool) -> tuple[set[str], dict[str, str]]:
    """What the download tasks need to keep exactly the rows the driver let through, small at any scale:
    the valid uids whose kept row was rejected before download (so no row of theirs goes on), and the
    kept row's key for the uids on several rows. Every other row with a valid uid is its uid's only row."""
    uids = pool.narrow.column(S.UID).to_pylist()
    keys = pool.narrow.column(ROW_KEY).to_pylist()
    pre = pool.status_pre
    not_kept = (S.STATUS_INVALID_UID, S.STATUS_DUPLICATE_UID)
    excluded = {uids[i] for i in np.flatnonzero(pre != "") if pre[i] not in not_kept}
    repeated = {uids[i] for i in np.flatnonzero(pre == S.STATUS_DUPLICATE_UID)}
    canonical = {uids[i]: keys[i] for i in np.flatnonzero(pre == "") if uids[i] in repeated}
    return excluded, canonical


def _done_token(paths: dict[str, str], part: int, store: Storage) -> str:
    return store.read_json(R.marker(paths["parts"], part))["token"]


def _part_files(paths: dict[str, str], n_parts: int, store: Storage, ext: str) -> list[str]:
    done = R.committed(paths["parts"], store)
    return [R.part_file(paths["parts"], p, done[p], ext) for p in range(n_parts) if p in done]


def _decide_statuses(
    pool: _Pool, cfg: BuildConfig, store: Storage, paths: dict[str, str], n_parts: int
) -> pa.Table:
    """Every part's rows (this run's and earlier runs'), image dedupe, the status table of every input row."""
    part_files = _part_files(paths, n_parts, store, "parquet")
    parts = store.read_parquet(part_files) if part_files else pa.table({S.UID: pa.array([], pa.string())})
    status = decide_image_duplicates(parts, cfg.dedupe)
    status_table = status_table_of(pool.narrow, pool.status_pre, parts, status)
    store.write_parquet(status_table, paths["status"])
    n_input = pool.narrow.num_rows
    if status_table.num_rows != n_input:
        raise RuntimeError(f"accounting: {status_table.num_rows} statuses for {n_input} input rows")
    return status_table


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
        from pipeline.langid import LanguageId

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
    (pipeline/filter_reuse.py)."""
    specs = parse_filter_specs(list(cfg.filters.names), "filters.names")
    stamp = FR.filter_stamp(cfg, specs, status_table, store)
    earlier = FR.reusable(stamp, paths, store)
    if earlier is not None:
        log(f"filters: metadata, filters and statuses unchanged; reusing {len(earlier['subsets'])} subsets")
        return earlier["sizes"], earlier["subsets"]
    FR.forget(paths, store)
    meta = _collect(pool.ds, _FILTER_COLUMNS) if pool.narrow.num_rows else _empty(pool.ds, _FILTER_COLUMNS)
    lang = _language_labels(pool, cfg, meta) if needs_language(specs) and meta.num_rows else None
    results = apply_filters(meta, cfg.filters, lang=lang, store=store) if meta.num_rows else {}
    live = SR.LiveRows.of(pool.narrow, pool.live(), status_table)
    live_rows = live.rows(meta)
    success = SR.eligible(live, meta, live_rows)
    listable = SR.listable(meta, live_rows)
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


def _language_labels(pool: _Pool, cfg: BuildConfig, meta: pa.Table) -> pa.Array:
    """fastText's label of every row of ``meta`` (in its order), predicted in one Ray actor."""
    import ray.data

    lang_ds = pool.ds.select_columns([S.UID, S.TEXT, ROW_KEY]).map_batches(
        _LangTag,
        fn_constructor_args=(cfg.filters.language_model,),
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_format="pyarrow",
    )
    return SR.align_labels(meta, _collect(lang_ds, [S.UID, ROW_KEY, "lang"]))


def _remove_stale_subsets(subsets: dict[str, str], paths: dict[str, str], store: Storage) -> None:
    """A subset an earlier build run wrote for a filter no longer asked for is not derived from this run's
    statuses: remove it. Only the build's own (listed in work/): other jobs write subsets here too.
    Names, not paths: a run directory that was copied or moved must never reach back into the original."""
    listed = storage.join(paths["work"], "subsets.json")
    before = store.read_json(listed) if store.exists(listed) else []
    stale = {os.path.basename(str(p)) for p in before} - {f"{n}.npy" for n in subsets}
    store.remove_files([storage.join(paths["subsets"], n) for n in sorted(stale)])
    store.write_json(sorted(f"{n}.npy" for n in subsets), listed)


def _empty(ds, columns: list[str]) -> pa.Table:
    """A zero-row table of ``columns`` with the dataset's types where it has them (an empty pool)."""
    try:
        sch = _arrow_schema(ds)
    except Exception:  # noqa: BLE001 - Ray may not know the schema of an empty dataset
        sch = pa.schema([])
    fields = [sch.field(c) if c in sch.names else pa.field(c, pa.string()) for c in columns]
    return pa.schema(fields).empty_table()


def train_build_tokenizer(
    pool: _Pool, status_table: pa.Table, cfg: BuildConfig, log, store: Storage = LOCAL
) -> str:
    """Offline BPE tokenizer on the captions of successful rows, saved beside the shards for training."""
    import tempfile

    from pipeline.tokenizer import train_tokenizer

    meta = _collect(pool.ds, [S.UID, S.TEXT, ROW_KEY])
    ok = SR.eligible(SR.LiveRows.of(pool.narrow, pool.live(), status_table), meta)
    texts = pc.filter(meta.column(S.TEXT), pa.array(ok, pa.bool_()))
    captions = [t for t in texts.to_pylist() if t]
    tok = train_tokenizer(captions, vocab_size=cfg.tokenizer_vocab)
    out = storage.join(cfg.output, "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as fh:
                store.write_bytes(fh.read(), storage.join(out, name))
    log(f"tokenizer: BPE vocab {tok.vocab_size} trained on {len(captions)} captions → {out}")
    return out
