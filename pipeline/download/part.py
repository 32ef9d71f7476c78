"""One download part: read its rows, fetch them, write its tar and per-row parquet under the run's token.

A part is a consecutive range of the pool's live rows in read order (pipeline/download/phase.py cuts
them); the actor receives the part's ranges of live rows only, reads their row numbers (one ranged read
per file) and then the rows' columns from the metadata files (pipeline/source/metadata.py ``read_rows``),
so no row travels through the driver.
The files are ``part-{i:06d}.{token}.tar`` (successes only, keys = uids, sorted by uid) and ``.parquet``
(one row per uid, sorted by uid). The driver commits the part once it receives the rows this call returns
(pipeline/source/run_state.py). A retry (``retry_failed``, a late retry pass, ``refresh_changed``) names the
token of the committed part's files; the actor fetches again its transient (or changed) rows and merges
them with the rest of the committed part, so the new part holds exactly what a clean download would: the
same uids, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common import faults
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig, DownloadConfig
from pipeline.download.worker import DownloadWorker, memory_bound
from pipeline.shards.checksums import CHECKSUM_FIELD, stored_checksums
from pipeline.shards.reader import iter_shard
from pipeline.shards.writer import ShardWriter, sample_members
from pipeline.source.content import CONTENT, content_digests, served_hosts
from pipeline.source.metadata import READ_BATCH_ROWS, read_rows
from pipeline.source.row_checks import ROW_KEY
from pipeline.source.run_state import part_file
from pipeline.stages.layout import Pool
from pipeline.stages.row_stages import live_positions

PART_COLUMNS = [
    S.UID,
    S.STATUS,
    "error",
    S.WIDTH,
    S.HEIGHT,
    S.ORIGINAL_WIDTH,
    S.ORIGINAL_HEIGHT,
    S.IMAGE_SHA256,
    S.PHASH,
]


FETCHED = "fetched"  # how many of a call's rows were downloaded (the rest merged in from the committed part)

# A row's bytes besides its caption as a part holds it: uid, URL (DataComp's are < 2 kB), sha256, face
# boxes, the derived columns and Arrow's offsets.
ROW_BYTES = 4096


def part_memory_bound(cfg: BuildConfig) -> int:
    """Bytes a download actor may hold above its idle resident size while it runs one part.

    ``memory_bound(cfg.download)`` (the images in flight, docs/download.md) plus the part's rows: its
    ``part_size`` rows and one read batch of ``READ_BATCH_ROWS`` (pipeline/source/metadata.py
    ``read_rows``), each a caption of at most ``max_caption_bytes`` and ``ROW_BYTES`` more, twice (the
    table as read and as prepared). No term grows with the input's row groups or its other columns;
    a caption over ``max_caption_bytes`` (decided before download) is still decoded with its read batch.
    """
    rows = cfg.part_size + READ_BATCH_ROWS
    return memory_bound(cfg.download) + 2 * rows * (cfg.max_caption_bytes + ROW_BYTES)


class DownloadPart:
    """The download actor (a plain Ray actor, pipeline/download/phase.py), called on part specs
    (``phase.PartSpec``: the part's ranges of live rows, and for a part looked at again the token of its
    committed files and which rows to fetch again): reads the part's rows, downloads them, writes tar +
    parquet, returns the rows + ``part``.
    """

    def __init__(self, download: DownloadConfig, parts_dir: str, token: str, store: Storage, pool: Pool):
        self.worker = DownloadWorker(download)
        self.served = served_hosts(download.allow_hosts)  # content digests as the scan's (row_stages.py)
        self.parts_dir, self.token, self.store, self.pool = parts_dir, token, store, pool

    def __call__(self, spec) -> dict[str, int]:
        """Part ``spec`` downloaded and written; the counts the driver commits it by (a few numbers: the
        rows themselves stay in the part's files, never in the driver)."""
        rows = self.rows(spec)
        statuses = rows.column(S.STATUS).to_pylist()
        return {
            "rows": rows.num_rows,
            "success": statuses.count(S.STATUS_SUCCESS),
            "transient": sum(1 for s in statuses if S.is_transient(s)),
            FETCHED: int((rows.schema.metadata or {}).get(FETCHED.encode(), b"0")),
        }

    def rows(self, spec) -> pa.Table:
        """Part ``spec`` downloaded and written; its rows (none: a part looked at again with nothing to
        fetch, left as it is)."""
        files, rows = [], []
        for f, lo, hi in spec.ranges:
            positions = live_positions(self.pool, f, lo, hi)
            files.append(np.full(len(positions), f, np.int64))
            rows.append(positions)
        table = read_rows(
            self.pool.files, np.concatenate(files), np.concatenate(rows), self.pool.max_caption_bytes,
            self.store, served=self.served,
        )  # fmt: skip
        if spec.again:
            table = self._again(spec, table)
            if not table.num_rows:  # nothing to fetch again: the committed part stays as it is
                return pa.table({S.UID: pa.array([], pa.string()), S.STATUS: pa.array([], pa.string())})
        out = self.download(spec.part, table, spec.merge)
        return out.replace_schema_metadata({FETCHED: str(table.num_rows)})

    def _again(self, spec, rows: pa.Table) -> pa.Table:
        """The rows of ``rows`` to fetch again: transient in the committed part, or changed since it."""
        old = self.store.read_parquet(part_file(self.parts_dir, spec.part, spec.merge, "parquet"))
        if spec.again == "transient":
            pick = [u for u, s in zip(old[S.UID].to_pylist(), old[S.STATUS].to_pylist(), strict=True)
                    if S.is_transient(s)]  # fmt: skip
        else:
            was = dict(zip(old[S.UID].to_pylist(), _digests(old), strict=True))
            now = content_digests(rows, self.served).tolist()
            pick = [u for u, c in zip(rows[S.UID].to_pylist(), now, strict=True) if was.get(u) != c]
        return rows.filter(pc.is_in(rows.column(S.UID), value_set=pa.array(pick, pa.string())))

    def download(self, part: int, rows: pa.Table, merge: str = "") -> pa.Table:
        """Download ``rows`` as part ``part``: its tar + parquet under this run's token; its rows back.
        ``merge``: the token of the part's committed files these rows replace rows of (a retry)."""
        rows = one_row_per_uid(rows)
        out = self.worker(rows)
        faults.point("part.fetched")
        out = out if isinstance(out, pa.Table) else pa.table(out)
        summary = out.select([c for c in PART_COLUMNS if c in out.column_names])
        # What each row baked in, for a later run to see whether the pool changed (source/content.py).
        summary = summary.append_column(CONTENT, pa.array(content_digests(rows, self.served), pa.uint64()))
        samples: Iterator[tuple[str, list[tuple[str, bytes]]]] = iter(_samples(rows, out))
        if merge:
            summary, samples = self._merge(part, merge, summary, samples)
        with ShardWriter(part_file(self.parts_dir, part, self.token, "tar"), self.store) as w:
            for key, members in samples:
                w.write_members(key, members)
        faults.point("part.tar_written")
        self.store.write_parquet(summary, part_file(self.parts_dir, part, self.token, "parquet"))
        return summary.append_column("part", pa.array([part] * summary.num_rows, pa.int64()))

    def _merge(
        self, part: int, old_token: str, new: pa.Table, samples: Iterator
    ) -> tuple[pa.Table, Iterator]:
        """The committed part (files ``old_token``) with the re-fetched rows replaced, both sorted by uid."""
        old = self.store.read_parquet(part_file(self.parts_dir, part, old_token, "parquet"))
        again = set(new.column(S.UID).to_pylist())
        kept = old.filter(pa.array([u not in again for u in old.column(S.UID).to_pylist()], pa.bool_()))
        merged = pa.concat_tables([kept, new.cast(kept.schema)]).sort_by(S.UID)
        old_samples = (
            (s["__key__"], [(k, v) for k, v in s.items() if not k.startswith("__")])
            for s in iter_shard(part_file(self.parts_dir, part, old_token, "tar"), self.store, decode=False)
            if s["__key__"] not in again
        )
        return merged, _merge_sorted(old_samples, samples)


def _digests(t: pa.Table) -> list[int | None]:
    """A part's per-row content digests (None for every row of a part written without them)."""
    if CONTENT not in t.column_names:
        return [None] * t.num_rows
    return t.column(CONTENT).to_pylist()


def one_row_per_uid(rows: pa.Table) -> pa.Table:
    """Rows sorted by uid; of rows sharing a uid (identical URL and caption: rows.canonical_rows) the first."""
    keys = [(S.UID, "ascending")] + ([(ROW_KEY, "ascending")] if ROW_KEY in rows.column_names else [])
    rows = rows.sort_by(keys)
    uids = np.array(rows.column(S.UID).to_pylist(), dtype=object)
    first = np.ones(len(uids), dtype=bool)
    first[1:] = uids[1:] != uids[:-1]
    return rows.filter(pa.array(first))


def _merge_sorted(a: Iterator, b: Iterator) -> Iterator:
    """Two key-sorted streams of (key, members) as one key-sorted stream."""
    import heapq

    return heapq.merge(a, b, key=lambda s: s[0])


def _samples(rows: pa.Table, out: pa.Table) -> list[tuple[str, list[tuple[str, bytes]]]]:
    """(uid, tar members) of each success, in row order (rows are sorted by uid)."""
    ok = pc.equal(out.column(S.STATUS), S.STATUS_SUCCESS).to_pylist()
    meta = rows.to_pylist()
    res = out.to_pylist()
    samples = []
    for i in (i for i, k in enumerate(ok) if k):
        m, r = meta[i], res[i]
        info: dict[str, Any] = {
            "uid": m[S.UID],
            "url": m[S.URL],
            "caption": m.get(S.TEXT),
            "width": r[S.WIDTH],
            "height": r[S.HEIGHT],
            "original_width": r[S.ORIGINAL_WIDTH],
            "original_height": r[S.ORIGINAL_HEIGHT],
            "sha256": r[S.IMAGE_SHA256],
            "key": m[S.UID],
        }
        stored = {"jpg": r[S.IMAGE], "txt": (m.get(S.TEXT) or "").encode("utf-8")}
        info[CHECKSUM_FIELD] = stored_checksums(stored)  # of the bytes the shard holds (checksums.py)
        samples.append(sample_members({"__key__": m[S.UID], **stored, "json": info}))
    return samples
