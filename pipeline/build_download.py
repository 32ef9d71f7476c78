"""The build's download phase: cut the download parts, run them on the ``DownloadPart`` actor pool, commit.

Part k is the k-th range of ``part_size`` live rows (``status_pre == ""``) in read order (files in
``Storage.list_files`` order, rows in file order; pipeline/metadata.py). The driver sends one small Arrow
block per part holding only its rows' (file index, row index) positions; each actor reads those rows from
the metadata files itself, so nothing passes over every row and nothing is shuffled before the first part
starts. A ``retry_failed`` part's block lists only its transient rows. The driver commits a part when it
receives the part's rows (pipeline/runstate.py), and the fingerprint pins the row order and the live rows,
so a resumed build cuts the same parts.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import runstate as R
from pipeline import schema as S
from pipeline.config import BuildConfig
from pipeline.metadata import Metadata
from pipeline.parts import DownloadPart
from pipeline.placement import scope_dataset
from pipeline.storage import Storage


@dataclass(frozen=True)
class PoolRows:
    """What the parts are cut from: the checked files, every row's uid in read order, the live mask."""

    meta: Metadata
    uids: pa.ChunkedArray | pa.Array
    live: np.ndarray


def download_parts(
    rows: PoolRows, cfg: BuildConfig, store: Storage, paths: dict[str, str], log: Callable[[str], None]
) -> tuple[int, int, int]:
    """Download the parts not committed yet (Ray actors) → (parts, parts done before, rows retried)."""
    n_parts = math.ceil(int(rows.live.sum()) / cfg.part_size)
    store.makedirs(paths["parts"])
    done = R.committed(paths["parts"], store)
    done = {p: t for p, t in done.items() if p < n_parts}
    R.remove_uncommitted(paths["parts"], done, store)
    retry = _transient_rows(paths["parts"], done, store) if cfg.retry_failed else {}
    todo = sorted(set(range(n_parts)) - set(done))
    n_retry = sum(len(u) for u in retry.values())
    log(
        f"download: {n_parts} parts of {cfg.part_size} rows, {len(done)} already done"
        + (f"; retrying {n_retry} transient rows in {len(retry)} parts" if cfg.retry_failed else "")
    )
    specs = part_specs(rows, cfg.part_size, todo, retry)
    if not specs:
        return n_parts, len(done), 0
    token = uuid.uuid4().hex[:16]
    results = _download_dataset(rows.meta, specs, cfg, store, paths, retry, token)
    finished: set[int] = set()
    for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
        new = set(batch.column("part").to_pylist()) - finished
        for part in sorted(new):
            R.commit(paths["parts"], part, token, store)  # the driver is alive: the part counts
        finished |= new
        ok = pc.sum(pc.equal(batch.column(S.STATUS), S.STATUS_SUCCESS)).as_py() or 0
        log(f"  part(s) done: {len(finished)}/{len(specs)} (+{batch.num_rows} rows, {ok} images)")
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


def _download_dataset(meta: Metadata, specs, cfg: BuildConfig, store: Storage, paths, retry, token: str):
    """The Ray Data pipeline: a block of row positions per part → ``DownloadPart`` actors → parts' rows."""
    import ray.data

    ds = from_arrow_scoped(specs, cfg.data_label_selector)
    return ds.map_batches(
        DownloadPart,
        # The Storage object travels to the actors with its credentials: their processes need no AWS env.
        fn_constructor_args=(
            cfg.download,
            paths["parts"],
            token,
            {p: _done_token(paths, p, store) for p in retry},
            store,
            list(meta.files),
            cfg.max_caption_bytes,
        ),
        batch_size=None,  # a block is a part: DownloadPart splits a batch by part anyway
        compute=ray.data.ActorPoolStrategy(size=max(1, min(cfg.download_actors, len(specs)))),
        # Downloads mostly wait on the network: a fractional CPU leaves room for the other stages' actors
        # (a whole CPU per actor deadlocks a 2-CPU machine).
        num_cpus=cfg.download_cpus,
        batch_format="pyarrow",
    )


def _done_token(paths: dict[str, str], part: int, store: Storage) -> str:
    return store.read_json(R.marker(paths["parts"], part))["token"]


def from_arrow_scoped(tables: list[pa.Table], selector: dict[str, str] | None):
    """``ray.data.from_arrow(tables)`` scoped to ``selector`` (pipeline/placement.py), including the tasks
    it starts itself: Ray 2.60 computes each block's metadata in a remote task that takes its label
    selector from the *current* DataContext, not from the dataset's."""
    import ray.data

    current = ray.data.DataContext.get_current().execution_options
    before = current.label_selector
    if selector:
        current.label_selector = {str(k): str(v) for k, v in selector.items()}
    try:
        ds = ray.data.from_arrow(tables)  # its context is a deep copy of the current one
    finally:
        current.label_selector = before
    return scope_dataset(ds, selector)
