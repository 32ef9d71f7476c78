"""The eval reference built by a Ray Data pass over the eval sets' parts (decision 0099).

The driver lists the parts (shards, row chunks: ``reference.parts``) and receives only the reference
rows (``task``, ``key``, ``phash`` and, with a checkpoint, ``embedding``: tens of bytes a picture, or
the embedding's width); each worker reads one part at a time, hashes its pictures as it reads them and
encodes them a batch at a time (``reference.part_table``), so no picture's bytes leave the worker. The
rows come back in the harness's order, equal to ``reference.reference_table``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from pipeline.common.storage import LOCAL, Storage
from training.eval.reference import empty_reference, part_table, parts, save_reference
from training.eval.sets import Task

_PART = "_part"  # the part's position, to put the rows back in order


class _PartRows:
    """One part's reference rows per call; the encoder, when a checkpoint is given, loaded once."""

    def __init__(self, listed: list, store: Storage, checkpoint: str, batch: int) -> None:
        self.listed, self.store, self.batch = listed, store, batch
        self.encoder = None
        if checkpoint:
            from training.infer.encode import Encoder

            self.encoder = Encoder(checkpoint, store)

    def __call__(self, rows: dict[str, np.ndarray]) -> pa.Table:
        tables = []
        for p in rows["part"].tolist():
            task, i, part = self.listed[p]
            t = part_table(task, i, part, self.store, self.encoder, self.batch)
            tables.append(t.append_column(_PART, pa.array(np.full(t.num_rows, p, np.int64))))
        return pa.concat_tables(tables)


def _part_rows(rows: dict[str, np.ndarray], listed: list, store: Storage, batch: int) -> pa.Table:
    return _PartRows(listed, store, "", batch)(rows)


def build_reference(
    tasks: Sequence[Task], store: Storage = LOCAL, checkpoint: str = "", batch: int = 256,
    concurrency: int | None = None,
) -> pa.Table:  # fmt: skip
    """The reference of ``tasks`` (``reference.reference_table``'s rows and order), one Ray Data task (or,
    with a checkpoint, actor) per part; Ray must be initialised."""
    import ray

    listed = parts(tasks, store)
    if not listed:
        return empty_reference(bool(checkpoint))
    ds = ray.data.from_items([{"part": p} for p in range(len(listed))], override_num_blocks=len(listed))
    if checkpoint:  # the encoder loads once per actor
        args = (listed, store, checkpoint, batch)
        ds = ds.map_batches(_PartRows, fn_constructor_args=args, concurrency=concurrency or 1, batch_size=1)
    else:  # nothing to keep between parts: plain tasks
        ds = ds.map_batches(_part_rows, fn_args=(listed, store, batch), batch_size=1)
    tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
    if not tables:
        return empty_reference(bool(checkpoint))
    table = pa.concat_tables(tables).sort_by([(_PART, "ascending")])  # stable: a part's rows keep order
    return table.drop_columns([_PART])


def write_reference(
    tasks: Sequence[Task], out: str, store: Storage = LOCAL, checkpoint: str = ""
) -> dict[str, int]:
    """Write the reference parquet to ``out`` (built on the cluster); returns pictures per task."""
    return save_reference(build_reference(tasks, store, checkpoint), out, store)
