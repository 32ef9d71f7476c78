"""What a run directory remembers between runs of the build: its fingerprint and its committed parts.

**Fingerprint** (``work/fingerprint.json``), written before any download: the row count, a digest of
the uids in read order and one of the live-row mask (the rows that go on to download, which the parts
cut into consecutive ranges: pipeline/download/phase.py), so a pool whose rows were reordered, or whose
live rows changed, never resumes into parts cut from another order (URLs are not in it, so the demo pool
served on a new port is the same pool); the settings that shape the download parts (``part_size``,
``max_caption_bytes``, every ``download.*`` field but the ``RETRY_KNOBS``, which only decide whether and
when a row is fetched) and the settings of what is derived from the parts each run
(``samples_per_shard``, ``tokenizer_vocab``, ``dedupe.*``, ``filters.*``). Thread/actor/CPU counts,
timeouts, retries, deadlines and backoff, paths, endpoints and the ``overwrite``/``retry_failed``
actions are not in it: they do not change a byte of the output. A re-run whose pool or part settings
differ is refused with one line naming what differs (``FingerprintMismatch``); ``overwrite=true`` first
discards the old run's parts and outputs (not the demo pool or the manifest); a new output directory
always works. A change of derived settings only is logged and recorded: status table, shards and subsets
are rewritten from the parts every run anyway.

**Parts and run tokens.** Every run draws a token. A download actor writes its part as
``part-{i:06d}.{token}.tar`` and ``.parquet`` and returns its rows; the *driver*, on receiving them,
writes ``part-{i:06d}.done`` holding that token (and the part's count of transient rows and of late
retry passes: pipeline/download/phase.py). A part therefore counts as done only if the driver of
the run that downloaded it was alive when the part finished: actors that outlive a killed driver (on a
shared cluster, Ray stops a dead driver's actors only after a while) write files under a token no marker
names, which no reader opens and the next run deletes. Two runs can never mix files of one part, because
each reads only the token its marker names. A ``retry_failed`` run rewrites a part under its own token and
moves the marker last, so a crash mid-retry leaves the previous, consistent part in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import faults, storage
from pipeline.common.config import to_dict
from pipeline.common.errors import RefusedError
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig
from pipeline.source.content import CONTENT, pool_digest

FINGERPRINT_VERSION = 3  # 3: the pool's content is in it (2: row ranges in read order; 1: uid-hash buckets)
_PART_FILE = re.compile(r"^part-(\d{6})\.([0-9a-f]+)\.(tar|parquet)$")
_MARKER = re.compile(r"^part-(\d{6})\.done$")


class FingerprintMismatch(RefusedError, ValueError):
    """The run directory holds another build; the message names what differs and how to proceed."""


def uid_digest(uids: Sequence[str | None] | pa.Array | pa.ChunkedArray) -> str:
    """Digest of the uids *in their order* (the read order cuts the parts): every uid's UTF-8 length, then
    all their bytes; a null counts as ""."""
    arr = uids if isinstance(uids, (pa.Array, pa.ChunkedArray)) else pa.array(list(uids), pa.string())
    arr = pc.fill_null(arr.cast(pa.large_string()), "")
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
    h = hashlib.sha256(np.diff(offsets).astype("<u4").tobytes())
    if len(arr) and arr.buffers()[2] is not None:
        h.update(memoryview(arr.buffers()[2])[offsets[0] : offsets[-1]])
    return h.hexdigest()


def mask_digest(mask: np.ndarray) -> str:
    return hashlib.sha256(np.packbits(np.asarray(mask, dtype=bool)).tobytes()).hexdigest()


# Download settings that decide only *whether and when* a row is fetched, never what a fetched row becomes:
# free to change between runs (e.g. a longer timeout for a ``retry_failed`` pass).
RETRY_KNOBS = (
    "threads_per_actor",
    "timeout_s",
    "retries",
    "late_retries",
    "part_deadline_s",
    "per_host_connections",
    "retry_backoff_s",
    "retry_after_max_s",
    "decode_pixel_budget",
)


def fingerprint(
    cfg: BuildConfig,
    uids: Sequence[str | None],
    live: np.ndarray | None = None,
    content: np.ndarray | None = None,
) -> dict[str, Any]:
    """``uids`` in read order; ``live``: the rows that go on to download (default: all); ``content``: every
    row's digest (pipeline/source/content.py; default: all zero)."""
    download = {k: v for k, v in to_dict(cfg.download).items() if k not in RETRY_KNOBS}
    live = np.ones(len(uids), dtype=bool) if live is None else live
    content = np.zeros(len(uids), np.uint64) if content is None else content
    pool = {"rows": len(uids), "uids_sha256": uid_digest(uids), "live_sha256": mask_digest(live)}
    return {
        "version": FINGERPRINT_VERSION,
        "pool": {**pool, "content_sha256": pool_digest(np.asarray(content)[live])},
        "parts": {
            "part_size": cfg.part_size,
            "max_caption_bytes": cfg.max_caption_bytes,
            "download": download,
        },
        "derived": {
            "samples_per_shard": cfg.samples_per_shard,
            "tokenizer_vocab": cfg.tokenizer_vocab,
            "dedupe": to_dict(cfg.dedupe),
            "filters": to_dict(cfg.filters),
        },
    }


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``key: old → new`` for every leaf that differs (nested dicts flattened with dots)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if old == new else [f"{prefix}: {_short(old)} → {_short(new)}"]


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 24 else text[:12] + "…"


def run_dirs(output: str) -> dict[str, str]:
    return {
        "work": storage.join(output, "work"),
        "parts": storage.join(output, "work", "parts"),
        "shards": storage.join(output, "shards"),
        "subsets": storage.join(output, "subsets"),
        "tokenizer": storage.join(output, "tokenizer"),
        "status": storage.join(output, "metadata", "status.parquet"),
        "filters": storage.join(output, "metadata", "filters.parquet"),
        "fingerprint": storage.join(output, "work", "fingerprint.json"),
    }


def claim(cfg: BuildConfig, fp: dict[str, Any], store: Storage, log: Callable[[str], None]) -> None:
    """Check ``fp`` against the run directory and record it (see the module docstring).

    A pool whose content alone changed (same uids, order and live rows; other URLs, captions, sha256 or
    face boxes) is refused unless ``refresh_changed``; then the recorded content stays the old one until
    ``record`` writes the new one, once every part holds it, so a refresh killed half-way is a refresh
    still to finish, never a mix that passes for current."""
    d = run_dirs(cfg.output)
    if cfg.overwrite:
        n = discard_outputs(cfg.output, store)
        if n:
            log(f"overwrite: discarded {n} files of the earlier run in {cfg.output}")
    elif store.exists(d["fingerprint"]):
        old = store.read_json(d["fingerprint"])
        keys = ("version", "pool", "parts")
        diff = differences({k: old.get(k) for k in keys}, {k: fp[k] for k in keys})
        content_only = bool(diff) and all(line.startswith("pool.content_sha256") for line in diff)
        if content_only and cfg.refresh_changed:
            log(
                "refresh: the pool's URLs, captions, sha256 or face boxes changed; changed rows download again"
            )
            fp = {**fp, "pool": {**fp["pool"], "content_sha256": old["pool"]["content_sha256"]}}
        elif content_only:
            raise FingerprintMismatch(
                f"{cfg.output} holds a build of the same {fp['pool']['rows']} uids with other URLs, captions, "
                "sha256 or face boxes; use --set refresh_changed=true to download the changed rows again, "
                "a new output or --set overwrite=true to discard it"
            )
        elif diff:
            raise FingerprintMismatch(
                f"{cfg.output} holds another build ({'; '.join(diff[:4])}{'; …' if len(diff) > 4 else ''}); "
                "use a new output or --set overwrite=true to discard it"
            )
        for line in differences(old.get("derived"), fp["derived"]):
            log(f"resume: {line} (status, shards and subsets are re-derived)")
    elif store.list_files(d["parts"]):
        raise FingerprintMismatch(
            f"{cfg.output} holds download parts without a fingerprint (an older build); "
            "use a new output or --set overwrite=true to discard them"
        )
    # Temp files of writes a killed build left: ours to delete, the output's lock is held.
    dirs = [d[k] for k in ("work", "parts", "shards", "subsets")] + [storage.join(cfg.output, "metadata")]
    gone = sum(remove_temporaries(p, store) for p in dirs)
    if gone:
        log(f"resume: removed {gone} unfinished temporary files of an interrupted run")
    store.makedirs(d["work"])
    store.write_json(fp, d["fingerprint"])


_TEMP_NAME = re.compile(r"^\..+\.tmp-[0-9a-f]{12}$")  # an AtomicOutput's hidden name while it writes


def remove_temporaries(directory: str, store: Storage) -> int:
    """Delete the hidden temp files that writes killed half-way left directly in a local ``directory``;
    returns how many. Only under the output's lock: no other writer is at work there. S3 leaves none (an
    upload that never completed is no object)."""
    if storage.is_s3(directory):
        return 0
    path = store.resolve(directory)[1]
    try:
        names = [e.name for e in os.scandir(path) if e.is_file() and _TEMP_NAME.match(e.name)]
    except FileNotFoundError:
        return 0
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, name))
    return len(names)


def record(cfg: BuildConfig, fp: dict[str, Any], store: Storage) -> None:
    """Record ``fp`` once every part is downloaded (a refresh's new content becomes the run's here)."""
    store.write_json(fp, run_dirs(cfg.output)["fingerprint"])


def discard_outputs(output: str, store: Storage) -> int:
    """Delete what a build wrote in ``output`` (parts, fingerprint, status, filters, shards, subsets,
    tokenizer); the demo pool and the manifest stay. Returns the number of files removed."""
    d = run_dirs(output)
    files = [p for key in ("parts", "shards", "subsets", "tokenizer") for p in store.list_files(d[key])]
    files += [d[k] for k in ("fingerprint", "status", "filters") if store.exists(d[k])]
    store.remove_files(files)
    return len(files)


# --- parts ----------------------------------------------------------------------------------------------


def part_file(parts_dir: str, part: int, token: str, ext: str) -> str:
    return storage.join(parts_dir, f"part-{part:06d}.{token}.{ext}")


def marker(parts_dir: str, part: int) -> str:
    return storage.join(parts_dir, f"part-{part:06d}.done")


def commit(parts_dir: str, part: int, token: str, store: Storage, transient: int = 0, late: int = 0) -> None:
    """The driver's word that ``part`` is done, naming the token of the files it stands for; ``transient``:
    how many of its rows hold a transient status, ``late``: the late retry passes it has had."""
    faults.point("part.commit")
    store.write_json({"token": token, "transient": transient, "late": late}, marker(parts_dir, part))


@dataclass(frozen=True)
class Marker:
    """A committed part's marker: its files' token, its transient rows (None: a marker that does not say),
    the late retry passes it has had (pipeline/download/phase.py)."""

    token: str
    transient: int | None = None
    late: int = 0


def committed(parts_dir: str, store: Storage) -> dict[int, str]:
    """part → token of every committed part (a marker whose files are missing does not count)."""
    return {part: m.token for part, m in committed_markers(parts_dir, store).items()}


def committed_markers(parts_dir: str, store: Storage) -> dict[int, Marker]:
    """part → marker of every committed part (a marker whose files are missing does not count)."""
    files = {p.rsplit("/", 1)[-1] for p in store.list_files(parts_dir)}
    out = {}
    for name in sorted(files):
        m = _MARKER.match(name)
        if not m:
            continue
        try:
            doc = store.read_json(storage.join(parts_dir, name))
            found = Marker(str(doc["token"]), doc.get("transient"), int(doc.get("late", 0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # an empty marker of an older format, or a damaged one: download the part again
        part = int(m.group(1))
        if {f"part-{part:06d}.{found.token}.tar", f"part-{part:06d}.{found.token}.parquet"} <= files:
            out[part] = found
    return out


def remove_uncommitted(parts_dir: str, done: dict[int, str], store: Storage) -> int:
    """Delete part files no marker names (killed runs, superseded retries); returns how many."""
    stale = []
    for path in store.list_files(parts_dir):
        m = _PART_FILE.match(path.rsplit("/", 1)[-1])
        if m and done.get(int(m.group(1))) != m.group(2):
            stale.append(path)
    for path in stale:
        faults.point("parts.remove")
        store.remove(path)
    return len(stale)


def changed_rows(
    parts_dir: str,
    done: dict[int, str],
    pool: tuple[Any, np.ndarray, np.ndarray],
    part_size: int,
    store: Storage,
) -> dict[int, set[str]]:
    """Committed part → its uids whose content digest differs from the pool's now: what a
    ``refresh_changed`` run downloads again (only parts that have some). ``pool`` = (every row's uid,
    the live mask, every row's content digest), in read order; part k is the k-th ``part_size`` live rows."""
    uids, live, content = pool
    idx = np.flatnonzero(live)
    out = {}
    for part, token in sorted(done.items()):
        mine = idx[part * part_size : (part + 1) * part_size]
        t = store.read_parquet(part_file(parts_dir, part, token, "parquet"))
        old = dict(zip(t.column(S.UID).to_pylist(), _digests(t), strict=True))
        now = zip(uids.take(pa.array(mine, pa.int64())).to_pylist(), content[mine].tolist(), strict=True)
        changed = {u for u, c in now if old.get(u) != c}
        if changed:
            out[part] = changed
    return out


def _digests(t: pa.Table) -> list[int | None]:
    """A part's per-row content digests (None for every row of a part written without them)."""
    if CONTENT not in t.column_names:
        return [None] * t.num_rows
    return t.column(CONTENT).to_pylist()
