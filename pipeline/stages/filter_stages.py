"""The build's filters and subsets, as tasks per uid bucket, exact for whole-pool thresholds.

Most of DataComp's rules decide a row from its own columns (``basic``, ``english``, ``text_based``,
``laion2b``, ``clip_score`` by threshold, ``image_based``): each bucket task runs them as
``filters.specs.run_filters`` does over the whole pool. Four cut the pool at a rank, found first, exactly,
by a radix selection over the buckets (``Cut``; each pass one task per bucket returning the counts of one
8-bit digit, until at most ``GATHER`` keys are left, which one more pass fetches), then applied per bucket:
``clip_score`` by fraction (DataComp's ``get_threshold``: the ``int(N·f)``-th largest score of all ``N``
rows, then the threshold rule); ``random`` (the ``round(f·N)`` rows of smallest (hash of seed and uid, uid
bytes)); ``norm_sim`` (the ``round(f·N)`` top scores of the ``N`` rows with an embedding, ties by uid)
and ``neg_clip_loss`` (the same rule, its batches drawn per uid range: decision 0098), over the scores
``stages/score_stages.py`` wrote. Each bucket writes its piece of ``metadata/filters.parquet`` and of
each subset; one task per subset joins them into DataComp's sorted ``u8,u8`` ``.npy`` in bucket order."""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import storage
from pipeline.config import FilterConfig
from pipeline.dedup.curation_stage import leaked_rows
from pipeline.filters import base
from pipeline.filters import datacomp as F
from pipeline.filters.base import float_column
from pipeline.filters.registry import FILTERS, Context
from pipeline.filters.specs import needs_language, parse_filter_specs, resolve_params
from pipeline.stages import score_stages as SS
from pipeline.stages.row_stages import FILE, PRE, ROW
from pipeline.stages.status_stages import Finish
from pipeline.subsets import eligibility as SR
from pipeline.subsets.uid_files import arrow_u8pairs

DIGIT = 8  # bits of a selection pass: a bucket's summary holds at most 2**8 counts
GATHER = 4096  # keys under a prefix few enough to fetch themselves


@dataclass(frozen=True)
class Cut:
    """One whole-pool cut: ``rank`` counts from 0 in ascending key order (``_keys``) among the keys under
    ``prefix`` (its leading ``bits``); ``gather``: the next pass returns those keys themselves (few
    enough); ``value`` once found, and for ``random`` the uids taken among the rows holding it. ``none``:
    no row reaches the cut (a ``random`` of 0 rows, or a ``clip_score`` rank among the unscored rows:
    DataComp's NaN threshold)."""

    rank: int
    prefix: int = 0
    bits: int = 0
    gather: bool = False
    value: int | None = None
    ties: tuple[str, ...] | None = None
    none: bool = False

    @property
    def done(self) -> bool:
        return self.none or (self.value is not None and self.ties is not None)


@dataclass(frozen=True)
class FilterJob:
    finish: Finish
    names: tuple[str, ...]  # the build's filter specs
    filters: FilterConfig
    metadata: tuple[str, ...]  # the pool's files (DataComp's embeddings sit beside them)
    n_rows: int
    filters_dir: str  # metadata/filters.parquet (a directory of one file per uid bucket)
    cuts: dict[str, Cut] = field(default_factory=dict)

    @property
    def specs(self):
        return parse_filter_specs(list(self.names), "filters.names")

    def piece(self, label: str, b: int) -> str:
        return self.finish.parts.at("subsets", label, f"{b:05d}.u8u8")

    def filters_file(self, b: int) -> str:
        return storage.join(self.filters_dir, f"{b:05d}.parquet")

    def vectors_file(self, q: int, s: int, block: int) -> str:
        return self.finish.parts.at("embedding_scores", f"{q:03d}", f"{s:06d}-{block:04d}.bkt")

    def group_file(self, q: int, g: int) -> str:
        return self.finish.parts.at("embedding_groups", f"{q:03d}", f"{g:06d}.bkt")

    def scores_file(self, q: int, s: int) -> str:
        return self.finish.parts.at("embedding_scores", f"{q:03d}", f"{s:06d}.bkt")


def cut_keys(job: FilterJob) -> dict[str, tuple[str, dict]]:
    """key → (filter, parameters) of every whole-pool cut the specs need."""
    out = {}
    for spec in job.specs:
        for name, given in spec.parts:
            params = resolve_params(name, given)
            if (name == "clip_score" and params["fraction"] > 0) or name in ("random", *SS.RANKED):
                out[SS.cut_key(name, params)] = (name, params)
    return out


def _keys(table: pa.Table, name: str, params: dict) -> np.ndarray:
    """The uint64 key whose ascending order is the cut's order (NaN scores left out: the caller masks)."""
    if name == "random":
        return F.uid_hash(base.table_column(table, S.UID, "random"), params["seed"])
    column = SS.score_column(SS.cut_key(name, params)) if name in SS.RANKED else params["column"]
    return SS.descending_keys(float_column(table, column, name))


def _bucket_table(job: FilterJob, b: int) -> pa.Table:
    t = job.finish.parts.store.read_parquet(job.finish.pool_rows(b))
    return SS.with_scores(job, t, b) if SS.streamed(job) else t


def count_digits(job: FilterJob, b: int) -> dict:
    """One selection pass for bucket ``b`` (``cut_summary`` of its rows)."""
    return cut_summary(job, _bucket_table(job, b))


def cut_summary(job: FilterJob, t: pa.Table) -> dict:
    """Per unfinished cut, the keys of ``t``'s rows under its prefix counted by their next ``DIGIT`` bits,
    or (``gather``) the keys themselves with their uids."""
    out: dict[str, Any] = {}
    for key, (name, params) in cut_keys(job).items():
        cut = job.cuts[key]
        if cut.done or not t.num_rows:
            continue
        k, uids = _keys(t, name, params), t.column(S.UID)
        if name != "random":
            column = SS.score_column(key) if name in SS.RANKED else params["column"]
            scored = ~np.isnan(float_column(t, column, name))
            k, uids = k[scored], uids.filter(pa.array(scored))
        if cut.bits:
            under = (k >> np.uint64(64 - cut.bits)) == np.uint64(cut.prefix)
            k, uids = k[under], uids.filter(pa.array(under))
        if cut.gather:
            out[key] = [[int(v), u] for v, u in zip(k.tolist(), uids.to_pylist(), strict=True)]
            continue
        digits, counts = np.unique((k << np.uint64(cut.bits)) >> np.uint64(64 - DIGIT), return_counts=True)
        out[key] = {str(int(d)): int(c) for d, c in zip(digits, counts, strict=True)}
    return out


def first_cuts(job: FilterJob) -> dict[str, Cut]:
    """Each cut's rank before the first pass."""
    cuts = {}
    for key, (name, params) in cut_keys(job).items():
        if name == "random":
            k = F.random_count(params["fraction"], job.n_rows)
            cuts[key] = Cut(k - 1, none=k == 0)
        elif name in SS.RANKED:
            cuts[key] = Cut(-1)  # its rank counts the rows with an embedding: known after the first pass
        else:  # clip_fraction_threshold's index; its error where DataComp's rule has no threshold
            F.clip_fraction_threshold(np.zeros(job.n_rows), params["fraction"])
            cuts[key] = Cut(int(job.n_rows * params["fraction"]))
    return cuts


def advance(job: FilterJob, key: str, summaries: list[dict]) -> Cut:
    """The cut after a pass, from every bucket's summary."""
    name, params = cut_keys(job)[key]
    cut = job.cuts[key]
    if cut.gather:
        return _gathered(cut, name, params, [tuple(e) for s in summaries for e in s.get(key, [])])
    total: dict[int, int] = {}
    for s in summaries:
        for d, n in s.get(key, {}).items():
            total[int(d)] = total.get(int(d), 0) + n
    rank = cut.rank
    if rank < 0:  # a streamed filter's top round(f·N) of the N scored rows (embedding.top_fraction)
        n_keep = int(np.floor(params["fraction"] * sum(total.values()) + 0.5))
        if n_keep == 0:
            return replace(cut, none=True)
        rank = n_keep - 1
    if cut.bits == 0 and name == "clip_score" and rank >= sum(total.values()):
        scored = sum(total.values())
        if params["nan_cut"] == "datacomp" or scored == 0:
            return replace(cut, none=True)
        rank = scored - 1  # "all_scored": the smallest score
    for d in sorted(total):
        if rank < total[d]:
            prefix, bits = (cut.prefix << DIGIT) | d, cut.bits + DIGIT
            if bits == 64 and name == "clip_score":  # equal scores: the threshold keeps them all
                return replace(cut, rank=rank, prefix=prefix, bits=bits, value=prefix, ties=())
            return replace(cut, rank=rank, prefix=prefix, bits=bits, gather=bits == 64 or total[d] <= GATHER)
        rank -= total[d]
    raise ValueError(f"cut {key}: rank {cut.rank} past the {sum(total.values())} keys")


def _gathered(cut: Cut, name: str, params: dict, entries: list[tuple[int, str]]) -> Cut:
    """The cut from the keys under its prefix: the value of its rank and, for ``random``, the uids it takes
    among the rows holding that value (``datacomp.random_order``: by uid bytes)."""
    values = np.sort(np.asarray([v for v, _ in entries], np.uint64))
    value = int(values[cut.rank])
    if name == "clip_score":
        return replace(cut, value=value, ties=())
    held = pa.array(sorted(u for v, u in entries if v == value), pa.string())
    taken = cut.rank - int(np.searchsorted(values, np.uint64(value))) + 1
    if name in SS.RANKED:  # equal scores: the smaller uids first
        return replace(cut, value=value, ties=tuple(held.to_pylist()[:taken]))
    order = F.random_order(held, params["seed"])
    return replace(cut, value=value, ties=tuple(held.take(pa.array(order[:taken])).to_pylist()))


def _random_cut(table: pa.Table, params: dict, cut: Cut) -> base.FilterResult:
    if cut.none:
        return base.from_drops(table.num_rows, [(np.ones(table.num_rows, bool), "random_not_selected")])
    key = F.uid_hash(base.table_column(table, S.UID, "random"), params["seed"])
    chosen = key < np.uint64(cut.value)
    chosen |= (key == np.uint64(cut.value)) & pc.is_in(
        table.column(S.UID), value_set=pa.array(list(cut.ties), pa.string())
    ).to_numpy(zero_copy_only=False)
    return base.from_drops(table.num_rows, [(~chosen, "random_not_selected")])


def _clip_cut(table: pa.Table, params: dict, cut: Cut) -> base.FilterResult:
    threshold = float("nan")
    if not cut.none:
        bits = np.uint64(cut.value)
        raw = (bits & ~np.uint64(1 << 63)) if bits >> np.uint64(63) else ~bits
        threshold = float(-np.asarray([raw], np.uint64).view(np.float64)[0])
    return F.clip_score_threshold(table, params["column"], threshold)


def _language(job: FilterJob, table: pa.Table) -> Any:
    from pipeline.filters.language import LanguageId

    global _LID
    if _LID is None or _LID[0] != job.filters.language_model:
        _LID = (job.filters.language_model, LanguageId(job.filters.language_model or None))
    labels, _ = _LID[1](table.column(S.TEXT).to_pylist())
    return pa.array(list(labels), pa.string())


_LID: tuple[str, Any] | None = None  # this process's fastText model


def results(job: FilterJob, table: pa.Table, b: int) -> dict[str, base.FilterResult]:
    """Every spec's result over bucket ``b``'s rows ``table``."""
    specs = job.specs
    lang = _language(job, table) if needs_language(specs) and table.num_rows else None
    ctx = Context(lang, job.finish.parts.store, job.metadata)
    cache: dict[tuple, base.FilterResult] = {}
    out = {}
    for spec in specs:
        parts = []
        for name, given in spec.parts:
            params = resolve_params(name, given)
            key = f"{name}:{sorted(params.items())}"
            if key not in cache:
                if name == "random":
                    cache[key] = _random_cut(table, params, job.cuts[key])
                elif name == "clip_score" and params["fraction"] > 0:
                    cache[key] = _clip_cut(table, params, job.cuts[key])
                elif name in SS.STREAMED:
                    cache[key] = SS.result(table, name, params, job.cuts.get(key), ctx)
                else:
                    cache[key] = FILTERS[name](**params).run(table, ctx)
            parts.append(cache[key])
        out[spec.label] = base.intersect(*parts)
    return out


def filter_bucket(job: FilterJob, b: int) -> dict:
    """Bucket ``b``'s filters: its piece of ``metadata/filters.parquet`` and of each subset; → sizes."""
    store = job.finish.parts.store
    meta = _bucket_table(job, b)
    status = store.read_parquet(job.finish.status_file(b))
    res = results(job, meta, b) if meta.num_rows else {}
    live = SR.LiveRows.of(meta, pc.equal(meta.column(PRE), "").to_numpy(zero_copy_only=False), status)
    live_rows = live.rows(meta) if meta.num_rows else np.zeros(0, bool)
    success = SR.eligible(live, meta, live_rows) if meta.num_rows else live_rows
    listable = (SR.listable(meta, live_rows) & ~leaked_rows(meta, status)) if meta.num_rows else live_rows
    eligible = listable if job.filters.subset_scope == "metadata" else success
    columns = {S.UID: meta.column(S.UID), FILE: meta.column(FILE), ROW: meta.column(ROW)}
    sizes = {}
    for spec in job.specs:
        r = res.get(spec.label, base.FilterResult(np.zeros(0, bool), np.zeros(0, object)))
        keep = np.asarray(r.keep, dtype=bool)
        columns[f"keep_{spec.label}"] = pa.array(keep, pa.bool_())
        columns[f"reason_{spec.label}"] = pa.array(r.reason.tolist(), pa.string())
        chosen = np.sort(arrow_u8pairs(SR.uids_where(meta, keep & eligible)))
        store.write_bytes(chosen.tobytes(), job.piece(spec.label, b))
        sizes[spec.label] = {
            "listed": len(chosen),
            "kept": int(keep.sum()),
            "metadata": len(SR.uids_where(meta, keep & listable)),
            "downloaded": len(SR.uids_where(meta, keep & success)),
        }
    store.write_parquet(pa.table(columns), job.filters_file(b))
    return sizes


def join_task(job: tuple[FilterJob, dict[int, list[int]], str], i: int) -> dict:
    """Spec ``i``'s pieces (``counts[i]`` uids each) as one DataComp subset ``.npy`` in ``subsets_dir``,
    streamed in bucket order (``np.save``'s header, then the pieces' bytes); → its length."""
    fjob, counts, subsets_dir = job
    join_subset(fjob, i, counts[i], storage.join(subsets_dir, f"{fjob.specs[i].label}.npy"))
    return {"uids": sum(counts[i])}


def join_subset(job: FilterJob, i: int, counts: list[int], path: str) -> None:
    label = job.specs[i].label
    store = job.finish.parts.store
    header = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(np.zeros(0, S.UID_DTYPE))
    d["shape"] = (sum(counts),)
    np.lib.format.write_array_header_1_0(header, d)
    with store.open_output(path) as out:
        out.write(header.getvalue())
        for b in range(job.finish.parts.pool.n_buckets):
            out.write(store.read_bytes(job.piece(label, b)))


def _eligible_captions(job: FilterJob, seen: list[int]):
    """The captions of every row that may enter a subset (``eligibility.eligible``), bucket by bucket;
    ``seen[0]`` counts them."""
    store = job.finish.parts.store
    for b in range(job.finish.parts.pool.n_buckets):
        meta = _bucket_table(job, b)
        if not meta.num_rows:
            continue
        status = store.read_parquet(job.finish.status_file(b))
        live = SR.LiveRows.of(meta, pc.equal(meta.column(PRE), "").to_numpy(zero_copy_only=False), status)
        ok = SR.eligible(live, meta)
        for text in pc.filter(meta.column(S.TEXT), pa.array(ok, pa.bool_())).to_pylist():
            if text:
                seen[0] += 1
                yield text


def tokenizer_task(job: tuple[FilterJob, int, str], _key: int = 0) -> dict:
    """A BPE of ``vocab`` tokens on the successful captions (streamed: the trainer keeps word counts),
    saved to ``out``; → its vocabulary size."""
    import os
    import tempfile

    from pipeline.ingest.tokenizer import train_tokenizer

    fjob, vocab, out = job
    store = fjob.finish.parts.store
    seen = [0]
    tok = train_tokenizer(_eligible_captions(fjob, seen), vocab_size=vocab)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as fh:
                store.write_bytes(fh.read(), storage.join(out, name))
    return {"vocab": tok.vocab_size, "captions": seen[0]}


def remove_stale_subsets(subsets: dict[str, str], paths: dict[str, str], store) -> None:
    """A subset an earlier build run wrote for a filter no longer asked for is not derived from this run's
    statuses: remove it. Only the build's own (listed in work/): other jobs write subsets here too.
    Names, not paths: a run directory that was copied or moved must never reach back into the original."""
    import os

    listed = storage.join(paths["work"], "subsets.json")
    before = store.read_json(listed) if store.exists(listed) else []
    stale = {os.path.basename(str(p)) for p in before} - {f"{n}.npy" for n in subsets}
    store.remove_files([storage.join(paths["subsets"], n) for n in sorted(stale)])
    store.write_json(sorted(f"{n}.npy" for n in subsets), listed)
