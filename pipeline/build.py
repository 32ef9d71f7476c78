"""Compose the dataset build: the driver plans, Ray tasks do every per-row step.

The driver holds O(files + parts + buckets): the metadata files' footers, each file's row and live
counts, a marker per download part, per-bucket counts and digests. Every per-row step is a stage of Ray
tasks (pipeline/stages/runner.py) reading and writing per-file and per-bucket datasets under
``work/stages/`` of the output (pipeline/stages/layout.py), each stage resumable on its own:

1. before download (pipeline/stages/row_stages.py): scan each metadata file (row checks, row keys,
   content digests, bucketed by uid); decide each uid bucket (repeated uids, null URLs, bad captions) and
   each URL bucket (DataComp's URL dedupe); each file's live rows and its fingerprint digests. The run
   fingerprint (pipeline/source/run_state.py) folds the per-file digests: another pool, row order or part
   settings are refused.
2. download (pipeline/download/phase.py): the parts not committed yet on ``DownloadPart`` actors; part k
   is the k-th range of ``part_size`` live rows in read order, planned from the files' live counts.
3. after download (pipeline/stages/image_stages.py, status_stages.py): exact and near-duplicate images
   by sha256 and pHash band, the curation stage, then per uid bucket the status table's file, and per
   part group the rows the shards take.
4. the final shards (pipeline/stages/shard_stages.py), one task per window of shards.
5. the filters and subsets (pipeline/stages/filter_stages.py), per uid bucket, whole-pool cuts exact by
   a radix selection; one task joins each subset's pieces; the tokenizer in one task.

Every decision equals the single-process rule over the whole pool (``row_checks.pre_statuses``,
``status_table.decide_image_duplicates``, ``filters.specs.run_filters``): each decomposes by key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig
from pipeline.dedup import curation_stage as CS
from pipeline.download.phase import LivePlan, download_parts
from pipeline.filters import rerun_cache as FR
from pipeline.filters.specs import check_build_filters, parse_filter_specs, required_columns
from pipeline.source import run_state as R
from pipeline.source.content import served_hosts
from pipeline.source.metadata import Metadata, open_metadata
from pipeline.source.output_lock import exclusive
from pipeline.stages import filter_stages as FS
from pipeline.stages import image_stages as IS
from pipeline.stages import row_stages as RS
from pipeline.stages import score_stages as SC
from pipeline.stages import shard_stages as SH
from pipeline.stages import status_stages as ST
from pipeline.stages.layout import VERSION, Parts, Pool, bucket_count, digest
from pipeline.stages.runner import Placement, run_stage

_FILTER_COLUMNS = (S.TEXT, S.ORIGINAL_WIDTH, S.ORIGINAL_HEIGHT, S.CLIP_B32, S.CLIP_L14)


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


@dataclass
class _Run:
    """One build's driver state: its config, storage, log, where its tasks run, its timings."""

    cfg: BuildConfig
    store: Storage
    log: Callable[[str], None]
    placement: Placement
    paths: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)

    def stage(self, root: str, name: str, fn, keys, job) -> dict[int, dict]:
        t = time.perf_counter()
        out = run_stage(root, name, fn, list(keys), job, self.store, self.log, self.placement)
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t
        return out


def build(
    cfg: BuildConfig,
    log: Callable[[str], None] = print,
    store: Storage | None = None,
    allow_hosts: Sequence[str] = (),
) -> BuildResult:
    """Run the whole build for ``cfg`` (Ray must be initialised unless ``download_actors`` is 0).
    Idempotent; resumes each stage where it stopped.

    ``store``: the run's storage as the job built it; by default resolved here, once, from ``cfg.storage``.
    ``allow_hosts``: ``download.allow_hosts`` entries for this run only, outside its config and fingerprint
    (the demo pool's server: pipeline/demo/source.py).
    """
    store = store if store is not None else cfg.storage.store()
    t0 = time.perf_counter()
    meta = open_metadata(cfg.metadata, store)
    for name, columns in zip(meta.files, meta.names, strict=True):
        check_build_filters(cfg.filters, columns, name)
    CS.check_curation(cfg, meta.files, store)
    served = served_hosts([*cfg.download.allow_hosts, *allow_hosts])
    placement = Placement(1.0, dict(cfg.data_label_selector), inline=cfg.download_actors == 0)
    run = _Run(cfg, store, log, placement, run_paths(cfg.output))
    log(f"metadata: {sum(meta.rows)} rows in {len(meta.files)} files")
    # One build per output, from the fingerprint check to the last file (pipeline/source/output_lock.py).
    with exclusive(cfg.output, store, log) as lock:
        result = _build_locked(run, meta, served, lock, allow_hosts)
    result.timings["total"] = time.perf_counter() - t0
    return result


def _pool_layout(run: _Run, meta: Metadata, served: tuple[str, ...]) -> Pool:
    cfg = run.cfg
    specs = parse_filter_specs(list(cfg.filters.names), "filters.names")
    have = {c for names in meta.names for c in names}
    columns = tuple(dict.fromkeys([*_FILTER_COLUMNS, *sorted(required_columns(specs) & have)]))
    files = FR.file_stamps(list(meta.files), run.store)
    key = digest([VERSION, files, cfg.max_caption_bytes, served, columns, cfg.bucket_rows])
    n = bucket_count(sum(meta.rows), cfg.bucket_rows)
    root = storage.join(run.paths["work"], "stages", key)
    return Pool(root, meta.files, meta.rows, n, n, cfg.max_caption_bytes, served, columns, run.store)


def _build_locked(run: _Run, meta: Metadata, served: tuple[str, ...], lock, allow_hosts) -> BuildResult:
    cfg, store, log = run.cfg, run.store, run.log
    pool = _pool_layout(run, meta, served)
    files, buckets = range(len(meta.files)), range(pool.n_buckets)
    scans = run.stage(pool.root, "scan", RS.scan_file, files, pool)
    decided = run.stage(pool.root, "uids", RS.decide_uids, buckets, pool)
    urls = run.stage(pool.root, "urls", RS.decide_urls, range(pool.n_url), pool)
    live = run.stage(pool.root, "live", RS.live_rows, files, pool)
    counts = _pre_counts(decided, urls)
    log(f"metadata: {sum(meta.rows)} rows; {sum(counts.values())} decided before download")
    fp = R.fingerprint(cfg, {
        "rows": sum(meta.rows),
        "uids_sha256": R.digest_of([scans[f]["uid_sha256"] for f in files]),
        "live_sha256": R.digest_of([live[f]["live_sha256"] for f in files]),
        "content_sha256": R.digest_of([live[f]["content_sha256"] for f in files]),
    })  # fmt: skip
    R.claim(cfg, fp, store, log)
    _remove_other_stages(run, pool.root)

    t = time.perf_counter()
    plan = LivePlan(pool, tuple(live[f]["live"] for f in files))
    markers, done, n_retried = download_parts(plan, cfg, store, run.paths, log, allow_hosts)
    lock.check()
    R.record(cfg.output, fp, store)  # every part now holds this pool's content
    run.timings["download"] = time.perf_counter() - t

    parts = _parts_layout(run, pool, markers, plan.n_parts(cfg.part_size))
    finish, curation, status_counts, words = _statuses(run, parts, meta)
    windows = _shards(run, finish)
    sizes, subsets = _filters(run, finish, meta, words)
    if cfg.tokenizer_vocab > 0:
        _tokenizer(run, finish, meta, words)
    scope = cfg.filters.subset_scope
    return BuildResult(
        output=cfg.output,
        n_input=sum(meta.rows),
        status_counts=dict(sorted(status_counts.items())),
        filter_counts={name: s[scope] for name, s in sizes.items()},
        subsets=subsets,
        shards=windows,
        parts_done_before=done,
        timings=run.timings,
        n_retried=n_retried,
        subset_sizes=sizes,
        curation=curation,
    )


def _pre_counts(decided: dict[int, dict], urls: dict[int, dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in decided.values():
        for k, v in s["decided"].items():
            out[k] = out.get(k, 0) + v
    n = sum(s[S.STATUS_DUPLICATE_URL] for s in urls.values())
    return {**out, S.STATUS_DUPLICATE_URL: n} if n else out


def _remove_other_stages(run: _Run, keep: str) -> None:
    """Stage files of other pools or settings (this output's earlier builds): never read again."""
    base = storage.join(run.paths["work"], "stages")
    # Both lists in the form the store lists in (a relative local output comes back absolute).
    kept = set(run.store.list_files(storage.join(keep, "**")))
    run.store.remove_files([p for p in run.store.list_files(f"{base}/**") if p not in kept])


def _parts_layout(run: _Run, pool: Pool, markers: dict[int, R.Marker], n_parts: int) -> Parts:
    cfg = run.cfg
    tokens = tuple(markers[p].token for p in range(n_parts))
    key = digest([tokens, cfg.dedupe, cfg.decontam, cfg.part_size])
    n_live = n_parts * cfg.part_size
    return Parts(
        root=storage.join(pool.root, f"post-{key}"),
        pool=pool,
        parts_dir=run.paths["parts"],
        tokens=tokens,
        group_parts=max(1, cfg.bucket_rows // cfg.part_size),
        n_sha=bucket_count(n_live, cfg.bucket_rows),
        n_band=bucket_count(n_live * (cfg.dedupe.phash_threshold + 1), cfg.bucket_rows),
        phash_threshold=cfg.dedupe.phash_threshold,
        near=cfg.dedupe.near_duplicates,
    )


def _statuses(run: _Run, parts: Parts, meta: Metadata):
    """Image dedupe, curation and the status table; → the statuses' layout, the curation counts, the
    counts per status and the status digest's pieces."""
    cfg, log = run.cfg, run.log
    groups, buckets = range(parts.n_groups), range(parts.pool.n_buckets)
    run.stage(parts.root, "map_parts", IS.map_parts, groups, parts)
    exact = run.stage(parts.root, "exact", IS.exact_dups, range(parts.n_sha), parts)
    near = {}
    if parts.near:
        run.stage(parts.root, "bands", IS.band_rows, buckets, parts)
        run.stage(parts.root, "pairs", IS.near_pairs_of, range(parts.n_band), parts)
        near = run.stage(parts.root, "near", IS.near_greedy, [0], parts)[0]
    curated = bool(cfg.dedupe.semantic or cfg.decontam.reference)
    finish = ST.Finish(parts, run.paths["status"], curated)
    curation: dict[str, object] = {"eval_leaks": {}, "semantic_duplicates": 0, "clusters": 0}
    if curated:
        curation = run.stage(
            parts.root, "curation", ST.curate_parts, [0], ST.Curation(finish, cfg, meta.files)
        )[0]
        log(
            f"curation: eval leaks {curation['eval_leaks']}, {curation['semantic_duplicates']} semantic duplicates"
        )
    run.store.remove_files(  # files of an earlier build with more buckets
        [p for p in run.store.list_files(finish.status_dir, suffix=".parquet")
         if int(p.rsplit("/", 1)[-1].split(".")[0]) >= parts.pool.n_buckets])  # fmt: skip
    done = run.stage(parts.root, "statuses", ST.statuses, buckets, finish)
    counts: dict[str, int] = {}
    for s in done.values():
        for k, v in s["status"].items():
            counts[k] = counts.get(k, 0) + v
    n_dup = sum(s[S.STATUS_DUPLICATE_IMAGE] for s in exact.values())
    log(f"image dedupe: {n_dup} exact duplicates, {near.get(S.STATUS_NEAR_DUPLICATE, 0)} near duplicates")
    if sum(counts.values()) != sum(meta.rows):
        raise RuntimeError(f"accounting: {sum(counts.values())} statuses for {sum(meta.rows)} input rows")
    run.store.write_json(dict(sorted(counts.items())), run.paths["status_counts"])
    return finish, curation, counts, [done[b]["words"] for b in buckets]


def _shards(run: _Run, finish: ST.Finish) -> list[str]:
    """The final shards; → their paths."""
    cfg, store, parts = run.cfg, run.store, finish.parts
    per_part = np.zeros(len(parts.tokens), np.int64)
    for s in run.stage(parts.root, "survivors", ST.group_survivors, range(parts.n_groups), finish).values():
        for p, c in s["parts"].items():
            per_part[int(p)] = c
    starts = tuple(np.concatenate([[0], np.cumsum(per_part)]).tolist())
    job = SH.Windows(parts, run.paths["shards"], cfg.samples_per_shard, starts)
    written = run.stage(
        parts.root, f"shards-{cfg.samples_per_shard}", SH.write_window, range(job.n_windows), job
    )
    sizes = {name: c for w in sorted(written) for name, c in written[w]["shards"].items()}
    store.makedirs(run.paths["shards"])
    stale = [
        p for p in store.list_files(run.paths["shards"]) if SH.is_output(p) and SH.shard_of(p) not in sizes
    ]
    store.remove_files(stale)
    SH.write_summary(run.paths["shards"], sizes, store)
    shards = [storage.join(run.paths["shards"], name) for name in sorted(sizes)]
    run.log(f"shards: {job.total} samples in {len(shards)} shards")
    return shards


def _filter_job(run: _Run, finish: ST.Finish, meta: Metadata) -> FS.FilterJob:
    cfg = run.cfg
    return FS.FilterJob(finish, tuple(cfg.filters.names), cfg.filters, meta.files, sum(meta.rows),
                        storage.join(run.cfg.output, "metadata", "filters.parquet"))  # fmt: skip


def _filters(run: _Run, finish: ST.Finish, meta: Metadata, words) -> tuple[dict, dict]:
    """Each requested filter over the whole pool, a subset per spec (``filters.subset_scope``); reused
    when nothing they derive from changed (pipeline/filters/rerun_cache.py)."""
    cfg, store, paths, log = run.cfg, run.store, run.paths, run.log
    specs = parse_filter_specs(list(cfg.filters.names), "filters.names")
    stamp = FR.filter_stamp(cfg, specs, FR.combine_words(words), store)
    earlier = FR.reusable(stamp, paths, store)
    if earlier is not None:
        log(f"filters: metadata, filters and statuses unchanged; reusing {len(earlier['subsets'])} subsets")
        return earlier["sizes"], earlier["subsets"]
    FR.forget(paths, store)
    job = _filter_job(run, finish, meta)
    root = storage.join(finish.parts.root, "filters-" + digest([cfg.filters, FR.combine_words(words)]))
    if SC.streamed(job):
        run.stage(root, "embedding_scores", SC.embedding_scores, SC.score_tasks(job), job)
    if SC.group_tasks(job):
        run.stage(root, "embedding_groups", SC.group_scores, SC.group_tasks(job), job)
    job = _find_cuts(run, root, job)
    buckets = range(finish.parts.pool.n_buckets)
    done = run.stage(root, "filters", FS.filter_bucket, buckets, job)
    counts = {i: [done[b][s.label]["listed"] for b in buckets] for i, s in enumerate(specs)}
    run.stage(root, "subsets", FS.join_task, range(len(specs)), (job, counts, paths["subsets"]))
    sizes, subsets = {}, {}
    for i, spec in enumerate(specs):
        name = spec.label
        subsets[name] = FR.subset_path(paths, name)
        sizes[name] = {k: sum(done[b][name][k] for b in buckets) for k in ("metadata", "downloaded")}
        kept = sum(done[b][name]["kept"] for b in buckets)
        log(f"filter {name}: {kept} of {sum(meta.rows)} pool rows pass; {cfg.filters.subset_scope} subset "
            f"{sum(counts[i])} uids, {sizes[name]['downloaded']} of them downloaded")  # fmt: skip
    FS.remove_stale_subsets(subsets, paths, store)
    FR.remember(stamp, sizes, subsets, paths, store)
    return sizes, subsets


def _find_cuts(run: _Run, root: str, job: FS.FilterJob) -> FS.FilterJob:
    """The whole-pool cuts, pass by pass (at most four digit passes and a ties pass)."""
    job = replace(job, cuts=FS.first_cuts(job))
    level = 0
    while not all(c.done for c in job.cuts.values()):
        summaries = run.stage(
            root, f"cut-{level}", FS.count_digits, range(job.finish.parts.pool.n_buckets), job
        )
        cuts = {
            k: (c if c.done else FS.advance(job, k, list(summaries.values()))) for k, c in job.cuts.items()
        }
        job = replace(job, cuts=cuts)
        level += 1
    return job


def _tokenizer(run: _Run, finish: ST.Finish, meta: Metadata, words) -> str:
    """Offline BPE tokenizer on the captions of successful rows, saved beside the shards for training."""
    cfg, store = run.cfg, run.store
    out = storage.join(cfg.output, "tokenizer")
    # A re-run with the same captions (metadata files and the status of every row) keeps the tokenizer:
    # training it is the only step of a finished build's re-run that would grow with the pool.
    stamp = {
        "vocab": cfg.tokenizer_vocab,
        "max_caption_bytes": cfg.max_caption_bytes,
        "metadata": FR.file_stamps(list(meta.files), store),
        "status": FR.combine_words(words),
    }
    stamp_file = storage.join(run.paths["work"], "tokenizer_stamp.json")
    if store.exists(stamp_file) and store.read_json(stamp_file) == stamp and store.list_files(out):
        run.log(f"tokenizer: unchanged captions, kept {out}")
        return out
    if store.exists(stamp_file):
        store.remove(stamp_file)
    job = (_filter_job(run, finish, meta), cfg.tokenizer_vocab, out)
    res = run.stage(finish.parts.root, "tokenizer-" + digest(stamp), FS.tokenizer_task, [0], job)[0]
    store.write_json(stamp, stamp_file)
    run.log(f"tokenizer: BPE vocab {res['vocab']} trained on {res['captions']} captions → {out}")
    return out
