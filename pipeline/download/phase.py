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
off, process dead) runs again on another actor, within the same build (``_ActorPool``).
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
    """Download the parts not committed yet (Ray actors) → (parts, parts done before, rows retried).
    ``allow_hosts``: address-guard entries for this run only (pipeline/demo/source.py)."""
    n_parts = math.ceil(int(rows.live.sum()) / cfg.part_size)
    store.makedirs(paths["parts"])
    done = R.committed(paths["parts"], store)
    done = {p: t for p, t in done.items() if p < n_parts}
    R.remove_uncommitted(paths["parts"], done, store)
    retry = _transient_rows(paths["parts"], done, store) if cfg.retry_failed else {}
    if cfg.refresh_changed and rows.content is not None:  # rows whose URL, caption, sha256 or boxes changed
        pool = (rows.uids, rows.live, rows.content)
        for part, uids in R.changed_rows(paths["parts"], done, pool, cfg.part_size, store).items():
            retry[part] = retry.get(part, set()) | uids
    todo = sorted(set(range(n_parts)) - set(done))
    n_retry = sum(len(u) for u in retry.values())
    log(
        f"download: {n_parts} parts of {cfg.part_size} rows, {len(done)} already done"
        + (f"; downloading {n_retry} rows of {len(retry)} parts again" if retry else "")
    )
    specs = part_specs(rows, cfg.part_size, todo, retry)
    if not specs:
        return n_parts, len(done), 0
    finished = 0
    download = dataclasses.replace(cfg.download, allow_hosts=[*cfg.download.allow_hosts, *allow_hosts])
    for part, token, summary in _run_parts(
        rows.meta, specs, dataclasses.replace(cfg, download=download), store, paths, retry, log
    ):
        R.commit(paths["parts"], part, token, store)  # the driver is alive: the part counts
        finished += 1
        ok = pc.sum(pc.equal(summary.column(S.STATUS), S.STATUS_SUCCESS)).as_py() or 0
        log(f"  part(s) done: {finished}/{len(specs)} (+{summary.num_rows} rows, {ok} images)")
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


def part_specs(rows: PoolRows, part_size: int, todo: list[int], retry: dict[int, set[str]]) -> list[pa.Table]:
    """One small table per part to download: ``part`` and the (``file``, ``row``) position of each of its
    rows — part k is the k-th range of ``part_size`` live rows in read order; a retried part lists only its
    transient rows."""
    live = np.flatnonzero(rows.live)
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
        specs.append(
            pa.table(
                {
                    "part": pa.array(np.full(len(mine), part), pa.int64()),
                    "file": pa.array(file_idx, pa.int32()),
                    "row": pa.array(row_idx, pa.int64()),
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


def _run_parts(meta: Metadata, specs: list[pa.Table], cfg: BuildConfig, store: Storage, paths, retry, log):
    """Each part's spec on a pool of ``DownloadPart`` Ray actors; yields (part, token of the files it
    wrote, its rows) as each finishes. A part lost with its actor runs again on another one.

    Plain actors rather than a Ray Data actor pool: a download part is one call, and Ray Data's executor,
    stats and autoscaling actors and idle workers cost 14% of a build's CPU on 2 cores
    (docs/decisions/0014-download-parts-on-plain-ray-actors.md).
    """
    # The Storage object travels to the actors with its credentials: their processes need no AWS env.
    args = (cfg.download, paths["parts"], {p: _done_token(paths, p, store) for p in retry}, store,
            list(meta.files), cfg.max_caption_bytes)  # fmt: skip
    if cfg.download_actors == 0:  # in the driver's own process, no Ray: a tiny pool, the kill suite
        token = uuid.uuid4().hex[:16]
        local = DownloadPart(args[0], args[1], token, *args[2:])
        try:
            for spec in specs:
                yield int(spec.column("part")[0].as_py()), token, local(spec)
        finally:
            local.worker.close()
        return
    import ray
    from ray.exceptions import ObjectLostError, RayActorError

    options: dict = {"num_cpus": cfg.download_cpus, "max_restarts": 0, "max_task_retries": 0}
    if cfg.data_label_selector:  # pipeline/common/placement.py: downloads run on the data nodes
        options["label_selector"] = {str(k): str(v) for k, v in cfg.data_label_selector.items()}
    remote = ray.remote(DownloadPart).options(**options)
    pool = _ActorPool(remote, args, specs, max(1, min(cfg.download_actors, len(specs))), log)
    try:
        while pool.running:
            [ref], _ = ray.wait(list(pool.running), num_returns=1)
            actor, spec = pool.running.pop(ref)
            try:
                summary = ray.get(ref)
            except (RayActorError, ObjectLostError) as exc:  # the host or the process went away
                pool.running[ref] = (actor, spec)
                pool.lost(actor, exc)
                continue
            pool.submit(actor)
            yield int(spec.column("part")[0].as_py()), pool.actors.get(actor, ""), summary
    finally:
        pool.close()


def _done_token(paths: dict[str, str], part: int, store: Storage) -> str:
    return store.read_json(R.marker(paths["parts"], part))["token"]
