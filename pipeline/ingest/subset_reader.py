"""Training straight from the build's shards through a DataComp subset ``.npy``: no resharded copy.

``DataConfig.subset`` names a subset (``u8,u8`` uids, DataComp's format, local or ``s3://``) of the pool in
``data.shards``. The shards are read as always (the strict reader, one task per shard) and each chunk keeps,
before it leaves the read task, the rows whose uid the subset lists — each as many times as it is listed,
as ``pipeline.subsets.reshard`` writes an up-sampled uid — so the training ingest sees the samples
``jobs.reshard`` would have written, without writing them (tests/pipeline/ingest/test_subset_reader.py
compares the two). A row's uid is its key when that is a 32-hex uid (the build's shards), else the
``uid`` of its ``.json``, as resharding reads it. The build writes every uid once, so a uid is never met
in two shards (resharding would write such a uid once; this reader once per shard holding it).

The subset reaches the read tasks as ``counts``, a callable giving its sorted distinct uids and their
counts: on Ray (pipeline/ingest/dataset.py) one task loads the file into the object store and every read
worker maps that one copy per node, zero-copy (24 bytes a distinct uid per node, none per process:
docs/decisions/0064-train-from-the-build-through-the-subset.md); without one, each process loads the path
once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline import schema as S
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.reader import ShardReader
from pipeline.subsets.uid_files import read_subset

_LOADED: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # subset path → (sorted distinct uids, counts)


def load_counts(path: str, store: Storage = LOCAL) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct ``u8,u8`` uids, how often each is listed) of the subset at ``path``."""
    with store.open_input(path, seekable=False) as fh:
        uids = read_subset(fh, name=path)
    return np.unique(uids.reshape(-1), return_counts=True)


def subset_counts(path: str, store: Storage = LOCAL) -> tuple[np.ndarray, np.ndarray]:
    """``load_counts`` once per process."""
    if path not in _LOADED:
        _LOADED.clear()  # one subset per process at a time is the common case
        _LOADED[path] = load_counts(path, store)
    return _LOADED[path]


def uid_array(uids: list[str]) -> np.ndarray:
    """32-hex uids → DataComp's ``u8,u8`` (high, low 64 bits)."""
    out = np.empty(len(uids), dtype=S.UID_DTYPE)
    out["f0"] = [int(u[:16], 16) for u in uids]
    out["f1"] = [int(u[16:], 16) for u in uids]
    return out


def repeats(uids: list[str | None], distinct: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 (n,): how many times each row is listed (0 when not, or when its uid is unknown)."""
    out = np.zeros(len(uids), dtype=np.int64)
    known = [i for i, u in enumerate(uids) if u is not None]
    if not known or not len(distinct):
        return out
    query = uid_array([uids[i] for i in known])
    at = np.minimum(np.searchsorted(distinct, query), len(distinct) - 1)
    hit = distinct[at] == query
    out[np.asarray(known)[hit]] = counts[at[hit]]
    return out


def row_uid(key: str, meta: bytes | None) -> str | None:
    """The uid resharding would read: a 32-hex key, else the ``.json`` member's ``uid``."""
    if S.is_valid_uid(key):
        return key.lower()
    try:
        uid = json.loads(meta).get(S.UID) if meta else None
    except (ValueError, AttributeError):
        return None
    return uid.lower() if S.is_valid_uid(uid) else None


class SubsetShardReader(ShardReader):
    """``ShardReader`` whose chunks hold only the subset's rows, each repeated as often as it is listed.
    ``counts``: where the subset's (sorted distinct uids, counts) come from; default ``subset_counts``."""

    def __init__(
        self,
        subset: str,
        store: Storage = LOCAL,
        counts: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(store, with_json=True, **kw)
        self.subset, self.counts = subset, counts

    def __call__(self, path: str) -> Iterator[pa.Table]:
        distinct, counts = self.counts() if self.counts else subset_counts(self.subset, self.store)
        for table in super().__call__(path):
            keys, metas = table.column("key").to_pylist(), table.column("json").to_pylist()
            uids = [row_uid(k, m) for k, m in zip(keys, metas, strict=True)]
            take = np.repeat(np.arange(table.num_rows), repeats(uids, distinct, counts))
            if take.size:
                yield table.drop_columns(["json"]).take(pa.array(take, pa.int64()))
