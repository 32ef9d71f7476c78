"""The build's download phase: cut the download parts, run them on ``DownloadPart`` Ray actors, commit.

Part k is the k-th range of ``part_size`` live rows in read order (files in ``Storage.list_files``
order, rows in file order; pipeline/source/metadata.py). The driver knows only each file's live-row count
(pipeline/stages/row_stages.py) and plans a part as a few ``(file, first, last)`` ranges of live rows
(``PartSpec``), one part at a time as the actors ask: each actor reads the row numbers of its ranges (one
ranged read per file) and then those rows from the metadata files itself, so the driver holds no row and
nothing passes over every row before the first part starts. A part looked at again (``retry_failed``,
``refresh_changed``, a late pass) names the token of its committed files, and the actor picks the rows to
fetch again from them. The driver commits a part when it receives the part's rows
(pipeline/source/run_state.py), and the fingerprint pins the row order and the live rows, so a resumed
build cuts the same parts.

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

from pipeline.common.errors import StorageError, os_error
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig
from pipeline.download.part import FETCHED, DownloadPart
from pipeline.source import run_state as R
from pipeline.stages.layout import Pool


@dataclass(frozen=True)
class PartSpec:
    """One download call: part ``part``'s live rows ``(file, lo, hi)`` (positions in each file's live-row
    list, pipeline/stages/row_stages.py); ``again``: "" to download them all, "transient" or "changed" to
    fetch again only the rows of the committed part (files ``merge``) whose status is transient or whose
    content differs from the pool's now — the actor finds them itself."""

    part: int
    ranges: tuple[tuple[int, int, int], ...]
    merge: str = ""
    again: str = ""


@dataclass(frozen=True)
class LivePlan:
    """What the parts are cut from: the pool's stage layout and each file's live-row count."""

    pool: Pool
    live: tuple[int, ...]

    def n_parts(self, part_size: int) -> int:
        return math.ceil(sum(self.live) / part_size)

    def spec(self, part: int, part_size: int, merge: str = "", again: str = "") -> PartSpec:
        """Part ``part`` = the live rows ``part·part_size .. (part+1)·part_size`` in read order."""
        lo, hi = part * part_size, (part + 1) * part_size
        ranges, start = [], 0
        for f, n in enumerate(self.live):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                ranges.append((f, a - start, b - start))
            start += n
            if start >= hi:
                break
        return PartSpec(part, tuple(ranges), merge, again)


def download_parts(
    plan: LivePlan,
    cfg: BuildConfig,
    store: Storage,
    paths: dict[str, str],
    log: Callable[[str], None],
    allow_hosts: Sequence[str] = (),
) -> tuple[dict[int, R.Marker], int, int]:
    """Download the parts not committed yet (Ray actors), then the late retry passes → (every committed
    part's marker, parts done before, rows fetched again by ``retry_failed``/``refresh_changed``).
    ``allow_hosts``: address-guard entries for this run only (pipeline/demo/source.py)."""
    n_parts = plan.n_parts(cfg.part_size)
    store.makedirs(paths["parts"])
    markers = {p: m for p, m in R.committed_markers(paths["parts"], store).items() if p < n_parts}
    R.remove_uncommitted(paths["parts"], store)
    again = {}
    if cfg.retry_failed:
        again.update({p: "transient" for p, m in markers.items() if m.transient != 0})
    if cfg.refresh_changed:  # the actors compare each row's content digest with the part's
        again.update({p: "changed" for p in markers})
    todo = sorted(set(range(n_parts)) - set(markers))
    log(
        f"download: {n_parts} parts of {cfg.part_size} rows, {len(markers)} already done"
        + (
            f"; {len(again)} of them looked at again ({', '.join(sorted(set(again.values())))})"
            if again
            else ""
        )
    )
    late = _LatePasses(plan, cfg, store, paths, markers, log)
    specs = [plan.spec(p, cfg.part_size) for p in todo]
    specs += [plan.spec(p, cfg.part_size, markers[p].token, why) for p, why in sorted(again.items())]
    late.total = len(specs)
    if not specs and not late.due():
        return markers, len(markers), 0
    download = dataclasses.replace(cfg.download, allow_hosts=[*cfg.download.allow_hosts, *allow_hosts])
    cfg = dataclasses.replace(cfg, download=download)
    for spec, token, counts in _run_parts(plan.pool, specs, cfg, store, paths, late.next_pass, log):
        late.commit(spec, token, counts)
    R.remove_uncommitted(paths["parts"], store)
    if late.refetched[0]:
        log(f"download: {late.refetched[0]} rows of {late.refetched[1]} parts downloaded again")
    return late.markers, len(markers), late.refetched[0]


class _LatePasses:
    """The driver's side of the parts: commits each part as its rows arrive, and once every part is done
    hands out the late retry passes — each part with transient rows fetched again (``download.late_retries``
    times at most), when an outage or a host cut off the network has had time to pass. A part's marker
    counts its transient rows and its late passes, so a resumed build runs exactly the passes a clean one
    would (docs/download.md, "Late retries"). The driver holds a marker per part, never a row."""

    def __init__(
        self, plan, cfg: BuildConfig, store: Storage, paths, markers: dict[int, R.Marker], log
    ) -> None:
        self.plan, self.cfg, self.store, self.parts, self.log = plan, cfg, store, paths["parts"], log
        self.markers = dict(markers)
        self.passes, self.finished, self.total = 0, 0, 0  # late passes run; parts done of this pass's
        self.refetched = [0, 0]  # rows and parts fetched again by retry_failed / refresh_changed

    def commit(self, spec: PartSpec, token: str, counts: dict[str, int]) -> None:
        """Part ``spec``'s ``counts`` arrived (its files written under ``token``): the driver is alive, it
        counts. No rows of a part looked at again: nothing changed, its marker stays."""
        self.finished += 1
        if spec.again and counts["rows"] == 0:
            return
        if spec.again and not self.passes:
            self.refetched[0] += counts[FETCHED]
            self.refetched[1] += 1
        old = self.markers.get(spec.part)
        late = 0 if old is None else old.late + (self.passes > 0)
        seq = 0 if old is None else old.seq + 1
        self.markers[spec.part] = R.commit(
            self.parts, spec.part, token, self.store, counts["transient"], late, seq
        )
        self.log(
            f"  part(s) done: {self.finished}/{self.total} (+{counts['rows']} rows, {counts['success']} images)"
        )

    def due(self) -> list[int]:
        """Every part still owed a late pass (a marker that does not count its transient rows: owed)."""
        return sorted(
            p for p, m in self.markers.items() if m.late < self.cfg.download.late_retries and m.transient != 0
        )

    def next_pass(self) -> list[PartSpec]:
        """The next late pass's specs (none: the download is over)."""
        parts = self.due()
        if not parts:
            return []
        self.passes += 1
        n = sum(self.markers[p].transient or 0 for p in parts)
        self.log(f"download: late retry pass {self.passes}: {n} transient rows of {len(parts)} parts again")
        specs = [self.plan.spec(p, self.cfg.part_size, self.markers[p].token, "transient") for p in parts]
        self.finished, self.total = 0, len(specs)
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

    def __init__(self, remote, args: tuple, specs: list[PartSpec], n_actors: int, log) -> None:
        self.remote, self.args, self.log = remote, args, log
        self.todo = list(reversed(specs))
        self.actors: dict = {}  # actor → token
        self.running: dict = {}  # call → (actor, spec)
        self.attempts: dict[int, int] = {}
        for _ in range(n_actors):
            self._start_actor()

    def extend(self, specs: list[PartSpec]) -> bool:
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
                part = spec.part
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


def _run_parts(pool: Pool, specs: list[PartSpec], cfg: BuildConfig, store: Storage, paths, more, log):
    """Each part's spec on a pool of ``DownloadPart`` Ray actors; yields (spec, token of the files it
    wrote, its rows) as each finishes. A part lost with its actor runs again on another one. When every
    part yielded so far is done (and committed by the caller), ``more()`` gives the next specs, run on the
    same actors; none ends the download.

    Plain actors rather than a Ray Data actor pool: a download part is one call, and Ray Data's executor,
    stats and autoscaling actors and idle workers cost 14% of a build's CPU on 2 cores
    (docs/decisions/0014-download-parts-on-plain-ray-actors.md).
    """
    # The Storage object travels to the actors with its credentials: their processes need no AWS env.
    args = (cfg.download, paths["parts"], store, pool)
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
    actors = _ActorPool(remote, args, specs, max(1, min(cfg.download_actors, len(specs))), log)
    try:
        while actors.running or actors.extend(more()):
            [ref], _ = ray.wait(list(actors.running), num_returns=1)
            actor, spec = actors.running.pop(ref)
            try:
                summary = ray.get(ref)
            except (RayActorError, ObjectLostError) as exc:  # the host or the process went away
                actors.running[ref] = (actor, spec)
                actors.lost(actor, exc)
                continue
            except RayTaskError as exc:
                if not _storage_out_of_reach(exc.cause):
                    raise
                # Its host is cut off from the store, and so are its other calls: all go to another actor.
                actors.running[ref] = (actor, spec)
                actors.lost(actor, exc.cause)
                continue
            actors.submit(actor)
            yield spec, actors.actors.get(actor, ""), summary
    finally:
        actors.close()


def _storage_out_of_reach(exc: BaseException | None) -> bool:
    """Whether a part call failed reaching storage (the store unreachable, refusing or full), as from a host
    cut off the network: such a part goes to another actor, and a store out of reach for every host stops
    the build once a part has been lost ``PART_ATTEMPTS`` times."""
    if isinstance(exc, StorageError):
        return True
    return isinstance(exc, OSError) and isinstance(os_error(exc, ""), StorageError)
