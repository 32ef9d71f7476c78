"""What a run directory remembers between runs of the build: its fingerprint and its committed parts.

**Fingerprint** (``work/fingerprint.json``), written before any download: the row count, a digest of
the uids in read order, one of the live-row mask (the rows that go on to download, which the parts
cut into consecutive ranges: pipeline/download/phase.py) and one of the live rows' content, each folded
from the per-file digests the build's tasks return (the driver never holds a column), so a pool whose rows were reordered, or whose
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
writes a marker whose *name* holds that token, the part's count of transient rows and of late retry
passes (pipeline/download/phase.py) and a sequence number, so one listing of the parts directory finds
every commit. A part therefore counts as done only if the driver of
the run that downloaded it was alive when the part finished: actors that outlive a killed driver (on a
shared cluster, Ray stops a dead driver's actors only after a while) write files under a token no marker
names, which no reader opens and the next run deletes. Two runs can never mix files of one part, because
each reads only the token its marker names. A ``retry_failed`` run rewrites a part under its own token and
writes a marker numbered one higher last (then removes the old one), so a crash mid-retry leaves the
previous, consistent part in place.
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

from pipeline.common import faults, storage
from pipeline.common.config import to_dict
from pipeline.common.errors import RefusedError
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig

FINGERPRINT_VERSION = 4  # 4: digests of per-file digests (3: of the whole pool; 2: without content)
_PART_FILE = re.compile(r"^part-(\d{6})\.([0-9a-f]+)\.(tar|parquet)$")
_MARKER = re.compile(r"^part-(\d{6})\.(\d{4,})\.([0-9a-z]+)\.t(\d+|None)\.l(\d+)\.done$")


class FingerprintMismatch(RefusedError, ValueError):
    """The run directory holds another build; the message names what differs and how to proceed."""


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


def uid_digest_update(h: Any, uids: pa.Array | pa.ChunkedArray) -> None:
    """Fold a batch of uids (each one's UTF-8 length, then the bytes; null as "") into a file's uid digest."""
    arr = pc.fill_null(uids.cast(pa.large_string()), "")
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
    h.update(np.diff(offsets).astype("<u4").tobytes())
    if len(arr) and arr.buffers()[2] is not None:
        h.update(memoryview(arr.buffers()[2])[offsets[0] : offsets[-1]])


def live_digests(live: np.ndarray, content: np.ndarray) -> dict[str, str]:
    """A file's live-mask digest and its live rows' content digest."""
    live = np.asarray(live, dtype=bool)
    return {
        "live_sha256": hashlib.sha256(np.packbits(live).tobytes()).hexdigest(),
        "content_sha256": hashlib.sha256(np.asarray(content)[live].astype("<u8").tobytes()).hexdigest(),
    }


def fingerprint(
    cfg: BuildConfig,
    pool: dict[str, Any] | Sequence[str | None],
    live: np.ndarray | None = None,
    content: np.ndarray | None = None,
) -> dict[str, Any]:
    """``pool``: the row count and the digests of the uids in read order, of the live-row mask and of the
    live rows' content, each a digest of the per-file digests the scan and live-row stages return
    (pipeline/stages/row_stages.py) — or the uids of a one-file pool (``live``: default all, ``content``:
    default zero), digested here."""
    if not isinstance(pool, dict):
        h = hashlib.sha256()
        uid_digest_update(h, pa.array(list(pool), pa.string()))
        live = np.ones(len(pool), dtype=bool) if live is None else live
        content = np.zeros(len(pool), np.uint64) if content is None else content
        one = {"uids_sha256": h.hexdigest(), **live_digests(live, content)}
        pool = {"rows": len(live), **{k: digest_of([v]) for k, v in one.items()}}
    download = {k: v for k, v in to_dict(cfg.download).items() if k not in RETRY_KNOBS}
    return {
        "version": FINGERPRINT_VERSION,
        "pool": {k: pool[k] for k in ("rows", "uids_sha256", "live_sha256", "content_sha256")},
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


def digest_of(digests: Sequence[str]) -> str:
    """One digest of per-file digests, in file order."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


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
        "status": storage.join(output, "metadata", "status.parquet"),  # a directory: a file per uid bucket
        "status_counts": storage.join(output, "metadata", "status_counts.json"),
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
    gone += sum(
        remove_temporaries(p, store, tree=True)
        for p in (storage.join(d["work"], "stages"), d["status"], d["filters"])
    )
    if gone:
        log(f"resume: removed {gone} unfinished temporary files of an interrupted run")
    store.makedirs(d["work"])
    store.write_json(fp, d["fingerprint"])


_TEMP_NAME = re.compile(r"^\..+\.tmp-[0-9a-f]{12}$")  # an AtomicOutput's hidden name while it writes


def remove_temporaries(directory: str, store: Storage, tree: bool = False) -> int:
    """Delete the hidden temp files that writes killed half-way left directly in a local ``directory`` (or
    anywhere under it, ``tree``); returns how many. Only under the output's lock: no other writer is at
    work there. S3 leaves none (an upload that never completed is no object)."""
    if storage.is_s3(directory):
        return 0
    path = store.resolve(directory)[1]
    if tree:
        found = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names if _TEMP_NAME.match(n)]
    else:
        try:
            found = [e.path for e in os.scandir(path) if e.is_file() and _TEMP_NAME.match(e.name)]
        except FileNotFoundError:
            return 0
    for name in found:
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)
    return len(found)


def record(output: str, fp: dict[str, Any], store: Storage) -> None:
    """Record ``fp`` in the run directory ``output`` once every part is downloaded (a refresh's new content
    becomes the run's here)."""
    store.write_json(fp, run_dirs(output)["fingerprint"])


def discard_outputs(output: str, store: Storage) -> int:
    """Delete what a build wrote in ``output`` (parts, fingerprint, status, filters, shards, subsets,
    tokenizer); the demo pool and the manifest stay. Returns the number of files removed."""
    d = run_dirs(output)
    files = [
        p
        for key in ("parts", "shards", "subsets", "tokenizer", "status", "filters")
        for p in store.list_files(d[key])
    ]
    files += [d[k] for k in ("fingerprint", "status_counts") if store.exists(d[k])]
    store.remove_files(files)
    return len(files)


# --- parts ----------------------------------------------------------------------------------------------


def part_file(parts_dir: str, part: int, token: str, ext: str) -> str:
    return storage.join(parts_dir, f"part-{part:06d}.{token}.{ext}")


@dataclass(frozen=True)
class Marker:
    """A committed part's marker: its files' token, its transient rows (None: a marker that does not say),
    the late retry passes it has had (pipeline/download/phase.py), and its sequence number (a part's
    marker is replaced by one numbered higher)."""

    token: str
    transient: int | None = None
    late: int = 0
    seq: int = 0

    def name(self, part: int) -> str:
        return f"part-{part:06d}.{self.seq:04d}.{self.token}.t{self.transient}.l{self.late}.done"


def commit(
    parts_dir: str, part: int, token: str, store: Storage, transient: int = 0, late: int = 0, seq: int = 0
) -> Marker:
    """The driver's word that ``part`` is done, naming the token of the files it stands for; ``transient``:
    how many of its rows hold a transient status, ``late``: the late retry passes it has had; ``seq``: one
    above the marker it replaces (which is removed once the new one is written)."""
    faults.point("part.commit")
    m = Marker(token, transient, late, seq)
    store.write_json(
        {"token": token, "transient": transient, "late": late}, storage.join(parts_dir, m.name(part))
    )
    for old in range(seq):
        for stale in _markers_named(parts_dir, store).get((part, old), []):
            store.remove(storage.join(parts_dir, stale))
    return m


def _markers_named(parts_dir: str, store: Storage) -> dict[tuple[int, int], list[str]]:
    out: dict[tuple[int, int], list[str]] = {}
    for path in store.list_files(parts_dir, suffix=".done"):
        name = path.rsplit("/", 1)[-1]
        m = _MARKER.match(name)
        if m:
            out.setdefault((int(m.group(1)), int(m.group(2))), []).append(name)
    return out


def committed(parts_dir: str, store: Storage) -> dict[int, str]:
    """part → token of every committed part (a marker whose files are missing does not count)."""
    return {part: m.token for part, m in committed_markers(parts_dir, store).items()}


def committed_markers(parts_dir: str, store: Storage) -> dict[int, Marker]:
    """part → marker of every committed part, from one listing of the parts directory: the marker's name
    carries everything (no read per marker). A marker whose files are missing does not count; of a part's
    markers the highest numbered counts."""
    files = {p.rsplit("/", 1)[-1] for p in store.list_files(parts_dir)}
    out: dict[int, Marker] = {}
    for name in sorted(files):
        m = _MARKER.match(name)
        if not m:
            continue
        part, seq, token = int(m.group(1)), int(m.group(2)), m.group(3)
        transient = None if m.group(4) == "None" else int(m.group(4))
        if {f"part-{part:06d}.{token}.tar", f"part-{part:06d}.{token}.parquet"} <= files:
            if part not in out or out[part].seq < seq:
                out[part] = Marker(token, transient, int(m.group(5)), seq)
    return out


def remove_uncommitted(parts_dir: str, store: Storage) -> int:
    """Delete part files and markers no committed marker names (killed runs, superseded retries); returns
    how many files."""
    current = committed_markers(parts_dir, store)
    stale = []
    for path in store.list_files(parts_dir):
        name = path.rsplit("/", 1)[-1]
        f, m = _PART_FILE.match(name), _MARKER.match(name)
        if f and current.get(int(f.group(1)), Marker("")).token != f.group(2):
            stale.append(path)
        elif m and (int(m.group(1)) not in current or current[int(m.group(1))].name(int(m.group(1))) != name):
            stale.append(path)
    for path in stale:
        faults.point("parts.remove")
        store.remove(path)
    return len(stale)
