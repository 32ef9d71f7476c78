"""Compose the dataset build from the pure stages: metadata → dedupe → download parts → shards → subsets.

The one Ray-aware module of the build. Global decisions (URL, exact-image and near-duplicate dedupe; filter
thresholds over the whole pool) are made in the driver on narrow columns (uid, url, hashes: ~100 bytes a row,
≈1.3 GB for DataComp small's 12.8M rows); everything that touches bytes or models runs in Ray Data.

Resume unit = a download *part*: rows are bucketed by the top 32 bits of their (random) uid into
``ceil(n / part_size)`` parts, so the assignment depends only on the metadata. A part writes its tar, its
per-row parquet and finally a ``.done`` marker; a re-run skips parts with a marker. Final shards, the
status table and the subsets are derived from the parts each run, so a resumed build ends with exactly the
uid set an uninterrupted one would.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline import storage
from pipeline.config import BuildConfig, DownloadConfig
from pipeline.dedupe import exact_duplicates, near_duplicates, url_duplicates
from pipeline.download import DownloadWorker
from pipeline.filtering import apply_filters, needs_language, parse_filter_specs
from pipeline.placement import scope_dataset
from pipeline.reshard import ReshardResult, reshard
from pipeline.shards import write_shard
from pipeline.storage import LOCAL, Storage
from pipeline.subset import write_subset

STATUS_INVALID_UID = S.STATUS_INVALID_UID
STATUS_DUPLICATE_UID = S.STATUS_DUPLICATE_UID
_PART_COLUMNS = [
    S.UID,
    S.STATUS,
    "error",
    S.WIDTH,
    S.HEIGHT,
    S.ORIGINAL_WIDTH,
    S.ORIGINAL_HEIGHT,
    S.IMAGE_SHA256,
    S.PHASH,
]
_FILTER_COLUMNS = [S.UID, S.TEXT, S.ORIGINAL_WIDTH, S.ORIGINAL_HEIGHT, S.CLIP_B32, S.CLIP_L14]


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
    # per subset: "metadata" = pool uids that pass (DataComp's count), "downloaded" = those in the shards
    subset_sizes: dict[str, dict[str, int]] = field(default_factory=dict)


# --- paths --------------------------------------------------------------------------------------------


def run_paths(output: str) -> dict[str, str]:
    return {
        "parts": storage.join(output, "work", "parts"),
        "shards": storage.join(output, "shards"),
        "subsets": storage.join(output, "subsets"),
        "status": storage.join(output, "metadata", "status.parquet"),
        "filters": storage.join(output, "metadata", "filters.parquet"),
    }


def part_stem(parts_dir: str, part: int) -> str:
    return storage.join(parts_dir, f"part-{part:06d}")


def part_of(uids: pa.Array, n_parts: int) -> np.ndarray:
    """Part index of each uid: top 32 bits of the uid scaled to ``n_parts`` (uids are uniform random hex)."""
    top = np.array([int(u[:8], 16) for u in uids.to_pylist()], dtype=np.uint64)
    return ((top * np.uint64(n_parts)) >> np.uint64(32)).astype(np.int64)


# --- metadata -----------------------------------------------------------------------------------------


def read_metadata(path: str, store: Storage = LOCAL):
    """A Ray Dataset over the metadata parquet files; schema errors stop here, before any download."""
    import ray.data

    files = store.list_files(path, suffix=".parquet")
    if not files:
        raise FileNotFoundError(f"metadata: no parquet files at {path}")
    fs, fs_paths = store.filesystem_for(files)
    ds = ray.data.read_parquet(fs_paths, filesystem=fs)
    S.validate_metadata_schema(_arrow_schema(ds))
    return ds


def _arrow_schema(ds) -> pa.Schema:
    sch = ds.schema()
    base = getattr(sch, "base_schema", None)
    if isinstance(base, pa.Schema):
        return base
    return pa.schema([pa.field(n, t) for n, t in zip(sch.names, sch.types, strict=True)])


def _collect(ds, columns: list[str]) -> pa.Table:
    import ray

    present = [c for c in columns if c in _arrow_schema(ds).names]
    refs = ds.select_columns(present).to_arrow_refs()
    tables = [t for t in ray.get(refs) if t.num_rows]
    if not tables:
        return pa.table({c: pa.array([], pa.string()) for c in present})
    return pa.concat_tables(tables, promote_options="permissive")


def pre_statuses(uids: pa.Array, urls: pa.Array) -> np.ndarray:
    """Statuses decided before any download: invalid uid, repeated uid, duplicate URL ("" = go on)."""
    n = len(uids)
    status = np.full(n, "", dtype=object)
    uid_list = uids.to_pylist()
    valid = np.array([S.is_valid_uid(u) for u in uid_list], dtype=bool)
    status[~valid] = STATUS_INVALID_UID
    seen: set[str] = set()
    for i in np.flatnonzero(valid):
        if uid_list[i] in seen:
            status[i] = STATUS_DUPLICATE_UID
        seen.add(uid_list[i])
    live = status == ""
    idx = np.flatnonzero(live)
    url_list = urls.to_pylist()
    dup = url_duplicates(np.array([uid_list[i] for i in idx], dtype=object), [url_list[i] for i in idx])
    status[idx[np.asarray(dup, dtype=bool)]] = S.STATUS_DUPLICATE_URL
    return status


# --- download parts (Ray actors) ----------------------------------------------------------------------


class DownloadPart:
    """Ray Data UDF: one group = one part. Downloads it, writes tar + parquet + marker, returns the rows."""

    def __init__(self, download: DownloadConfig, parts_dir: str, store: Storage = LOCAL):
        self.worker = DownloadWorker(download)
        self.parts_dir = parts_dir
        self.store = store

    def __call__(self, rows: pa.Table) -> pa.Table:
        part = int(rows.column("part")[0].as_py())
        rows = rows.sort_by(S.UID)
        first = np.unique(np.array(rows.column(S.UID).to_pylist(), dtype=object), return_index=True)[1]
        rows = rows.take(pa.array(np.sort(first)))  # a repeated uid is downloaded once
        out = self.worker(rows)
        out = out if isinstance(out, pa.Table) else pa.table(out)
        stem = part_stem(self.parts_dir, part)
        samples = _samples(rows, out)
        write_shard(stem + ".tar", samples, self.store)
        summary = out.select([c for c in _PART_COLUMNS if c in out.column_names])
        self.store.write_parquet(summary, stem + ".parquet")
        self.store.write_bytes(b"", stem + ".done")
        return summary.append_column("part", pa.array([part] * summary.num_rows, pa.int64()))


def _samples(rows: pa.Table, out: pa.Table) -> list[dict]:
    statuses = out.column(S.STATUS).to_pylist()
    keep = [i for i, s in enumerate(statuses) if s == S.STATUS_SUCCESS]
    meta = rows.to_pylist()
    res = out.to_pylist()
    samples = []
    for i in keep:
        m, r = meta[i], res[i]
        info = {
            "uid": m[S.UID],
            "url": m[S.URL],
            "caption": m.get(S.TEXT),
            "width": r[S.WIDTH],
            "height": r[S.HEIGHT],
            "original_width": r[S.ORIGINAL_WIDTH],
            "original_height": r[S.ORIGINAL_HEIGHT],
            "sha256": r[S.IMAGE_SHA256],
            "key": m[S.UID],
        }
        samples.append({"key": m[S.UID], "jpg": r[S.IMAGE], "txt": m.get(S.TEXT) or "", "json": info})
    return samples


def _done_parts(parts_dir: str, store: Storage) -> set[int]:
    done = set()
    for path in store.list_files(parts_dir, suffix=".done"):
        name = path.rsplit("/", 1)[-1]
        done.add(int(name[len("part-") : -len(".done")]))
    return done


def _check_plan(parts_dir: str, n_parts: int, n_rows: int, store: Storage) -> None:
    """A resumed build must cut the same parts; a different pool in the same output is refused."""
    path = storage.join(parts_dir, "plan.json")
    plan = {"n_parts": n_parts, "n_rows": n_rows}
    if store.exists(path):
        old = store.read_json(path)
        if old != plan:
            raise ValueError(
                f"{path}: output holds parts of another build ({old}); now {plan}. Use a new output."
            )
    else:
        store.write_json(plan, path)


# --- the build ----------------------------------------------------------------------------------------


@dataclass
class _Pool:
    """The metadata as read once: the dataset, its (uid, url) columns and the pre-download statuses."""

    ds: Any  # ray.data.Dataset (Ray is imported lazily here)
    narrow: pa.Table
    status_pre: np.ndarray  # "" = goes on to download


def build(cfg: BuildConfig, log: Callable[[str], None] = print, store: Storage | None = None) -> BuildResult:
    """Run the whole build for ``cfg`` (Ray must be initialised). Idempotent; resumes at part granularity.

    ``store``: the run's storage as the job built it; by default resolved here, once, from ``cfg.s3_endpoint``.
    """
    store = store if store is not None else Storage.from_env(cfg.s3_endpoint)
    paths = run_paths(cfg.output)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pool = _read_pool(cfg, store, log)
    timings["metadata_and_url_dedupe"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    n_parts, done = _download_parts(pool, cfg, store, paths, log)
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
    subset_sizes, subsets = run_filters(pool.ds, cfg, status_table, paths, log, store)
    scope = cfg.filters.subset_scope
    timings["filters"] = time.perf_counter() - t4
    if cfg.tokenizer_vocab > 0:
        train_build_tokenizer(pool.ds, status_table, cfg, log, store)
    timings["total"] = time.perf_counter() - t0
    return BuildResult(
        output=cfg.output,
        n_input=pool.narrow.num_rows,
        status_counts=dict(sorted(counts.items())),
        filter_counts={name: sizes[scope] for name, sizes in subset_sizes.items()},
        subsets=subsets,
        shards=list(res.shards),
        parts_done_before=len(done),
        timings=timings,
        subset_sizes=subset_sizes,
    )


def _read_pool(cfg: BuildConfig, store: Storage, log: Callable[[str], None]) -> _Pool:
    """Read and validate the metadata; decide invalid/repeated uids and duplicate URLs in the driver."""
    ds = scope_dataset(
        read_metadata(cfg.metadata, store), cfg.data_label_selector
    )  # derived datasets inherit
    narrow = _collect(ds, [S.UID, S.URL])
    status_pre = pre_statuses(narrow.column(S.UID), narrow.column(S.URL))
    log(f"metadata: {narrow.num_rows} rows; {int((status_pre != '').sum())} decided before download")
    return _Pool(ds, narrow, status_pre)


def _download_parts(
    pool: _Pool, cfg: BuildConfig, store: Storage, paths: dict[str, str], log: Callable[[str], None]
) -> tuple[int, set[int]]:
    """Download the parts not done yet (Ray actors); returns the number of parts and those done before."""
    import ray.data

    narrow, status_pre = pool.narrow, pool.status_pre
    live_uids = pc.filter(narrow.column(S.UID), pa.array(status_pre == ""))
    n_parts = max(1, math.ceil(len(live_uids) / cfg.part_size))
    store.makedirs(paths["parts"])
    _check_plan(paths["parts"], n_parts, len(live_uids), store)
    done = _done_parts(paths["parts"], store)
    log(f"download: {n_parts} parts of ≤~{cfg.part_size} rows, {len(done)} already done")
    todo_parts = n_parts - len(done)
    if todo_parts <= 0:
        return n_parts, done
    # Ship the (few) excluded uids to the tasks, not the (many) live ones. A repeated uid stays in: both
    # rows land in the same part, where DownloadPart keeps one.
    excluded = set(
        pc.filter(narrow.column(S.UID), pa.array(np.isin(status_pre, [S.STATUS_DUPLICATE_URL]))).to_pylist()
    )

    def tag(batch: pa.Table) -> pa.Table:
        uids = batch.column(S.UID).to_pylist()
        keep = np.array([S.is_valid_uid(u) and u not in excluded for u in uids], dtype=bool)
        batch = batch.filter(pa.array(keep))
        parts = part_of(batch.column(S.UID), n_parts) if batch.num_rows else np.zeros(0, np.int64)
        batch = batch.append_column("part", pa.array(parts, pa.int64()))
        return batch.filter(pa.array(~np.isin(parts, list(done))))

    # Few shuffle partitions: a part is the unit of work, more partitions than parts is pure overhead.
    grouped = pool.ds.map_batches(tag, batch_format="pyarrow").groupby(
        "part", num_partitions=min(todo_parts, 64)
    )
    results = grouped.map_groups(
        DownloadPart,
        # The Storage object travels to the actors with its credentials: their processes need no AWS env.
        fn_constructor_args=(cfg.download, paths["parts"], store),
        compute=ray.data.ActorPoolStrategy(size=max(1, cfg.download_actors)),
        # Downloads mostly wait on the network: a fractional CPU leaves room for the read and shuffle
        # tasks (a whole CPU per actor deadlocks a 2-CPU machine).
        num_cpus=cfg.download_cpus,
        batch_format="pyarrow",
    )
    finished = 0
    for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
        finished += len(set(batch.column("part").to_pylist()))
        ok = pc.sum(pc.equal(batch.column(S.STATUS), S.STATUS_SUCCESS)).as_py() or 0
        log(f"  part(s) done: {finished}/{todo_parts} (+{batch.num_rows} rows, {ok} images)")
    return n_parts, done


def _decide_statuses(
    pool: _Pool, cfg: BuildConfig, store: Storage, paths: dict[str, str], n_parts: int
) -> pa.Table:
    """Every part's rows (this run's and earlier runs'), image dedupe, the status table of every input row."""
    part_files = [part_stem(paths["parts"], p) + ".parquet" for p in range(n_parts)]
    part_files = [p for p in part_files if store.exists(p)]
    parts = store.read_parquet(part_files) if part_files else pa.table({S.UID: pa.array([], pa.string())})
    status = decide_image_duplicates(parts, cfg)
    status_table = _status_table(pool.narrow, pool.status_pre, parts, status)
    store.write_parquet(status_table, paths["status"])
    n_input = pool.narrow.num_rows
    if status_table.num_rows != n_input:
        raise RuntimeError(f"accounting: {status_table.num_rows} statuses for {n_input} input rows")
    return status_table


def _write_shards(
    status_table: pa.Table, cfg: BuildConfig, store: Storage, paths: dict[str, str], n_parts: int
) -> ReshardResult:
    """The final shards: the successful uids resharded out of the download parts."""
    success = pc.filter(status_table.column(S.UID), pc.equal(status_table.column(S.STATUS), S.STATUS_SUCCESS))
    success_pairs = np.sort(S.uids_to_u8pairs(success.to_pylist()))
    part_tars = [part_stem(paths["parts"], p) + ".tar" for p in range(n_parts)]
    part_tars = [p for p in part_tars if store.exists(p)]
    return reshard(
        part_tars,
        success_pairs,
        paths["shards"],
        samples_per_shard=cfg.samples_per_shard,
        store=store,
        overwrite=True,
    )


def decide_image_duplicates(parts: pa.Table, cfg: BuildConfig) -> np.ndarray:
    """Per part row: its download status, with exact and near duplicates among successes re-labelled."""
    if parts.num_rows == 0:
        return np.zeros(0, dtype=object)
    status = np.array(parts.column(S.STATUS).to_pylist(), dtype=object)
    ok = np.flatnonzero(status == S.STATUS_SUCCESS)
    uids = np.array(parts.column(S.UID).to_pylist(), dtype=object)[ok]
    sha = np.array(parts.column(S.IMAGE_SHA256).to_pylist(), dtype=object)[ok]
    exact = np.asarray(exact_duplicates(uids, sha), dtype=bool)
    status[ok[exact]] = S.STATUS_DUPLICATE_IMAGE
    if cfg.dedupe.near_duplicates:
        rest = ok[~exact]
        # take() keeps int64: to_numpy() on a column with nulls would turn the hashes into lossy floats.
        ph = parts.column(S.PHASH).take(pa.array(rest, pa.int64()))
        rest_uids = np.array(parts.column(S.UID).to_pylist(), dtype=object)[rest]
        near = np.asarray(near_duplicates(rest_uids, ph, cfg.dedupe.phash_threshold), dtype=bool)
        status[rest[near]] = S.STATUS_NEAR_DUPLICATE
    return status


def _status_table(narrow: pa.Table, pre: np.ndarray, parts: pa.Table, part_status: np.ndarray) -> pa.Table:
    decided = np.flatnonzero(pre != "")
    pre_tab = pa.table(
        {
            S.UID: pc.take(narrow.column(S.UID), pa.array(decided, pa.int64())),
            S.STATUS: pa.array(pre[decided].tolist(), pa.string()),
            "error": pa.array([""] * len(decided), pa.string()),
        }
    )
    if parts.num_rows == 0:
        return pre_tab
    errors = parts.column("error") if "error" in parts.column_names else pa.array([""] * parts.num_rows)
    part_tab = pa.table(
        {
            S.UID: parts.column(S.UID),
            S.STATUS: pa.array(part_status.tolist(), pa.string()),
            "error": pc.fill_null(errors.cast(pa.string()), ""),
        }
    )
    extra = [c for c in (S.WIDTH, S.HEIGHT, S.IMAGE_SHA256) if c in parts.column_names]
    for c in extra:
        part_tab = part_tab.append_column(c, parts.column(c))
    return pa.concat_tables([pre_tab, part_tab], promote_options="permissive").sort_by(S.UID)


# --- filters and subsets ------------------------------------------------------------------------------


class _LangTag:
    """Ray Data UDF: fastText language label per caption, the model loaded once per actor."""

    def __init__(self, model_path: str = "") -> None:
        from pipeline.langid import LanguageId

        self.lid = LanguageId(model_path or None)

    def __call__(self, batch: pa.Table) -> pa.Table:
        labels, _scores = self.lid(batch.column(S.TEXT).to_pylist())
        return pa.table({S.UID: batch.column(S.UID), "lang": pa.array(list(labels), pa.string())})


def run_filters(
    ds, cfg: BuildConfig, status_table: pa.Table, paths: dict[str, str], log, store: Storage = LOCAL
) -> tuple[dict, dict]:
    """Apply each requested filter to the whole pool. A subset lists the passing uids of its
    ``filters.subset_scope``: all of them ("metadata", DataComp's filter outputs) or the downloaded ones.
    Returns each subset's sizes in both scopes, and its path."""
    import ray.data

    meta = _collect(ds, _FILTER_COLUMNS)
    lang = None
    if needs_language(parse_filter_specs(list(cfg.filters.names), "filters.names")):
        lang_ds = ds.select_columns([S.UID, S.TEXT]).map_batches(
            _LangTag,
            fn_constructor_args=(cfg.filters.language_model,),
            compute=ray.data.ActorPoolStrategy(size=1),
            batch_format="pyarrow",
        )
        lang_tab = _collect(lang_ds, [S.UID, "lang"])
        order = {u: i for i, u in enumerate(lang_tab.column(S.UID).to_pylist())}
        idx = [order[u] for u in meta.column(S.UID).to_pylist()]
        lang = np.array(lang_tab.column("lang").to_pylist(), dtype=object)[idx]
    results = apply_filters(meta, cfg.filters, lang=lang, store=store)

    uids = meta.column(S.UID).to_pylist()
    success, listable = _subset_eligibility(uids, status_table)
    eligible = listable if cfg.filters.subset_scope == "metadata" else success
    columns: dict[str, pa.Array] = {S.UID: meta.column(S.UID)}
    sizes, subsets = {}, {}
    store.makedirs(paths["subsets"])
    for name, res in results.items():
        keep = np.asarray(res.keep, dtype=bool)
        columns[f"keep_{name}"] = pa.array(keep)
        columns[f"reason_{name}"] = pa.array([str(r) for r in res.reason], pa.string())
        chosen = [u for u, k in zip(uids, keep & eligible, strict=True) if k]
        path = storage.join(paths["subsets"], f"{name}.npy")
        with store.open_output(path) as fh:
            write_subset(chosen, fh)
        sizes[name] = {"metadata": int((keep & listable).sum()), "downloaded": int((keep & success).sum())}
        subsets[name] = path
        log(
            f"filter {name}: {int(keep.sum())} of {len(keep)} pool rows pass; {cfg.filters.subset_scope} "
            f"subset {len(chosen)} uids, {sizes[name]['downloaded']} of them downloaded"
        )
    store.write_parquet(pa.table(columns), paths["filters"])
    return sizes, subsets


def _subset_eligibility(uids: list[str], status_table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per filter row: did its uid download (it is in the shards), and may a metadata-scope subset list it
    (a valid uid, on its first row: DataComp lists each uid once; an invalid one has no u8,u8 form)."""
    status_of = dict(
        zip(status_table.column(S.UID).to_pylist(), status_table.column(S.STATUS).to_pylist(), strict=True)
    )
    success = np.array([status_of.get(u) == S.STATUS_SUCCESS for u in uids], dtype=bool)
    seen: set[str] = set()
    listable = np.zeros(len(uids), dtype=bool)
    for i, u in enumerate(uids):
        if S.is_valid_uid(u) and u not in seen:
            listable[i] = True
            seen.add(u)
    return success & listable, listable


def train_build_tokenizer(ds, status_table: pa.Table, cfg: BuildConfig, log, store: Storage = LOCAL) -> str:
    """Offline BPE tokenizer on the captions of successful rows, saved beside the shards for training."""
    import tempfile

    from pipeline.tokenizer import train_tokenizer

    meta = _collect(ds, [S.UID, S.TEXT])
    ok = set(
        pc.filter(
            status_table.column(S.UID), pc.equal(status_table.column(S.STATUS), S.STATUS_SUCCESS)
        ).to_pylist()
    )
    captions = [
        t
        for u, t in zip(meta.column(S.UID).to_pylist(), meta.column(S.TEXT).to_pylist(), strict=True)
        if u in ok and t
    ]
    tok = train_tokenizer(captions, vocab_size=cfg.tokenizer_vocab)
    out = storage.join(cfg.output, "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as fh:
                store.write_bytes(fh.read(), storage.join(out, name))
    log(f"tokenizer: BPE vocab {tok.vocab_size} trained on {len(captions)} captions → {out}")
    return out


# --- the demo source ----------------------------------------------------------------------------------


class demo_source:
    """Context manager: with ``cfg.metadata`` empty, generate the demo pool, serve it on 127.0.0.1 and
    yield a config pointing at its metadata; the server is stopped on exit."""

    def __init__(self, cfg: BuildConfig, log: Callable[[str], None] = print):
        self.cfg, self.log, self.server = cfg, log, None

    def __enter__(self) -> BuildConfig:
        import dataclasses

        if self.cfg.metadata:
            return self.cfg
        from pipeline.demo.pool import generate_pool, write_metadata
        from pipeline.demo.server import serve_pool

        pool_dir = storage.join(self.cfg.output, "pool")
        t = time.perf_counter()
        generate_pool(pool_dir, n=self.cfg.demo_n, seed=self.cfg.demo_seed)
        self.server = serve_pool(pool_dir)
        meta = write_metadata(pool_dir, self.server.base_url)
        self.log(
            f"demo pool: {self.cfg.demo_n} rows served at {self.server.base_url} ({time.perf_counter() - t:.1f}s)"
        )
        return dataclasses.replace(self.cfg, metadata=str(meta))

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
