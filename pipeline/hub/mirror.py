"""Several hub repos ("sources": the pool metadata, each evaluation set) copied at once, with progress.

``mirror(sources, store, ...)`` lists every source at one commit first (``pipeline/hub/listing.py``), then
fetches all their files on ``workers`` threads (``pipeline/hub/transfer.py``), printing a line every
``progress_s`` seconds (files and bytes done, rate, time left) and one line per source as it completes. A
source that fails (not on the hub, no file matching, a file that never hashed right) does not stop the
others; ``MirrorReport.failed`` lists each with its error, and the job ends with them (never a warning).

A source names the revisions to try in order (``revisions``): the first that holds a matching file is
copied, so an evaluation set published as parquet on ``main`` or only in the hub's
``refs/convert/parquet`` conversion is found either way. ``place`` maps the chosen repo paths to paths
under the source's ``root`` (default: the same paths).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from pipeline.common.errors import JobError
from pipeline.common.storage import Storage
from pipeline.hub.listing import HubFile, HubMissing, HubRepoMissing, Snapshot, snapshot
from pipeline.hub.transfer import Placement, fetch_file

Log = Callable[[str], None]


@dataclass(frozen=True)
class Source:
    """One repo to copy: its files matching ``patterns`` at the first of ``revisions`` that has any."""

    name: str  # what it is, for messages: "metadata", "eval set cifar10"
    repo: str
    root: str  # where its files go, local or s3://
    patterns: tuple[str, ...]
    revisions: tuple[str, ...] = ("main",)
    place: Callable[[list[str]], dict[str, str]] | None = None  # repo paths → paths under root


@dataclass
class SourceResult:
    source: Source
    commit: str = ""
    files: int = 0
    bytes: int = 0
    how: dict[str, int] = field(default_factory=dict)  # fetched / resumed / skipped / kept / fetched again
    error: JobError | None = None


@dataclass
class MirrorReport:
    results: list[SourceResult]
    wall_s: float

    @property
    def failed(self) -> list[SourceResult]:
        return [r for r in self.results if r.error is not None]


class Progress:
    """Bytes and files done out of the total, printed every ``every_s`` seconds by a thread of its own."""

    def __init__(self, files: int, total: int, log: Log, every_s: float) -> None:
        self.files, self.total, self.log, self.every_s = files, total, log, every_s
        self.done_files = self.moved = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fetch-progress")

    def add(self, n: int) -> None:
        with self.lock:
            self.moved += n

    def file_done(self) -> None:
        with self.lock:
            self.done_files += 1

    def line(self) -> str:
        with self.lock:
            moved, files = self.moved, self.done_files
        wall = max(time.monotonic() - self.t0, 1e-9)
        rate = moved / wall
        left = (
            f", about {_duration((self.total - moved) / rate)} left"
            if rate > 0 and moved < self.total
            else ""
        )
        return (f"[fetch] {files}/{_files(self.files)}, {_size(moved)} of up to {_size(self.total)} moved, "
                f"{_size(rate)}/s{left}")  # fmt: skip

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.log(self.line())

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _files(n: int) -> str:
    return f"{n} file" + ("" if n == 1 else "s")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def plan_source(api: Any, src: Source) -> tuple[Snapshot, dict[HubFile, Placement]]:
    """The snapshot of ``src``'s first revision that holds a matching file, and where each file goes."""
    tried = []
    for rev in src.revisions:
        try:
            snap = snapshot(api, src.repo, rev, src.patterns)
        except HubRepoMissing:
            raise
        except HubMissing as exc:
            tried.append(str(exc))
            continue
        places = (src.place or (lambda paths: {p: p for p in paths}))([f.path for f in snap.files])
        if places:
            return snap, {f: Placement(src.root, places[f.path]) for f in snap.files if f.path in places}
        tried.append(
            f"{src.repo}@{rev}: no file to take among {len(snap.files)} matching {', '.join(src.patterns)}"
        )
    raise HubMissing(f"{src.repo} has nothing to fetch ({'; '.join(tried)})")


def mirror(sources: Sequence[Source], store: Storage, *, api: Any, staging: Callable[[str], str],
           workers: int = 8, attempts: int = 3, verify: bool = False, progress_s: float = 10.0,
           log: Log = print) -> MirrorReport:  # fmt: skip
    """Copy every source (see the module docstring); ``staging(root)`` is the local folder for the partial
    files of a source whose ``root`` is that."""
    t0 = time.monotonic()
    results = [SourceResult(s) for s in sources]
    jobs: list[tuple[SourceResult, Snapshot, HubFile, Placement]] = []
    for r in results:
        try:
            snap, places = plan_source(api, r.source)
        except JobError as exc:
            r.error = type(exc)(f"{r.source.name}: {exc}")
            log(f"[fetch] failed: {r.error}")
            continue
        r.commit, r.files, r.bytes = snap.commit, len(places), sum(f.size for f in places)
        jobs += [(r, snap, f, p) for f, p in places.items()]
        log(
            f"[fetch] {r.source.name}: {_files(r.files)}, {_size(r.bytes)} from {snap.repo}@{snap.commit[:12]}"
        )
    left = {id(r): r.files for r in results}
    lock = threading.Lock()

    def one(job: tuple[SourceResult, Snapshot, HubFile, Placement]) -> None:
        r, snap, f, place = job
        if r.error is not None:
            return
        try:
            how = fetch_file(api, snap, f, place, store, staging(r.source.root), attempts=attempts,
                             verify=verify, count=bar.add)  # fmt: skip
        except JobError as exc:
            with lock:
                r.error = r.error or type(exc)(f"{r.source.name}: {exc}")
            log(f"[fetch] failed: {r.source.name}: {exc}")
            return
        bar.file_done()
        with lock:
            r.how[how] = r.how.get(how, 0) + 1
            left[id(r)] -= 1
            finished = left[id(r)] == 0 and r.error is None
        if finished:
            log(f"[fetch] {r.source.name}: done ({_how(r.how)})")

    with Progress(len(jobs), sum(j[2].size for j in jobs), log, progress_s) as bar:
        pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="fetch")
        try:
            for fut in as_completed([pool.submit(one, j) for j in jobs]):
                fut.result()  # a bug (not a JobError) stops the copy with its traceback
        finally:  # Ctrl-C or a bug: no file starts; those in flight keep their partial files
            pool.shutdown(wait=False, cancel_futures=True)
    if jobs:
        log(bar.line())
    return MirrorReport(results, time.monotonic() - t0)


def _how(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def default_staging(root: str, tmp: str = "") -> str:
    """Partial files of a local ``root`` beside it (a rename publishes them), of ``s3://`` in ``tmp``."""
    from pipeline.common import storage

    if not storage.is_s3(root):
        return os.path.join(os.path.abspath(os.path.expanduser(root)), "_hub", "partial")
    import hashlib
    import tempfile

    key = hashlib.sha1(root.encode()).hexdigest()[:16]
    return os.path.join(tmp or os.path.join(tempfile.gettempdir(), "prolip-fetch"), key)
