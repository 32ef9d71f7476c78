"""Webdataset tar shards: writing them, and the stats and sizes JSON beside them.

Layout (img2dataset's, which DataComp's resharder and open_clip read): ``{shard:08d}.tar`` holding
``{key}.jpg``, ``{key}.txt``, ``{key}.json`` per sample — the members of one sample contiguous, always in
that order (other extensions after them, sorted) — and ``{shard:08d}_stats.json`` beside it with
img2dataset's fields (``count``, ``successes``, ``failed_to_download``, ``failed_to_resize``, times,
``status_dict``). A finished shard set also gets ``sizes.json`` (open_clip's convention: shard file name →
sample count, ``{"00000000.tar": 10000, ...}``), from which open_clip_train's ``get_dataset_size`` reads
the number of samples, so it needs no ``--train-num-samples``. Download *parts* use the same tar layout
with key = uid (``part-{i:06d}.tar``).

The tar bytes are produced here rather than by ``tarfile``'s stream writer so every header is fixed
(mtime 0, uid/gid 0, mode 0644, no user names): the same samples always give byte-identical shards.
Reading is a small streaming parser of its own for the opposite reason: ``tarfile`` stops silently at a
damaged or truncated header, and a shard cut at a member boundary looks complete to it. ``iter_shard``
instead demands the end-of-archive block and raises ``ShardError`` naming the file. Memory while reading
is one sample; while writing, nothing beyond the caller's sample.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeline import schema as S
from pipeline.common import faults, storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.tar_format import BLOCK, MEMBER_ORDER, RECORD, member_header, shard_name, stats_name

# --- writing ------------------------------------------------------------------------------------------


def _as_bytes(ext: str, value: Any) -> bytes | None:
    if value is None:
        return b"" if ext == "txt" else None  # img2dataset writes an empty caption rather than none
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, ensure_ascii=False, default=storage.json_default).encode("utf-8")


def sample_members(sample: Mapping[str, Any] | Sequence[Any]) -> tuple[str, list[tuple[str, bytes]]]:
    """(key, [(ext, bytes), ...]) in the canonical member order.

    ``sample`` is a dict with ``__key__`` (or ``key``) plus one entry per extension — bytes as they are,
    str as UTF-8, anything else as JSON — or a tuple ``(key, jpg_bytes, caption, meta_dict)``.
    """
    if isinstance(sample, Mapping):
        key = sample.get("__key__", sample.get("key"))
        fields = {k: v for k, v in sample.items() if not k.startswith("__") and k != "key"}
    else:
        key, jpg, caption, meta = sample
        fields = {"jpg": jpg, "txt": caption, "json": meta}
    if not isinstance(key, str) or not key or "." in key or "/" in key:
        raise ValueError(f"sample key must be a non-empty string without '.' or '/', got {key!r}")
    order = [e for e in MEMBER_ORDER if e in fields] + sorted(e for e in fields if e not in MEMBER_ORDER)
    members = []
    for ext in order:
        data = _as_bytes(ext, fields[ext])
        if data is not None:
            members.append((ext, data))
    if not members:
        raise ValueError(f"sample {key!r} has no members")
    return key, members


class ShardWriter:
    """Write one tar shard sample by sample; published atomically on ``close()`` (see pipeline.common.storage).

    ``with ShardWriter(path) as w: w.write(sample)``; an exception inside the block discards the shard.
    """

    def __init__(self, path: str, store: Storage = LOCAL) -> None:
        self.path = path
        self.count = 0
        self.nbytes = 0
        self._out = store.open_output(path)

    def write(self, sample: Mapping[str, Any] | Sequence[Any]) -> None:
        key, members = sample_members(sample)
        self.write_members(key, members)

    def write_members(self, key: str, members: Sequence[tuple[str, bytes]]) -> None:
        """Low-level: members written as given (bytes untouched) — resharding copies through this."""
        faults.point("shard.sample")
        for ext, data in members:
            self._put(member_header(f"{key}.{ext}", len(data)))
            self._put(data)
            pad = -len(data) % BLOCK
            if pad:
                self._put(b"\0" * pad)
        self.count += 1

    def _put(self, data: bytes) -> None:
        self._out.write(data)
        self.nbytes += len(data)

    def close(self) -> None:
        end = 2 * BLOCK + (-(self.nbytes + 2 * BLOCK) % RECORD)
        self._put(b"\0" * end)
        self._out.close()

    def abort(self) -> None:
        self._out.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


class PartWriter(ShardWriter):
    """A download part: a shard whose keys are the samples' uids (validated), json carrying ``uid``."""

    def add(self, uid: str, jpg: bytes, caption: str | None, meta: Mapping[str, Any]) -> None:
        if not S.is_valid_uid(uid):
            raise ValueError(f"part sample key must be a 32-hex uid, got {uid!r}")
        self.write({"__key__": uid, "jpg": jpg, "txt": caption, "json": {S.UID: uid, **meta}})


def write_shard(
    path: str, samples: Iterable[Mapping[str, Any] | Sequence[Any]], store: Storage = LOCAL
) -> int:
    """Write ``samples`` to one tar at ``path`` (local or s3://); returns the number written."""
    with ShardWriter(path, store) as w:
        for s in samples:
            w.write(s)
    return w.count


# --- stats --------------------------------------------------------------------------------------------


def shard_stats(status_counts: Mapping[str, int], start_time: float, end_time: float | None = None) -> dict:
    """img2dataset's ``{shard}_stats.json`` fields from per-status counts (``failed_to_*`` families summed)."""
    end = time.time() if end_time is None else end_time
    counts = {str(k): int(v) for k, v in sorted(status_counts.items())}
    return {
        "count": sum(counts.values()),
        "successes": counts.get(S.STATUS_SUCCESS, 0),
        "failed_to_download": sum(v for k, v in counts.items() if k.startswith(S.DOWNLOAD_FAILED)),
        "failed_to_resize": sum(v for k, v in counts.items() if k.startswith(S.RESIZE_FAILED)),
        "duration": end - start_time,
        "start_time": start_time,
        "end_time": end,
        "status_dict": counts,
    }


def write_stats(path: str, stats: Mapping[str, Any], store: Storage = LOCAL) -> None:
    store.write_json(dict(stats), path)


SIZES_NAME = "sizes.json"


def write_sizes(directory: str, counts: Mapping[str, int], store: Storage = LOCAL) -> str:
    """``directory/sizes.json``: each shard's base name → its sample count (open_clip's convention)."""
    path = storage.join(directory, SIZES_NAME)
    store.write_json({str(k).rsplit("/", 1)[-1]: int(v) for k, v in counts.items()}, path)
    return path


class RollingWriter:
    """Numbered shards ``{i:08d}.tar`` of ``samples_per_shard`` samples in ``out``, each closed one with its
    stats file; ``close()`` writes ``sizes.json`` for the set (the resharder's output)."""

    def __init__(self, out: str, samples_per_shard: int, store: Storage, first_shard: int = 0) -> None:
        self.out, self.per_shard, self.store = out, samples_per_shard, store
        self.first = first_shard  # a window of a larger set (pipeline/stages/shard_stages.py) starts there
        self.total = 0
        self.shards: list[str] = []
        self.counts: list[int] = []
        self._writer: ShardWriter | None = None
        self._started = 0.0

    def write(self, key: str, members: list[tuple[str, bytes]]) -> None:
        if self._writer is None:
            path = storage.join(self.out, shard_name(self.first + len(self.shards)))
            self._writer, self._started = ShardWriter(path, self.store), time.time()
        self._writer.write_members(key, members)
        self.total += 1
        if self._writer.count == self.per_shard:
            self._finish()

    def _finish(self) -> None:
        assert self._writer is not None
        self._writer.close()
        i = self.first + len(self.shards)
        self.shards.append(self._writer.path)
        self.counts.append(self._writer.count)
        stats = shard_stats({S.STATUS_SUCCESS: self._writer.count}, self._started)
        write_stats(storage.join(self.out, stats_name(i)), stats, self.store)
        self._writer = None

    def close(self, sizes: bool = True) -> None:
        """Finish the open shard and write ``sizes.json`` for the whole set (unless a window of it)."""
        if self._writer is not None:
            self._finish()
        if sizes:
            write_sizes(self.out, dict(zip(self.shards, self.counts, strict=True)), self.store)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
