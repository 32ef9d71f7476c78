"""The build's metadata, read with pyarrow: the file list and its schema check, the columns the driver
decides on, and the rows of one download part.

The driver needs a few columns of every row whole (uid, url, caption status, row key; later the filter
columns), so it reads them straight from the parquet files, file by file in ``Storage.list_files`` order,
with pyarrow's threads: no Ray Data execution, and the schema check reads only the footers. That read
order is the pool's *row order*, which defines the download parts (pipeline/download/phase.py): a row is
named by its position, ``(file index, row index in the file)``, and a download actor reads its part's
rows back from the same files — only the columns a part needs, in bounded batches of the row groups that
cover them (``read_rows``), so its memory does not grow with the row groups or the extra columns of the
input. Every read goes through
``rows.prepare_batch``, so the driver and the actors see the same decoded strings and row keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.common.errors import InputError
from pipeline.common.storage import LOCAL, Storage
from pipeline.source.row_checks import CAPTION_STATUS, ROW_KEY, prepare_batch

DERIVED = (CAPTION_STATUS, ROW_KEY)  # added by prepare_batch, not in the files
_RAW_NEEDED = (S.UID, S.URL, S.TEXT)  # what prepare_batch reads to make them


class MetadataError(InputError, ValueError):
    """The metadata cannot be read or has the wrong schema; the message names the file."""


@dataclass(frozen=True)
class Metadata:
    """The pool's parquet files as checked: names (as ``Storage.list_files`` gives them), column names
    and row counts per file, in read order."""

    files: tuple[str, ...]
    names: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]

    @property
    def offsets(self) -> np.ndarray:
        """First global row index of each file, and the total row count last."""
        return np.concatenate([[0], np.cumsum(np.asarray(self.rows, dtype=np.int64))]).astype(np.int64)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global row indices → (file index, row index within that file)."""
        offsets = self.offsets
        rows = np.asarray(rows, dtype=np.int64)
        file_idx = np.searchsorted(offsets, rows, side="right") - 1
        return file_idx.astype(np.int64), rows - offsets[file_idx]


def open_metadata(path: str, store: Storage = LOCAL) -> Metadata:
    """List the parquet files at ``path`` and check each one's schema from its footer; an unreadable or
    mistyped file is a one-line ``MetadataError`` naming it."""
    files = store.list_files(path, suffix=".parquet")
    if not files:
        raise MetadataError(f"metadata: no parquet files at {path}")
    fs, fs_paths = store.filesystem_for(files)
    names, rows = [], []
    for name, fs_path in zip(files, fs_paths, strict=True):
        try:
            footer = pq.ParquetFile(fs_path, filesystem=fs)
            schema, n = footer.schema_arrow, footer.metadata.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise MetadataError(f"{name}: not a readable parquet file ({exc})") from None
        try:
            S.validate_metadata_schema(schema)
        except S.SchemaError as exc:
            raise MetadataError(f"{name}: {exc}") from None
        names.append(tuple(schema.names))
        rows.append(int(n))
    return Metadata(tuple(files), tuple(names), tuple(rows))


def _prepared(
    table: pa.Table, columns: Sequence[str] | None, max_caption_bytes: int, served: Sequence[str]
) -> pa.Table:
    table = prepare_batch(table, max_caption_bytes, served)
    return table if columns is None else table.select([c for c in columns if c in table.column_names])


def _raw_columns(names: Sequence[str], columns: Sequence[str]) -> list[str]:
    """The file columns to read for ``columns`` of the prepared table (those the file has)."""
    wanted = [c for c in columns if c not in DERIVED]
    if any(c in DERIVED for c in columns) or S.TEXT in wanted:
        wanted += [c for c in _RAW_NEEDED if c not in wanted]
    wanted += [c for c in (S.UID, S.URL) if c not in wanted]  # prepare_batch needs them
    return [c for c in wanted if c in names]


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")


def read_columns(
    meta: Metadata,
    columns: Sequence[str],
    max_caption_bytes: int,
    store: Storage = LOCAL,
    served: Sequence[str] = (),
) -> pa.Table:
    """``columns`` of every row in read order, after ``prepare_batch`` (``caption_status`` and ``row_key``
    included when asked, ``served``: the run's served hosts). A column some files lack is null in their
    rows; one no file has is left out."""
    fs, fs_paths = store.filesystem_for(list(meta.files))
    tables = []
    for fs_path, names in zip(fs_paths, meta.names, strict=True):
        raw = pq.read_table(fs_path, filesystem=fs, columns=_raw_columns(names, columns), use_threads=True)
        tables.append(_prepared(raw, columns, max_caption_bytes, served))
    table = _concat(tables)  # a column the first file lacks comes last: back to the order asked
    return table.select([c for c in columns if c in table.column_names])


# The columns a download part reads: what the fetch, the sha256 check, the face blur and the shard's txt and
# json members need. Nothing else of a row reaches the actor, however wide the metadata is.
PART_READ_COLUMNS = (S.UID, S.URL, S.TEXT, S.SHA256, S.FACE_BBOXES)
READ_BATCH_ROWS = 1024  # rows decoded at a time while a part's rows are read, whatever the row groups
_READ_BUFFER = 1 << 20  # column chunks are streamed through a buffer this large, never read whole


def read_rows(
    files: Sequence[str],
    file_idx: np.ndarray,
    row_idx: np.ndarray,
    max_caption_bytes: int,
    store: Storage = LOCAL,
    columns: Sequence[str] = PART_READ_COLUMNS,
    served: Sequence[str] = (),
) -> pa.Table:
    """``columns`` of the given rows, in the given order (rows of one file consecutive), prepared: the
    download actor's read of its part.

    Memory is bounded by construction: only ``columns`` (those a file has) are read, decoded
    ``READ_BATCH_ROWS`` rows at a time from the row groups covering the rows, the column chunks streamed
    rather than buffered whole, so one huge row group or a wide extra column costs what small ones do."""
    file_idx, row_idx = np.asarray(file_idx, np.int64), np.asarray(row_idx, np.int64)
    fs, fs_paths = store.filesystem_for(list(files))
    tables = []
    for f in dict.fromkeys(file_idx.tolist()):  # files in first-seen order
        local = row_idx[file_idx == f]
        pf = pq.ParquetFile(fs_paths[f], filesystem=fs, pre_buffer=False, buffer_size=_READ_BUFFER)
        names = pf.schema_arrow.names
        wanted = [c for c in dict.fromkeys([*columns, *_RAW_NEEDED]) if c in names]
        tables.append(_prepared(_take_rows(pf, local, wanted), None, max_caption_bytes, served))
    if not tables:
        raise ValueError("read_rows: no rows given")
    return _concat(tables)


def _take_rows(pf: pq.ParquetFile, rows: np.ndarray, columns: list[str]) -> pa.Table:
    """Rows ``rows`` of one file in that order, ``columns`` only, read in batches of ``READ_BATCH_ROWS``."""
    order = np.argsort(rows, kind="stable")
    local = rows[order]
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    first = int(np.searchsorted(starts, local.min(), side="right") - 1)
    last = int(np.searchsorted(starts, local.max(), side="right") - 1)
    offset, pieces = int(starts[first]), []
    batches = pf.iter_batches(
        batch_size=READ_BATCH_ROWS,
        row_groups=list(range(first, last + 1)),
        columns=columns,
        use_threads=False,
    )
    for batch in batches:
        lo, hi = np.searchsorted(local, [offset, offset + batch.num_rows])
        if hi > lo:
            pieces.append(pa.Table.from_batches([batch.take(pa.array(local[lo:hi] - offset))]))
        offset += batch.num_rows
        if offset > local[-1]:
            break  # past the part's last row: the rest of the group is never decoded
    table = _concat(pieces)
    if (order != np.arange(len(order))).any():
        table = table.take(pa.array(np.argsort(order)))  # back to the order asked
    return table
