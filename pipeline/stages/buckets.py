"""Bucketed files: the shuffle between the build's map and reduce tasks, on the run's storage.

A map task writes one file whose record batches each hold the rows of one bucket, however many buckets
it has rows for; a reduce task reads, from each map task's file, only the batches of its bucket. So a
shuffle of ``M`` map tasks into ``R`` buckets is ``M`` files, not ``M·R``, and no task ever holds more
than its own input and one bucket. ``BucketWriter`` streams: it buffers at most ``flush_rows`` rows
before writing them out as batches, so a map task's memory does not grow with its input.

The file is an Arrow IPC file (buffers zstd-compressed) followed by an index: the bucket of every
batch (int32), the IPC file's length, the number of batches and a magic word. A reader reads the index
and the IPC footer (24 bytes a batch) and then only its bucket's batches, so what it parses does not grow
with the buckets of the file (a parquet footer is ~4 KiB a row group, and every reduce task read every
file's: docs/decisions/0105).

Bucket functions live here too, so every stage computes a key's bucket the same way:
``uid_buckets`` range-partitions 32-hex uids by their leading 64 bits (bucket order is uid order, so
per-bucket outputs concatenate sorted), and hashes anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from pipeline.common.hashing import splitmix64
from pipeline.common.storage import Storage
from pipeline.filters.datacomp import uid_hash
from pipeline.source.row_checks import valid_uids

FLUSH_ROWS = 1 << 18  # rows a BucketWriter buffers before writing them out
FLUSH_BYTES = 64 << 20  # or bytes, whichever comes first (a row with a 768-d vector is ~1.6 KB)
_READ_THREADS = 8  # files of one bucket read at once (object-store latency, not CPU)
_MAGIC = b"PROLIPB1"  # ends a bucket file, after its index
_TAIL = 24  # the IPC file's length, the number of batches, the magic word
_OPTIONS = ipc.IpcWriteOptions(compression="zstd")


class BucketWriter:
    """Rows with their bucket numbers → one bucket file of single-bucket batches (see module doc)."""

    def __init__(self, path: str, store: Storage, flush_rows: int = FLUSH_ROWS) -> None:
        self.path, self.store, self.flush_rows = path, store, flush_rows
        self._pending: list[pa.Table] = []
        self._buckets: list[np.ndarray] = []  # the bucket of each pending row
        self._rows = self._bytes = 0
        self._out = None
        self._writer: ipc.RecordBatchFileWriter | None = None
        self._index: list[int] = []  # the bucket of each batch written
        self.schema: pa.Schema | None = None

    def add(self, table: pa.Table, buckets: np.ndarray) -> None:
        if table.num_rows == 0 and self.schema is not None:
            return
        if self.schema is None:
            self.schema = table.schema
        self._pending.append(table.cast(self.schema) if table.schema != self.schema else table)
        self._buckets.append(np.asarray(buckets, np.int32))
        self._rows += table.num_rows
        self._bytes += table.nbytes
        if self._rows >= self.flush_rows or self._bytes >= FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        table = pa.concat_tables(self._pending)
        b = np.concatenate(self._buckets)
        self._pending, self._buckets, self._rows, self._bytes = [], [], 0, 0
        if not table.num_rows:
            return
        self._open()
        order = np.argsort(b, kind="stable")
        b = b[order]
        starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
        ends = np.append(starts[1:], len(b))
        ordered = table.take(pa.array(order))  # one gather per flush, then a slice per bucket
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            for batch in ordered.slice(s, e - s).to_batches():
                self._writer.write_batch(batch)
                self._index.append(int(b[s]))

    def _open(self) -> None:
        if self._writer is None:
            self._out = self.store.open_output(self.path)
            self._writer = ipc.new_file(self._out, self.schema, options=_OPTIONS)

    def close(self, schema: pa.Schema | None = None) -> None:
        """Write what is buffered, then the index, and publish the file (no batch, of ``schema``, if
        nothing was added)."""
        if self.schema is None:
            self.schema = schema or pa.schema([])
        self._flush()
        self._open()
        self._writer.close()
        length = self._out.tell()
        self._out.write(np.asarray(self._index, "<i4").tobytes())
        self._out.write(np.asarray([length, len(self._index)], "<u8").tobytes() + _MAGIC)
        self._out.close()

    def abort(self) -> None:
        if self._writer is not None:
            try:  # its footer goes to the discarded file: a writer left open would write on collection
                self._writer.close()
            except (OSError, ValueError, pa.ArrowException):
                pass
            self._writer = None
        if self._out is not None:
            self._out.abort()


def write_buckets(table: pa.Table, buckets: np.ndarray, path: str, store: Storage) -> None:
    """``table`` as one bucketed file (all rows at once)."""
    w = BucketWriter(path, store, flush_rows=max(1, table.num_rows) + 1)
    try:
        w.add(table, buckets)
        w.close(table.schema)
    except BaseException:
        w.abort()
        raise


def _bucket_of_file(path: str, bucket: int, store: Storage, columns: Sequence[str] | None) -> pa.Table:
    with store.open_input(path) as fh:
        size = fh.size()
        if size < _TAIL:
            raise ValueError(f"{path}: not a bucket file ({size} bytes)")
        fh.seek(size - _TAIL)
        tail = fh.read(_TAIL)
        length, n = (int(v) for v in np.frombuffer(tail[:16], "<u8"))
        if tail[16:] != _MAGIC or length + 4 * n + _TAIL != size:
            raise ValueError(f"{path}: not a bucket file (no index at its end)")
        fh.seek(length)
        index = np.frombuffer(fh.read(4 * n), "<i4")
        try:
            reader = ipc.open_file(fh, footer_offset=length)
            batches = [reader.get_batch(i) for i in np.flatnonzero(index == bucket).tolist()]
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not a bucket file ({e})") from e
        table = pa.Table.from_batches(batches, schema=reader.schema)
    names = None if columns is None else [c for c in columns if c in table.column_names]
    return table if names is None else table.select(names)


def read_bucket(
    paths: Sequence[str], bucket: int, store: Storage, columns: Sequence[str] | None = None
) -> pa.Table:
    """Bucket ``bucket``'s rows from every file of ``paths``, in file order (rows of one file in the order
    they were added)."""
    if not paths:
        return pa.table({})
    with ThreadPoolExecutor(min(_READ_THREADS, len(paths))) as pool:
        tables = list(pool.map(lambda p: _bucket_of_file(p, bucket, store, columns), paths))
    tables = [t for t in tables if t.num_columns]
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="permissive")


# --- which bucket ------------------------------------------------------------------------------------


def uid_buckets(uids: pa.Array | pa.ChunkedArray, n: int) -> np.ndarray:
    """The bucket of each uid: a valid 32-hex uid by range of its leading 64 bits (bucket order = uid
    order), anything else by a hash of its text."""
    uids = uids.combine_chunks() if isinstance(uids, pa.ChunkedArray) else uids
    uids = pc.fill_null(uids.cast(pa.string()), "")
    out = np.zeros(len(uids), np.int64)
    if n <= 1 or not len(uids):
        return out
    ok = valid_uids(uids)
    if ok.any():
        head = pc.utf8_slice_codeunits(uids.filter(pa.array(ok)), 0, 16)
        out[ok] = range_bucket(_hex64(head), n)
    if (~ok).any():
        out[~ok] = (uid_hash(uids.filter(pa.array(~ok)), 7) % np.uint64(n)).astype(np.int64)
    return out


def range_bucket(values: np.ndarray, n: int) -> np.ndarray:
    """uint64 values → ``n`` equal ranges, in order (exact integer arithmetic)."""
    step = np.uint64(((1 << 64) + n - 1) // n)
    return (np.asarray(values, np.uint64) // step).astype(np.int64)


def hash_bucket(values: np.ndarray, n: int, salt: int = 0) -> np.ndarray:
    """uint64 values → ``n`` buckets by a hash (for keys whose order means nothing)."""
    if n <= 1:
        return np.zeros(len(values), np.int64)
    mixed = splitmix64(np.asarray(values, np.uint64) ^ np.uint64(salt))
    return (mixed % np.uint64(n)).astype(np.int64)


def string_buckets(values: pa.Array | pa.ChunkedArray, n: int, salt: int = 0) -> np.ndarray:
    """Strings → ``n`` buckets by a hash of their bytes (nulls to bucket 0)."""
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if n <= 1 or not len(values):
        return np.zeros(len(values), np.int64)
    h = uid_hash(pc.fill_null(values.cast(pa.string()), ""), 11 + salt)
    return (h % np.uint64(n)).astype(np.int64)


# one byte a digit: a uint64 table made the lookup 128 B a uid (+84 MiB at 656k uids, decision 0112)
_HEX = np.full(256, 0, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def _hex64(heads: pa.Array) -> np.ndarray:
    """16 lowercase hex digits per row → uint64 (columnar)."""
    fixed = heads.cast(pa.binary()).cast(pa.binary(16))
    digits = np.frombuffer(fixed.buffers()[1], np.uint8)[fixed.offset * 16 : (fixed.offset + len(fixed)) * 16]
    nib = _HEX[digits].reshape(-1, 16)
    out = np.zeros(len(fixed), np.uint64)
    for k in range(16):
        out = (out << np.uint64(4)) | nib[:, k].astype(np.uint64)
    return out
