"""What a download part bakes in of each row, as one 64-bit digest per row: the run fingerprint's view of
the pool's *content* (pipeline/source/run_state.py).

A part stores the picture fetched from the row's URL, checked against its ``sha256``, blurred at its face
boxes, and its caption in the shard's txt and json members. A pool whose rows keep their uids but change
any of these would resume into parts made from other rows; the digest covers exactly these four columns
(as the actor reads them: pipeline/source/metadata.py ``read_rows``, after ``prepare_batch``).

One exception, documented in docs/formats.md: the port of a loopback URL (``127.x.x.x``, ``localhost``,
``[::1]``) is left out, so the demo pool served again on another free port is the same pool, and so is
the host of an allow-listed ``host:port`` server (``served_hosts``: the demo pool served by a cluster's
head, which a new head serves elsewhere). Such URLs reach a download only when allow-listed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S

CONTENT = "content"  # the per-row digest column of a part's parquet (uint64)
COLUMNS = (S.URL, S.TEXT, S.SHA256, S.FACE_BBOXES)
_LOOPBACK_PORT = r"(?i)^([a-z][a-z0-9+.-]*://(?:127(?:\.\d{1,3}){3}|localhost|\[::1\]))(:\d+)"  # any scheme


def without_loopback_port(urls: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``http://127.0.0.1:8123/x`` → ``http://127.0.0.1/x``; every other URL unchanged."""
    return pc.replace_substring_regex(urls, pattern=_LOOPBACK_PORT, replacement=r"\1")


def served_hosts(allow_hosts: Sequence[str]) -> tuple[str, ...]:
    """The ``host:port`` entries of an allow list: servers of one run (the demo pool's on a cluster head)."""
    return tuple(sorted({h for h in allow_hosts if re.fullmatch(r"[^:/\s]+:\d+", h)}))


def comparable_urls(
    urls: pa.Array | pa.ChunkedArray, served: Sequence[str] = ()
) -> pa.Array | pa.ChunkedArray:
    """URLs as a run compares them: the loopback port left out and each ``served`` host spelled ``served``
    (the same pool served again elsewhere, by a new head, is the same pool)."""
    out = without_loopback_port(urls)
    for host in served:
        out = pc.replace_substring_regex(
            out, pattern=rf"(?i)^([a-z][a-z0-9+.-]*://){re.escape(host)}/", replacement=r"\1served/"
        )
    return out


def _bytes_column(table: pa.Table, name: str, served: Sequence[str] = ()) -> list[bytes | None]:
    if name not in table.column_names:
        return [None] * table.num_rows
    col = table.column(name)
    if name == S.URL:
        col = comparable_urls(col.cast(pa.string()), served)
    return col.cast(pa.large_binary()).to_pylist()


def _boxes(table: pa.Table) -> list[bytes | None]:
    """Each row's face boxes as bytes: the number of boxes, each box's length, the float64 values."""
    if S.FACE_BBOXES not in table.column_names:
        return [None] * table.num_rows
    col = table.column(S.FACE_BBOXES)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_null(col.type):
        return [None] * table.num_rows
    out: list[bytes | None] = []
    for boxes in col.to_pylist():
        if boxes is None:
            out.append(None)
            continue
        flat = [len(boxes)] + [len(b) if b is not None else -1 for b in boxes]
        values = [v for b in boxes if b is not None for v in b]
        out.append(np.asarray(flat, "<i8").tobytes() + np.asarray(values, "<f8").tobytes())
    return out


def content_digests(table: pa.Table, served: Sequence[str] = ()) -> np.ndarray:
    """The uint64 digest of each row's URL (loopback port and the ``served`` hosts left out), caption, sha256
    and face boxes."""
    columns = [_bytes_column(table, c, served) for c in (S.URL, S.TEXT, S.SHA256)] + [_boxes(table)]
    out = np.empty(table.num_rows, np.uint64)
    blake, little = hashlib.blake2b, int.to_bytes
    for i, row in enumerate(zip(*columns, strict=True)):
        h = blake(digest_size=8)
        for part in row:
            h.update(b"\x01" if part is None else b"\x00" + little(len(part), 8, "little") + part)
        out[i] = int.from_bytes(h.digest(), "little")
    return out
