"""The one reader of our webdataset shards: listing them, and one shard → columnar chunks (no Ray here).

Training ingest, scoring and embedding all read shards through ``ShardReader``; pipeline/ingest/dataset.py
wraps it as Ray Data's file-based read (one read task per shard). Why not ``read_webdataset``: Ray's
reader streams through ``tarfile`` in ``r|`` mode, which silently stops at a damaged header or at a shard
cut on a member boundary (a 10-sample shard cut after 5 reads as 5 samples; tested), so a corrupt shard
could never be counted. We parse with ``pipeline.shards.writer.iter_shard``, which demands the end-of-archive
block: the intact samples before the damage are kept, the rest of the shard is skipped with a warning,
and the distinct damaged shards are counted by a ``report`` callable (in a Ray job, the shared counters
actor of pipeline/ingest/dataset.py). Past ``max_bad_shards`` the read raises ``TooManyBadShards`` naming the
shard, which stops the job.

Output columns: ``key`` (string), ``jpg`` (binary: the sample's image, whichever of ``IMAGE_EXTS`` it
has), ``txt`` (string) and, with ``with_json``, ``json`` (binary, empty when the sample has none). A
sample without an image is skipped, as webdataset does: it can neither train nor be scored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pyarrow as pa

from pipeline.common.storage import LOCAL, Storage
from pipeline.shards import writer as shards

log = logging.getLogger(__name__)

READ_CHUNK_ROWS = 256  # rows per table yielded for one shard: a few MB of JPEG bytes
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # image members, in order of preference (webdataset's)

BadShardReport = Callable[[str, str], int]  # (shard path, error) → distinct damaged shards so far


class TooManyBadShards(RuntimeError):
    """More distinct corrupt/truncated shards than ``max_bad_shards``; names the last one."""


def list_shards(spec: str, store: Storage = LOCAL) -> list[str]:
    """Shard paths from a directory, a glob, or a comma-separated list (local or s3://), sorted."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.endswith(".tar") and not any(c in part for c in "*?["):
            out.append(part)
        else:
            out.extend(store.list_files(part, suffix=".tar"))
    if not out:
        raise FileNotFoundError(f"no .tar shards at {spec!r}")
    return sorted(set(out))


def _text(value: bytes | None) -> str:
    return "" if value is None else bytes(value).decode("utf-8", "replace")


class ShardReader:
    """One shard path → ``pa.Table`` chunks of at most ``chunk_rows`` samples (columns: module docstring).

    ``max_bad_shards=None`` logs damaged shards and goes on (scoring: every intact pair still gets a
    score); an int stops the read once ``report`` says more distinct shards than that are damaged.
    Without ``report`` each damaged shard counts as the first one.
    """

    def __init__(
        self,
        store: Storage = LOCAL,
        *,
        max_bad_shards: int | None = None,
        report: BadShardReport | None = None,
        with_json: bool = False,
        chunk_rows: int = READ_CHUNK_ROWS,
    ) -> None:
        self.store, self.max_bad, self.report = store, max_bad_shards, report
        self.with_json, self.chunk_rows = with_json, chunk_rows
        self.extensions = {*IMAGE_EXTS, "txt", *(("json",) if with_json else ())}

    def __call__(self, path: str) -> Iterator[pa.Table]:
        rows: list[dict[str, bytes | None]] = []
        try:
            for s in shards.iter_shard(path, self.store, decode=False, extensions=self.extensions):
                image = next((s[e] for e in IMAGE_EXTS if e in s), None)
                if image is None:
                    continue  # a sample without an image cannot train or be scored; webdataset skips it
                rows.append({"key": s["__key__"], "jpg": image, "txt": s.get("txt"), "json": s.get("json")})
                if len(rows) >= self.chunk_rows:
                    yield self._table(rows)
                    rows = []
        except (shards.ShardError, OSError) as exc:
            self._bad_shard(path, exc)
        if rows:
            yield self._table(rows)

    def _table(self, rows: list[dict[str, bytes | None]]) -> pa.Table:
        cols = {
            "key": pa.array([r["key"] for r in rows], pa.string()),
            "jpg": pa.array([r["jpg"] for r in rows], pa.binary()),
            "txt": pa.array([_text(r["txt"]) for r in rows], pa.string()),
        }
        if self.with_json:
            cols["json"] = pa.array([r["json"] or b"" for r in rows], pa.binary())
        return pa.table(cols)

    def _bad_shard(self, path: str, exc: Exception) -> None:
        n = self.report(path, f"{type(exc).__name__}: {exc}") if self.report is not None else 1
        if self.max_bad is not None and n > self.max_bad:
            raise TooManyBadShards(
                f"{n} damaged shards exceed data.max_bad_shards={self.max_bad}; last: {path} ({exc})"
            ) from exc
        log.warning("skipping the rest of damaged shard %s (%d so far): %s", path, n, exc)
