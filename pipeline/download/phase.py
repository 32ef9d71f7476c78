"""The build's download phase: cut the download parts, run them on ``DownloadPart`` Ray actors, commit.

Part k is the k-th range of ``part_size`` live rows (``status_pre == ""``) in read order (files in
``Storage.list_files`` order, rows in file order; pipeline/source/metadata.py). The driver sends one small Arrow
block per part holding only its rows' (file index, row index) positions; each actor reads those rows from
the metadata files itself, so nothing passes over every row and nothing is shuffled before the first part
starts. A ``retry_failed`` part's block lists only its transient rows. The driver commits a part when it
receives the part's rows (pipeline/source/run_state.py), and the fingerprint pins the row order and the live rows,
so a resumed build cuts the same parts.

A lost host costs only its unfinished parts: each actor writes under a token of its own, the marker names
the token of the attempt whose rows reached the driver, and a part whose actor was lost (host killed or cut
off, process dead) runs again on another actor, within the same build (``_ActorPool``). Once every part is
done, the late retry passes fetch the transient rows again on the same actors (``_LatePasses``): a host
cut off the network while its actor lived on wrote timeouts, not losses, and by then the cut has passed.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common.errors import StorageError, os_error
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig
from pipeline.download.part import DownloadPart
from pipeline.source import run_state as R
from pipeline.source.metadata import Metadata


@dataclass(frozen=True)
class PoolRows:
    """What the parts are cut from: the checked files, every row's uid in read order, the live mask."""

    meta: Metadata
    uids: pa.ChunkedArray | pa.Array
    live: np.ndarray
    content: np.ndarray | None = None  # every row's content digest (pipeline/source/content.py)


def download_parts(
    rows: PoolRows,
    cfg: BuildConfig,
    store: Storage,
    paths: dict[str, str],
    log: Callable[[str], None],
    allow_hosts: Sequence[str] = (),
) -> tuple[int, int, int]:
    """Download the parts not committed yet (Ray actors), then the late retry passes → (parts, parts done
    before, rows retried by ``retry_failed``). ``allow_hosts``: address-guard entries for this run only
    (pipeline/demo/source.py)."""
    n_parts = math.ceil(int(rows.live.sum()) / cfg.part_size)
    store.makedirs(paths["parts"])
    markers = {p: m for p, m in R.committed_markers(paths["parts"], store).items() if p < n_parts}
    R.remove_uncommitted(paths["parts"], {p: m.token for p, m in markers.items()}, store)
    retry = _transient_rows(paths["parts"], markers, store) if cfg.retry_failed else {}
    if cfg.refresh_changed and rows.content is not None:  # rows whose URL, caption, sha256 or boxes changed
        pool = (rows.uids, rows.live, rows.content)
        done = {p: m.token for p, m in markers.items()}
        for part, uids in R.changed_rows(paths["parts"], done, pool, cfg.part_size, store).items():
            retry[part] = retry.get(part, set()) | uids
    todo = sorted(set(range(n_parts)) - set(markers))
    n_retry = sum(len(u) for u in retry.values())
    log(
        f"download: {n_parts} parts of {cfg.part_size} rows, {len(markers)} already done"
        + (f"; downloading {n_retry} rows of {len(retry)} parts again" if retry else "")
    )
    late = _LatePasses(rows, cfg, store, paths, markers, log)
    specs = part_specs(rows, cfg.part_size, todo, retry, {p: m.token for p, m in markers.items()})
    late.total = len(specs)
    if not specs and not late.due():
        return n_parts, len(markers), 0
    download = dataclasses.replace(cfg.download, allow_hosts=[*cfg.download.allow_hosts, *allow_hosts])
    cfg = dataclasses.replace(cfg, download=download)
    for spec, token, summary in _run_parts(rows.meta, specs, cfg, store, paths, late.next_pass, log):
        late.commit(spec, token, summary)
    R.remove_uncommitted(paths["parts"], R.committed(paths["parts"], store), store)
    return n_parts, len(markers), n_retry


class _LatePasses:
    """The driver's side of the parts: commits each part as its rows arrive, and once every part is done
    hands out the late retry passes — each part's transient rows fetched again (``download.late_retries``
    times at most), when an outage or a host cut off the network has had time to pass. A part's marker
    counts its transient rows and its late passes, so a resumed build runs exactly the passes a clean one
    would (docs/download.md, "Late retries")."""

    def __init__(
        self, rows, cfg: BuildConfig, store: Storage, paths, markers: dict[int, R.Marker], log
    ) -> None:
        self.rows, self.cfg, self.store, self.parts, self.log = rows, cfg, store, paths["parts"], log
        self.markers = dict(markers)
        self.transient: dict[int, set[str]] = {}  # part → its transient uids, for parts committed here
        self.passes, self.finished, self.total = 0, 0, 0  # late passes run; parts done of this pass's

    def commit(self, spec: pa.Table, token: str, summary: pa.Table) -> None:
        """Part ``spec``'s rows ``summary`` arrived (written under ``token``): the driver is alive, it counts."""
        part = int(spec.column("part")[0].as_py())
        statuses = summary.column(S.STATUS).to_pylist()
        self.transient[part] = {
            u for u, s in zip(summary.column(S.UID).to_pylist(), statuses, strict=True) if S.is_transient(s)
        }
        old = self.markers.get(part)
        late = 0 if old is None else old.late + (self.passes > 0)
        R.commit(self.parts, part, token, self.store, len(self.transient[part]), late)
        self.markers[part] = R.Marker(token, len(self.transient[part]), late)
        self.finished += 1
        ok = statuses.count(S.STATUS_SUCCESS)
        self.log(f"  part(s) done: {self.finished}/{self.total} (+{summary.num_rows} rows, {ok} images)")

    def due(self) -> dict[int, set[str]]:
        """Part → its transient uids, for every part still owed a late pass."""
        parts = [
            p for p, m in self.markers.items() if m.late < self.cfg.download.late_retries and m.transient != 0
        ]
        unknown = {p: self.markers[p] for p in parts if p not in self.transient}
        self.transient.update(_transient_rows(self.parts, unknown, self.store, keep_empty=True))
        return {p: self.transient[p] for p in parts if self.transient[p]}

    def next_pass(self) -> list[pa.Table]:
        """The next late pass's specs (none: the download is over)."""
        retry = self.due()
        if not retry:
            return []
        self.passes += 1
        self.log(
            f"download: late retry pass {self.passes}: {sum(map(len, retry.values()))} transient rows of "
            f"{len(retry)} parts again"
        )
        tokens = {p: m.token for p, m in self.markers.items()}
        specs = part_specs(self.rows, self.cfg.part_size, [], retry, tokens)
        self.finished, self.total = 0, len(specs)
        return specs


def _transient_rows(
    parts_dir: str, markers: dict[int, R.Marker], store: Storage, keep_empty: bool = False
) -> dict[int, set[str]]:
    """Committed part → its uids whose status is transient (only parts that have some, unless
    ``keep_empty``)."""
    out = {}
    for part, m in sorted(markers.items()):
        if m.transient == 0:
            uids: set[str] = set()
        else:
            t = store.read_parquet(
                R.part_file(parts_dir, part, m.token, "parquet"), columns=[S.UID, S.STATUS]
            )
            uids = {
                u
                for u, s in zip(t.column(S.UID).to_pylist(), t.column(S.STATUS).to_pylist(), strict=True)
                if S.is_transient(s)
            }
        if uids or keep_empty:
            out[part] = uids
    return out


def part_specs(
    rows: PoolRows,
    part_size: int,
    todo: list[int],
    retry: dict[int, set[str]],
    tokens: dict[int, str] | None = None,
) -> list[pa.Table]:
    """One small table per part to download: ``part`` and the (``file``, ``row``) position of each of its
    rows — part k is the k-th range of ``part_size`` live rows in read order; a retried part lists only its
    transient rows, and ``merge`` names the token of its committed files (``tokens``), which they replace
    rows of ("" for a part downloaded whole)."""
    live = np.flatnonzero(rows.live)
    tokens = tokens or {}
    specs = []
    for part in sorted(set(todo) | set(retry)):
        mine = live[part * part_size : (part + 1) * part_size]
        if part in retry:
            again = pc.is_in(
                rows.uids.take(pa.array(mine)), value_set=pa.array(sorted(retry[part]), pa.string())
            )
            mine = mine[again.to_numpy(zero_copy_only=False)]
        if not len(mine):
            continue
        file_idx, row_idx = rows.meta.locate(mine)
        merge = tokens.get(part, "") if part in retry else ""
        specs.append(
            pa.table(
                {
                    "part": pa.array(np.full(len(mine), part), pa.int64()),
                    "file": pa.array(file_idx, pa.int32()),
                    "row": pa.array(row_idx, pa.int64()),
                    "merge": pa.array([merge] * len(mine), pa.string()),
                }
            )
        )
    return specs


# Parts queued on one actor beyond the one it runs: the next part's rows are at hand when one ends.
QUEUED_PER_ACTOR = 1
# Times one part may be lost with its actor (its host killed, its process dead) before the build stops.
PART_ATTEMPTS = 4


class _ActorPool:
    """The download actors and the calls they run. Each actor draws its own token, so files of an attempt
    that was lost with its host (perhaps still running, cut off) never share a name with the rerun's.

    No Ray-level restarts or retries: a call on a lost host fails within seconds while Ray still counts
    the node alive, and its retries would be spent before the node is declared dead. Instead a lost
    actor's calls go back in the queue and a fresh actor (new token) takes its place, wherever Ray finds
    room — the surviving hosts, or a host that joins."""

    def __init__(self, remote, args: tuple, specs: list[pa.Table], n_actors: int, log) -> None:
        self.remote, self.args, self.log = remote, args, log
        self.todo = list(reversed(specs))
        self.actors: dict = {}  # actor → token
        self.running: dict = {}  # call → (actor, spec)
        self.attempts: dict[int, int] = {}
        for _ in range(n_actors):
            self._start_actor()

    def extend(self, specs: list[pa.Table]) -> bool:
        """More parts (the next late pass) for the actors already running; whether any call runs now."""
        self.todo = list(reversed(specs)) + self.todo
        for actor in list(self.actors):
            for _ in range(1 + QUEUED_PER_ACTOR):
                self.submit(actor)
        return bool(self.running)

    def _start_actor(self) -> None:
        token = uuid.uuid4().hex[:16]
        actor = self.remote.remote(self.args[0], self.args[1], token, *self.args[2:])
        self.actors[actor] = token
        for _ in range(1 + QUEUED_PER_ACTOR):
            self.submit(actor)

    def submit(self, actor) -> None:
        if self.todo:
            spec = self.todo.pop()
            self.running[actor.__call__.remote(spec)] = (actor, spec)

    def lost(self, actor, exc: Exception) -> None:
        """Every call of ``actor`` back in the queue (its host or process is gone), a fresh actor instead."""
        import ray

        self.actors.pop(actor, None)
        ray.kill(actor, no_restart=True)
        for ref, (owner, spec) in list(self.running.items()):
            if owner is actor:
                del self.running[ref]
                part = int(spec.column("part")[0].as_py())
                self.attempts[part] = self.attempts.get(part, 0) + 1
                if self.attempts[part] >= PART_ATTEMPTS:
                    raise RuntimeError(
                        f"download part {part} was lost {PART_ATTEMPTS} times, last: {exc}"
                    ) from exc
                self.todo.append(spec)
        self.log(f"  a download actor was lost ({type(exc).__name__}); its parts go to another actor")
        self._start_actor()

    def close(self) -> None:
        import ray

        for actor in self.actors:  # their CPUs go back to the later stages; a failed build leaves none behind
            ray.kill(actor)


def _run_parts(meta: Metadata, specs: list[pa.Table], cfg: BuildConfig, store: Storage, paths, more, log):
    """Each part's spec on a pool of ``DownloadPart`` Ray actors; yields (spec, token of the files it
    wrote, its rows) as each finishes. A part lost with its actor runs again on another one. When every
    part yielded so far is done (and committed by the caller), ``more()`` gives the next specs, run on the
    same actors; none ends the download.

    Plain actors rather than a Ray Data actor pool: a download part is one call, and Ray Data's executor,
    stats and autoscaling actors and idle workers cost 14% of a build's CPU on 2 cores
    (docs/decisions/0014-download-parts-on-plain-ray-actors.md).
    """
    # The Storage object travels to the actors with its credentials: their processes need no AWS env.
    args = (cfg.download, paths["parts"], store, list(meta.files), cfg.max_caption_bytes)
    specs = specs or more()  # a resumed build may owe only a late pass
    if cfg.download_actors == 0:  # in the driver's own process, no Ray: a tiny pool, the kill suite
        token = uuid.uuid4().hex[:16]
        local = DownloadPart(args[0], args[1], token, *args[2:])
        try:
            while specs:
                for spec in specs:
                    yield spec, token, local(spec)
                specs = more()
        finally:
            local.worker.close()
        return
    import ray
    from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

    options: dict = {"num_cpus": cfg.download_cpus, "max_restarts": 0, "max_task_retries": 0}
    if cfg.data_label_selector:  # pipeline/common/placement.py: downloads run on the data nodes
        options["label_selector"] = {str(k): str(v) for k, v in cfg.data_label_selector.items()}
    remote = ray.remote(DownloadPart).options(**options)
    pool = _ActorPool(remote, args, specs, max(1, min(cfg.download_actors, len(specs))), log)
    try:
        while pool.running or pool.extend(more()):
            [ref], _ = ray.wait(list(pool.running), num_returns=1)
            actor, spec = pool.running.pop(ref)
            try:
                summary = ray.get(ref)
            except (RayActorError, ObjectLostError) as exc:  # the host or the process went away
                pool.running[ref] = (actor, spec)
                pool.lost(actor, exc)
                continue
            except RayTaskError as exc:
                if not _storage_out_of_reach(exc.cause):
                    raise
                # Its host is cut off from the store, and so are its other calls: all go to another actor.
                pool.running[ref] = (actor, spec)
                pool.lost(actor, exc.cause)
                continue
            pool.submit(actor)
            yield spec, pool.actors.get(actor, ""), summary
    finally:
        pool.close()


def _storage_out_of_reach(exc: BaseException | None) -> bool:
    """Whether a part call failed reaching storage (the store unreachable, refusing or full), as from a host
    cut off the network: such a part goes to another actor, and a store out of reach for every host stops
    the build once a part has been lost ``PART_ATTEMPTS`` times."""
    if isinstance(exc, StorageError):
        return True
    return isinstance(exc, OSError) and isinstance(os_error(exc, ""), StorageError)
