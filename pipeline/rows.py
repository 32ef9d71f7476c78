"""Per-row decisions made before any download, so one bad row never stops the build.

Each metadata row is judged on its own columns:

- **uid**: exactly 32 lowercase hex digits (``schema.is_valid_uid``), else ``invalid_uid``. Undecodable
  bytes in the uid column are shown with U+FFFD in the status table.
- **repeated uid**: one row per uid goes on; the others are ``duplicate_uid``. The row that goes on is
  the *canonical* one: the smallest ``row_key`` (a digest of URL and caption bytes), so the choice does
  not depend on the order in which Ray Data happens to deliver rows, and the download, the shard's caption
  and the filter decision all use the same row. Rows identical in URL and caption are interchangeable.
- **url**: null or not valid UTF-8 → ``invalid_url``.
- **caption** (``text``, string or binary in the parquet): null → ``invalid_caption:null``; more than
  ``max_caption_bytes`` → ``invalid_caption:too_long``; not valid UTF-8 (lone surrogates included) →
  ``invalid_caption:invalid_utf8``. The caption then reads as "" downstream.
- **duplicate URL** (DataComp's URL dedupe) among the rows still going on.

``prepare_batch`` is the Ray Data UDF that adds ``caption_status`` and ``row_key`` and hands every later
stage decoded strings; ``pre_statuses`` decides in the driver over the narrow columns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from pipeline import schema as S
from pipeline.dedupe import url_duplicates

CAPTION_STATUS = "caption_status"
ROW_KEY = "row_key"


def _raw(col: pa.Array | pa.ChunkedArray) -> list[bytes | None]:
    """A string or binary column as Python bytes (no UTF-8 decode, so bad bytes cannot raise here)."""
    t = col.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        col = col.cast(pa.binary())
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        col = col.cast(pa.large_binary())
    elif pa.types.is_null(t):
        return [None] * len(col)
    return col.to_pylist()


def _decode(raw: bytes | None) -> tuple[str | None, bool]:
    """(text, ok): strict UTF-8; on failure the text with U+FFFD for display."""
    if raw is None:
        return None, False
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), False


def caption_status(raw: bytes | None, max_bytes: int) -> tuple[str, str]:
    """(status, caption): status "" for a usable caption, else ``invalid_caption:<reason>`` and ""."""
    if raw is None:
        return S.invalid_caption(S.CAPTION_NULL), ""
    if len(raw) > max_bytes:
        return S.invalid_caption(S.CAPTION_TOO_LONG), ""
    text, ok = _decode(raw)
    return ("", text or "") if ok else (S.invalid_caption(S.CAPTION_UTF8), "")


def row_key(url: bytes | None, caption: bytes | None) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in (url, caption):
        h.update(b"\x01" if part is None else b"\x00" + len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def prepare_batch(batch: pa.Table, max_caption_bytes: int) -> pa.Table:
    """uid, url and text as valid strings (bad bytes → U+FFFD / "" / null), plus ``caption_status`` and
    ``row_key``; other columns pass through."""
    n = batch.num_rows
    uids = [_decode(u)[0] for u in _raw(batch.column(S.UID))]
    raw_urls = _raw(batch.column(S.URL))
    urls = [_decode(u)[0] if u is not None and _decode(u)[1] else None for u in raw_urls]
    raw_text = _raw(batch.column(S.TEXT)) if S.TEXT in batch.column_names else [None] * n
    checked = [caption_status(t, max_caption_bytes) for t in raw_text]
    keys = [row_key(u, t) for u, t in zip(raw_urls, raw_text, strict=True)]
    out = {S.UID: pa.array(uids, pa.string()), S.URL: pa.array(urls, pa.string())}
    out[S.TEXT] = pa.array([c for _, c in checked], pa.string())
    for name in batch.column_names:
        if name not in out:
            out[name] = batch.column(name)
    out[CAPTION_STATUS] = pa.array([s for s, _ in checked], pa.string())
    out[ROW_KEY] = pa.array(keys, pa.string())
    return pa.table(out)


def canonical_rows(uids: Sequence[str | None], keys: Sequence[str], valid: np.ndarray) -> np.ndarray:
    """Mask of the rows that go on for their uid: valid, and the first by ``(uid, row_key, index)``."""
    n = len(uids)
    keep = np.zeros(n, dtype=bool)
    order = sorted(np.flatnonzero(valid).tolist(), key=lambda i: (uids[i], keys[i], i))
    last = None
    for i in order:
        if uids[i] != last:
            keep[i] = True
            last = uids[i]
    return keep


def pre_statuses(narrow: pa.Table) -> np.ndarray:
    """Statuses decided before download for each row of ``narrow`` (uid, url, caption_status, row_key)
    in the order above; "" = goes on to download."""
    uids = narrow.column(S.UID).to_pylist()
    urls = narrow.column(S.URL).to_pylist()
    cap = narrow.column(CAPTION_STATUS).to_pylist()
    keys = narrow.column(ROW_KEY).to_pylist()
    status = np.full(len(uids), "", dtype=object)
    valid = np.array([S.is_valid_uid(u) for u in uids], dtype=bool)
    status[~valid] = S.STATUS_INVALID_UID
    status[valid & ~canonical_rows(uids, keys, valid)] = S.STATUS_DUPLICATE_UID
    for i in np.flatnonzero(status == ""):
        if urls[i] is None:
            status[i] = S.STATUS_INVALID_URL
        elif cap[i]:
            status[i] = cap[i]
    idx = np.flatnonzero(status == "")
    dup = url_duplicates(np.array([uids[i] for i in idx], dtype=object), [urls[i] for i in idx])
    status[idx[np.asarray(dup, dtype=bool)]] = S.STATUS_DUPLICATE_URL
    return status
