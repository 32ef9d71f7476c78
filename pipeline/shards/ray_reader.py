"""Our shards as a Ray dataset: Ray Data's file-based read with ``ShardReader`` as the parser.

What ``read_webdataset(decoder=None)`` does — one read task per shard, ``FileShuffleConfig`` shard order,
local or S3 through one ``Storage`` — but parsed strictly (pipeline/shards/reader.py), so damaged shards
are counted rather than silently cut short. ``from_arrow_scoped`` is the in-memory counterpart the build
uses for its own blocks, kept on the data nodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.data.datasource import FileBasedDatasource

from pipeline.common import storage
from pipeline.common.placement import scope_dataset
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.reader import BadShardReport, MismatchReport, ShardReader, list_shards

# --- the read -----------------------------------------------------------------------------------


class ShardDatasource(FileBasedDatasource):
    """Raw samples (module docstring of pipeline/shards/reader.py) read with ``ShardReader``.

    ``resample``: every execution (a training epoch) reads as many shards as there are, drawn with
    replacement from a generator seeded by (``resample``, execution index) — open_clip's
    ``--dataset-resampled``; a shard drawn twice is read twice. Ray's file shuffle then orders the draw."""

    _FILE_EXTENSIONS = ["tar"]

    def __init__(self, paths: list[str], reader: ShardReader, resample: int | None = None, **kw: Any) -> None:
        self._s3 = storage.is_s3(paths[0])
        fs, resolved = reader.store.filesystem_for(paths)
        super().__init__(resolved, filesystem=fs, **kw)
        self._reader = reader
        self._resample, self._draw = resample, None

    def get_read_tasks(self, parallelism: int, *args: Any, **kw: Any) -> list:
        if self._resample is None:
            return super().get_read_tasks(parallelism, *args, **kw)
        context = kw.get("data_context")
        execution = getattr(context, "_execution_idx", 0) if context is not None else 0
        n = len(super()._paths())
        self._draw = np.random.default_rng([self._resample, execution]).integers(0, n, n)
        try:
            return super().get_read_tasks(parallelism, *args, **kw)
        finally:
            self._draw = None

    def _paths(self) -> list[str]:
        paths = super()._paths()
        return paths if self._draw is None else [paths[i] for i in self._draw]

    def _file_sizes(self) -> list:
        sizes = super()._file_sizes()
        return sizes if self._draw is None else [sizes[i] for i in self._draw]

    def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
        # The strict parser opens the shard itself (through the Storage); nothing to open twice.
        return pa.BufferReader(b"")

    def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
        yield from self._reader(storage.S3_PREFIX + path if self._s3 else path)


def read_shards(
    shards: str | Sequence[str],
    store: Storage = LOCAL,
    *,
    report: BadShardReport | None = None,
    max_bad_shards: int | None = None,
    with_json: bool = False,
    shuffle: Any = None,
    num_cpus: float | None = None,
    verify: bool = False,
    on_mismatch: MismatchReport | None = None,
    resample: int | None = None,
) -> Any:
    """A ``ray.data.Dataset`` of raw samples, one read task per shard (directory, glob, list).

    ``report`` counts damaged shards across tasks (the ingest's counters actor, pipeline/ingest/dataset.py);
    ``max_bad_shards`` (None: no limit), ``with_json``, ``verify`` and ``on_mismatch`` as in ``ShardReader``;
    ``resample`` a seed: shards drawn with replacement every execution (``ShardDatasource``).
    """
    spec = shards if isinstance(shards, str) else ",".join(shards)
    reader = ShardReader(store, max_bad_shards=max_bad_shards, report=report, with_json=with_json,
                         verify=verify, on_mismatch=on_mismatch)  # fmt: skip
    source = ShardDatasource(list_shards(spec, store), reader, resample=resample, shuffle=shuffle)
    return ray.data.read_datasource(source, **({} if num_cpus is None else {"num_cpus": num_cpus}))


def from_arrow_scoped(tables: list[pa.Table], selector: dict[str, str] | None):
    """``ray.data.from_arrow(tables)`` scoped to ``selector`` (pipeline/common/placement.py), including the tasks
    it starts itself: Ray 2.60 computes each block's metadata in a remote task that takes its label
    selector from the *current* DataContext, not from the dataset's."""
    current = ray.data.DataContext.get_current().execution_options
    before = current.label_selector
    if selector:
        current.label_selector = {str(k): str(v) for k, v in selector.items()}
    try:
        ds = ray.data.from_arrow(tables)  # its context is a deep copy of the current one
    finally:
        current.label_selector = before
    return scope_dataset(ds, selector)
