"""Materialise a DataComp subset: copy the samples whose uid is in a subset ``.npy`` into new shards.

DataComp's contract (its ``resharder.py``): a filter's decision is a sorted ``u8,u8`` uid array; resharding
is a semi-join of the pool's shards on uid, where a uid listed k times is written k times (up-sampling),
and image/caption bytes are copied as they are (no re-encode). Here:

- **Order** is input order: the input tars in the order given (a directory or glob expands sorted), samples
  in tar order, the k copies of an up-sampled uid consecutive. The same inputs and subset therefore give
  byte-identical shards whatever ``workers`` is.
- **Keys** are img2dataset's: ``{shard:08d}{index:0Wd}`` with W = digits of ``samples_per_shard - 1`` (4 for
  DataComp's 10,000), so copies of one uid get distinct keys; the ``.json`` member keeps the input
  metadata with ``key`` set to the new key (and ``uid`` added if it was only in the old key).
- **uid** of an input sample: its ``.json`` ``uid``, else its key when that is a 32-hex uid (download parts).
- **Counts** are checked: every uid present in the inputs is written exactly its multiplicity times, and
  the shards' total equals that sum. Subset uids absent from the inputs are *missing* — reported (count,
  per-uid arrays, the first ones in ``reshard.json``), not an error. A uid met again in a later input is
  written once only (``n_input_duplicates``).
- **Outputs** beside the shards: one img2dataset ``_stats.json`` per shard, open_clip's ``sizes.json``
  (``pipeline/shards/writer.py``) and the run summary ``reshard.json``.
- **Memory** is bounded by the subset, not the pool: 16 B per subset row while loading, then ~56 B per
  distinct uid (the sorted uids, multiplicity, copies written, first output index), plus one sample in
  flight — or, with ``workers > 1``, the *selected* samples of up to ``workers`` input tars being fetched
  ahead by threads (hides S3 latency; each input is still read exactly once, sequentially). Outputs stream
  to their destination shard by shard.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.checksums import mismatched_members
from pipeline.shards.reader import iter_shard
from pipeline.shards.tar_format import ShardError
from pipeline.shards.writer import SIZES_NAME, RollingWriter
from pipeline.subsets.uid_files import read_subset

SUMMARY_NAME = "reshard.json"
_OUTPUT_FILE = re.compile(rf"^(\d{{8}}\.tar|\d{{8}}_stats\.json|reshard\.json|{re.escape(SIZES_NAME)})$")
_MISSING_IN_SUMMARY = 100


class ReshardError(RuntimeError):
    """The written shards do not account for the subset (a bug, never a missing uid)."""


@dataclass
class ReshardResult:
    n_written: int
    n_missing: int  # distinct subset uids found in no input
    n_missing_rows: int  # subset rows (with multiplicity) of those uids
    shards: list[str]
    uids: np.ndarray  # distinct subset uids, sorted, u8,u8
    expected: np.ndarray  # multiplicity of each uid in the subset
    written: np.ndarray  # copies written (0 when missing, else == expected)
    first_index: np.ndarray  # global output position of the first copy, -1 when missing
    samples_per_shard: int
    n_input_samples: int = 0
    n_input_duplicates: int = 0
    n_unkeyed: int = 0  # input samples with neither a json uid nor a uid key
    corrupt_inputs: list[str] = field(default_factory=list)
    # verify=True: "path key (members)" of each selected sample whose bytes differ from its checksums
    mismatched: list[str] = field(default_factory=list)

    def missing_uids(self) -> list[str]:
        return S.u8pairs_to_uids(self.uids[self.written == 0])

    def keys_of(self, uids: Sequence[str]) -> list[str | None]:
        """Output key of the first copy of each uid (None when missing or not in the subset)."""
        pairs = S.uids_to_u8pairs(list(uids))
        pos = np.searchsorted(self.uids, pairs)
        out: list[str | None] = []
        for p, pair in zip(pos, pairs, strict=True):
            hit = p < len(self.uids) and self.uids[p] == pair and self.first_index[p] >= 0
            out.append(output_key(int(self.first_index[p]), self.samples_per_shard) if hit else None)
        return out


def key_width(samples_per_shard: int) -> int:
    return len(str(max(samples_per_shard - 1, 0)))


def output_key(global_index: int, samples_per_shard: int) -> str:
    """img2dataset-style key of the sample at ``global_index`` of the output: shard number + index in it."""
    shard, index = divmod(global_index, samples_per_shard)
    return f"{shard:08d}{index:0{key_width(samples_per_shard)}d}"


# --- inputs -------------------------------------------------------------------------------------------


def expand_inputs(inputs: str | Sequence[str], store: Storage = LOCAL) -> list[str]:
    """Tar paths in order: files as given, directories and globs expanded (sorted ``*.tar``)."""
    items = [inputs] if isinstance(inputs, str) else list(inputs)
    out: list[str] = []
    for item in items:
        if item.endswith(".tar") and not any(c in item for c in "*?["):
            out.append(item)
        else:
            out.extend(store.list_files(item, suffix=".tar"))
    return out


def load_subset(subset: str | np.ndarray, store: Storage = LOCAL) -> np.ndarray:
    if isinstance(subset, np.ndarray):
        if subset.dtype != S.UID_DTYPE:
            raise ValueError(f"subset array has dtype {subset.dtype}, expected DataComp's u8,u8")
        return subset.reshape(-1)
    with store.open_input(subset, seekable=False) as fh:
        return read_subset(fh, name=subset)


class _Lookup:
    """Sorted distinct subset uids, searched on the high 64 bits then the low (plain uint64 arrays)."""

    def __init__(self, uids: np.ndarray) -> None:
        self.hi = np.ascontiguousarray(uids["f0"])
        self.lo = np.ascontiguousarray(uids["f1"])

    def find(self, uid: str) -> int:
        hi, lo = np.uint64(int(uid[:16], 16)), np.uint64(int(uid[16:], 16))
        i = int(self.hi.searchsorted(hi))
        while i < len(self.hi) and self.hi[i] == hi:
            if self.lo[i] == lo:
                return i
            i += 1
        return -1


def sample_uid_and_meta(sample: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    meta = None
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except ValueError:
            meta = None
        if isinstance(meta, dict) and S.is_valid_uid(meta.get(S.UID)):
            return meta[S.UID].lower(), meta
    key = sample["__key__"]
    if S.is_valid_uid(key):
        return key.lower(), meta if isinstance(meta, dict) else None
    return None, None


@dataclass
class _Scanned:
    """One input's selected samples: (subset index, sample, parsed json) plus its counters."""

    path: str
    selected: Iterator[tuple[int, dict[str, Any], dict[str, Any] | None]] | list
    counts: dict[str, int] = field(default_factory=lambda: {"samples": 0, "unkeyed": 0})
    corrupt: str = ""
    mismatched: list[str] = field(default_factory=list)


def _select(path: str, lookup: _Lookup, scanned: _Scanned, store: Storage, skip_corrupt: bool, verify: bool):
    try:
        for sample in iter_shard(path, store, decode=False):
            scanned.counts["samples"] += 1
            uid, meta = sample_uid_and_meta(sample)
            if uid is None:
                scanned.counts["unkeyed"] += 1
                continue
            idx = lookup.find(uid)
            if idx >= 0:
                bad = mismatched_members(sample, meta) if verify else None
                if bad:  # damaged since the build: not copied, named in the summary
                    scanned.mismatched.append(f"{path} {sample['__key__']} ({'+'.join(bad)})")
                    continue
                if meta is None:
                    meta = {}
                meta.setdefault(S.UID, uid)
                yield idx, sample, meta
    except ShardError as exc:
        if not skip_corrupt:
            raise
        scanned.corrupt = str(exc)


def _scan(path: str, lookup: _Lookup, store: Storage, flags: tuple[bool, bool], eager: bool) -> _Scanned:
    """``flags`` = (skip_corrupt, verify)."""
    scanned = _Scanned(path, iter(()))
    gen = _select(path, lookup, scanned, store, *flags)
    scanned.selected = list(gen) if eager else gen
    return scanned


def _scanned_inputs(
    paths: list[str], lookup: _Lookup, store: Storage, flags: tuple[bool, bool], workers: int
) -> Iterator[_Scanned]:
    if workers <= 1:
        for p in paths:
            yield _scan(p, lookup, store, flags, eager=False)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard-read") as pool:
        window: deque[Future[_Scanned]] = deque()
        todo = iter(paths)
        for p in todo:
            window.append(pool.submit(_scan, p, lookup, store, flags, True))
            if len(window) >= workers:
                break
        while window:
            done = window.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                window.append(pool.submit(_scan, nxt, lookup, store, flags, True))
            yield done


@dataclass
class _Tally:
    """What the inputs held besides the selected samples: counts, damaged inputs, checksum mismatches."""

    samples: int = 0
    duplicates: int = 0
    unkeyed: int = 0
    corrupt: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    def add(self, scanned: _Scanned) -> None:
        self.samples += scanned.counts["samples"]
        self.unkeyed += scanned.counts["unkeyed"]
        self.corrupt += [scanned.corrupt] if scanned.corrupt else []
        self.mismatched += scanned.mismatched


# --- outputs ------------------------------------------------------------------------------------------


def _inside(path: str, directory: str) -> bool:
    if storage.is_s3(path) != storage.is_s3(directory):
        return False
    if not storage.is_s3(path):
        path, directory = LOCAL.resolve(path)[1], LOCAL.resolve(directory)[1]
    return path.startswith(directory.rstrip("/") + "/")


def _prepare_output(out: str, inputs: list[str], overwrite: bool, store: Storage) -> None:
    if any(_inside(p, out) for p in inputs):
        raise ValueError(f"reshard: output {out} holds input shards; write to another directory")
    if not store.exists(out):
        store.makedirs(out)
        return
    old = [p for p in store.list_files(out) if _OUTPUT_FILE.match(p.rsplit("/", 1)[-1])]
    if any(p.endswith(".tar") for p in old) and not overwrite:
        raise FileExistsError(
            f"reshard: {out} already holds shards; pass overwrite=True (--overwrite) to replace"
        )
    store.remove_files(old)  # also stale stats of a smaller earlier run


# --- the join -----------------------------------------------------------------------------------------


def reshard(
    inputs: str | Sequence[str],
    subset: str | np.ndarray,
    out: str,
    samples_per_shard: int = 10_000,
    store: Storage = LOCAL,
    workers: int = 1,
    overwrite: bool = False,
    skip_corrupt: bool = False,
    verify: bool = False,
) -> ReshardResult:
    """Write the samples of ``inputs`` whose uid is in ``subset`` to ``out/{:08d}.tar`` (see module doc).

    ``inputs``: tar paths, directories or globs, local or s3://. ``subset``: a ``.npy`` path (DataComp
    format, local or s3://) or a ``u8,u8`` array. ``skip_corrupt``: a damaged input keeps the samples
    before the damage and is listed in ``corrupt_inputs`` instead of stopping the job. ``verify``: a
    selected sample whose bytes differ from the checksums its json records is not copied (its uid counts
    as missing unless another input holds a good copy) and is named in ``mismatched``.
    """
    if samples_per_shard < 1:
        raise ValueError("samples_per_shard must be ≥ 1")
    t0 = time.time()
    paths = expand_inputs(inputs, store)
    if not paths:
        raise FileNotFoundError(f"reshard: no input .tar files at {inputs!r}")
    rows = load_subset(subset, store)
    uids, expected = np.unique(rows, return_counts=True)
    n_rows = len(rows)
    del rows  # only the distinct uids and their counts are kept
    expected = expected.astype(np.int64)
    written = np.zeros(len(uids), np.int64)
    first_index = np.full(len(uids), -1, np.int64)
    lookup = _Lookup(uids)
    _prepare_output(out, paths, overwrite, store)

    writer = RollingWriter(out, samples_per_shard, store)
    tally = _Tally()
    try:
        for scanned in _scanned_inputs(paths, lookup, store, (skip_corrupt, verify), workers):
            for idx, sample, meta in scanned.selected:
                if written[idx]:
                    tally.duplicates += 1
                    continue
                first_index[idx] = writer.total
                for _ in range(expected[idx]):
                    key = output_key(writer.total, samples_per_shard)
                    writer.write(key, renamed_members(sample, meta, key))
                written[idx] = expected[idx]
            tally.add(scanned)
        writer.close()
    except BaseException:
        writer.abort()
        raise

    present = written > 0
    if (written[present] != expected[present]).any() or writer.total != int(written.sum()):
        raise ReshardError(f"reshard: wrote {writer.total} samples, subset accounts for {int(written.sum())}")
    result = ReshardResult(
        n_written=writer.total,
        n_missing=int((~present).sum()),
        n_missing_rows=int(expected[~present].sum()),
        shards=writer.shards,
        uids=uids,
        expected=expected,
        written=written,
        first_index=first_index,
        samples_per_shard=samples_per_shard,
        n_input_samples=tally.samples,
        n_input_duplicates=tally.duplicates,
        n_unkeyed=tally.unkeyed,
        corrupt_inputs=tally.corrupt,
        mismatched=tally.mismatched,
    )
    store.write_json(
        _summary(result, paths, subset, n_rows, time.time() - t0), storage.join(out, SUMMARY_NAME)
    )
    return result


def renamed_members(sample: dict[str, Any], meta: dict[str, Any], key: str) -> list[tuple[str, bytes]]:
    """The sample's members, bytes untouched except the json, which gets the new key."""
    new_json = json.dumps({**meta, "key": key}, ensure_ascii=False).encode("utf-8")
    members = [
        (ext, new_json if ext == "json" else data) for ext, data in sample.items() if not ext.startswith("__")
    ]
    if "json" not in sample:
        members.append(("json", new_json))
    return members


def _summary(res: ReshardResult, paths: list[str], subset: Any, n_rows: int, duration: float) -> dict:
    return {
        "n_inputs": len(paths),
        "subset": subset if isinstance(subset, str) else "<array>",
        "subset_rows": n_rows,
        "subset_distinct_uids": len(res.uids),
        "n_written": res.n_written,
        "n_missing": res.n_missing,
        "n_missing_rows": res.n_missing_rows,
        "n_input_samples": res.n_input_samples,
        "n_input_duplicates": res.n_input_duplicates,
        "n_unkeyed": res.n_unkeyed,
        "samples_per_shard": res.samples_per_shard,
        "key_format": f"{{shard:08d}}{{index:0{key_width(res.samples_per_shard)}d}}",
        "shards": [p.rsplit("/", 1)[-1] for p in res.shards],
        "missing_uids_first": res.missing_uids()[:_MISSING_IN_SUMMARY],
        "corrupt_inputs": res.corrupt_inputs,
        "checksum_mismatches": len(res.mismatched),
        "mismatched_first": res.mismatched[:_MISSING_IN_SUMMARY],
        "duration_s": round(duration, 3),
    }
