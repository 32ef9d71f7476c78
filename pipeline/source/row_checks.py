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
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.dedup.decisions import url_duplicates
from pipeline.source.content import comparable_urls

CAPTION_STATUS = "caption_status"
ROW_KEY = "row_key"


def _binary(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A string or binary column as one binary array over the same bytes (nothing decoded yet)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if pa.types.is_null(t):
        return pa.nulls(len(col), pa.binary())
    if pa.types.is_large_string(t):
        col = col.view(pa.large_binary())
    if pa.types.is_large_binary(col.type):
        return col.cast(pa.binary())
    return col.view(pa.binary()) if pa.types.is_string(t) else col


def _decode(raw: bytes | None) -> tuple[str | None, bool]:
    """(text, ok): strict UTF-8; on failure the text with U+FFFD for display."""
    if raw is None:
        return None, False
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), False


def _utf8(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(text, ok) of a binary column: strict UTF-8 per row; a row that fails reads with U+FFFD (display
    only) and ``ok`` False; null stays null, ``ok`` False. Columnar unless the column holds bad bytes, and
    then only its non-ASCII rows are decoded one by one."""
    ok = col.is_valid().to_numpy(zero_copy_only=False).copy()
    try:
        return col.cast(pa.string()), ok  # the cast validates every row
    except pa.ArrowInvalid:
        pass
    raw = col.view(pa.string())  # unvalidated: only byte-level kernels touch it before the rows are fixed
    slow = np.flatnonzero(~pc.fill_null(pc.string_is_ascii(raw), True).to_numpy(zero_copy_only=False))
    fixed = [_decode(b) for b in col.take(pa.array(slow, pa.int64())).to_pylist()]
    mask = np.zeros(len(col), dtype=bool)
    mask[slow] = True
    text = pc.replace_with_mask(raw, pa.array(mask), pa.array([t for t, _ in fixed], pa.string()))
    ok[slow] = [good for _, good in fixed]
    return text, ok


def caption_status(raw: bytes | None, max_bytes: int) -> tuple[str, str]:
    """(status, caption) of one caption; ``caption_statuses`` is the columnar form over a batch."""
    status, text = caption_statuses(pa.array([raw], pa.binary()), max_bytes)
    return status[0].as_py(), text[0].as_py()


def caption_statuses(raw: pa.Array, max_bytes: int) -> tuple[pa.Array, pa.Array]:
    """(status, caption) per row of a binary column: status "" for a usable caption, else
    ``invalid_caption:<reason>`` (null, then too long, then bad UTF-8) and the caption ""."""
    text, ok = _utf8(raw)
    null = raw.is_null().to_numpy(zero_copy_only=False)
    long = pc.fill_null(pc.greater(pc.binary_length(raw), max_bytes), False).to_numpy(zero_copy_only=False)
    status = np.full(len(raw), "", dtype=object)
    status[~ok] = S.invalid_caption(S.CAPTION_UTF8)
    status[long] = S.invalid_caption(S.CAPTION_TOO_LONG)
    status[null] = S.invalid_caption(S.CAPTION_NULL)
    good = pa.array(status == "")
    return pa.array(status, pa.string()), pc.if_else(good, text, pa.scalar("", pa.string()))


def row_key(url: bytes | None, caption: bytes | None) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in (url, caption):
        h.update(b"\x01" if part is None else b"\x00" + len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def row_keys(urls: pa.Array, captions: pa.Array) -> pa.Array:
    """``row_key`` of every row. The digest stays per row: Arrow has no keyed digest kernel, and the key
    must not change (it picks a repeated uid's canonical row in builds already on disk)."""
    blake, little = hashlib.blake2b, int.to_bytes
    out = []
    for u, t in zip(urls.to_pylist(), captions.to_pylist(), strict=True):
        h = blake(digest_size=8)
        h.update(b"\x01" if u is None else b"\x00" + little(len(u), 8, "little") + u)
        h.update(b"\x01" if t is None else b"\x00" + little(len(t), 8, "little") + t)
        out.append(h.hexdigest())
    return pa.array(out, pa.string())


def prepare_batch(batch: pa.Table, max_caption_bytes: int, served: Sequence[str] = ()) -> pa.Table:
    """uid, url and text as valid strings (bad bytes → U+FFFD / "" / null), plus ``caption_status`` and
    ``row_key`` (of the URL as ``comparable_urls`` spells it with ``served``); other columns pass through."""
    n = batch.num_rows
    uids, _ = _utf8(_binary(batch.column(S.UID)))
    raw_urls = _binary(batch.column(S.URL))
    urls, url_ok = _utf8(raw_urls)
    raw_text = _binary(batch.column(S.TEXT)) if S.TEXT in batch.column_names else pa.nulls(n, pa.binary())
    status, captions = caption_statuses(raw_text, max_caption_bytes)
    out = {S.UID: uids, S.URL: pc.if_else(pa.array(url_ok), urls, pa.scalar(None, pa.string()))}
    out[S.TEXT] = captions
    for name in batch.column_names:
        if name not in out:
            out[name] = batch.column(name)
    out[CAPTION_STATUS] = status
    # The loopback port and a served host are left out, as in the run fingerprint: a pool served again
    # elsewhere must not pick another canonical row.
    out[ROW_KEY] = row_keys(comparable_urls(raw_urls, served), raw_text)
    return pa.table(out)


def canonical_rows(
    uids: Sequence[str | None] | pa.Array | pa.ChunkedArray,
    keys: Sequence[str] | pa.Array | pa.ChunkedArray,
    valid: np.ndarray,
) -> np.ndarray:
    """Mask of the rows that go on for their uid: valid, and the first by ``(uid, row_key, index)``."""
    keep = np.zeros(len(valid), dtype=bool)
    idx = np.flatnonzero(valid)
    if not len(idx):
        return keep
    take = pa.array(idx, pa.int64())
    t = pa.table({"u": one_array(uids).take(take), "k": one_array(keys).take(take)})
    # A stable sort: rows equal in uid and key stay in index order. UTF-8 bytes sort as code points do.
    order = pc.sort_indices(t, sort_keys=[("u", "ascending"), ("k", "ascending")]).to_numpy()
    su = t.column("u").take(pa.array(order))
    first = np.ones(len(order), dtype=bool)
    first[1:] = ~pc.fill_null(pc.equal(su.slice(1), su.slice(0, len(order) - 1)), False).to_numpy(
        zero_copy_only=False
    )
    keep[idx[order[first]]] = True
    return keep


def one_array(values: Sequence | pa.Array | pa.ChunkedArray) -> pa.Array:
    """One Arrow array from a column (a list: strings). A string column of more than 2 GiB (32-bit offsets)
    becomes ``large_string``: the pool's URLs pass that size from ~20M rows on."""
    if isinstance(values, pa.ChunkedArray):
        if values.type in (pa.string(), pa.binary()) and values.nbytes >= 2**31 - 2**26:
            values = values.cast(pa.large_string() if values.type == pa.string() else pa.large_binary())
        return values.combine_chunks()
    return values if isinstance(values, pa.Array) else pa.array(list(values), pa.string())


def valid_uids(uids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``schema.is_valid_uid`` of every row, columnar (RE2's ``$`` is the end of the text, like fullmatch)."""
    return pc.fill_null(pc.match_substring_regex(uids, "^[0-9a-f]{32}$"), False).to_numpy(
        zero_copy_only=False
    )


def row_statuses(narrow: pa.Table) -> np.ndarray:
    """Every rule above but the URL dedupe, for each row of ``narrow`` (uid, url, caption_status, row_key;
    rows in read order, or any order with the tie ``index`` of ``canonical_rows`` given by row position);
    "" = goes on to the URL dedupe. The rows of a uid must all be in ``narrow``."""
    uids = one_array(narrow.column(S.UID))
    urls = one_array(narrow.column(S.URL))
    cap = one_array(narrow.column(CAPTION_STATUS))
    status = np.full(len(uids), "", dtype=object)
    valid = valid_uids(uids)
    canonical = canonical_rows(uids, narrow.column(ROW_KEY), valid)
    status[~valid] = S.STATUS_INVALID_UID
    status[valid & ~canonical] = S.STATUS_DUPLICATE_UID
    pending = valid & canonical
    no_url = pending & urls.is_null().to_numpy(zero_copy_only=False)
    status[no_url] = S.STATUS_INVALID_URL
    pending &= ~no_url
    bad_cap = pending & pc.fill_null(pc.not_equal(cap, ""), False).to_numpy(zero_copy_only=False)
    idx = np.flatnonzero(bad_cap)
    status[idx] = np.array(cap.take(pa.array(idx, pa.int64())).to_pylist(), dtype=object)
    return status


def pre_statuses(narrow: pa.Table) -> np.ndarray:
    """Statuses decided before download for each row of ``narrow`` (uid, url, caption_status, row_key)
    in the order above; "" = goes on to download. The whole pool in one process: the build decides the
    same per uid bucket and per URL bucket (pipeline/stages/row_stages.py), this is its reference."""
    status = row_statuses(narrow)
    idx = pa.array(np.flatnonzero(status == ""), pa.int64())
    uids = one_array(narrow.column(S.UID))
    urls = one_array(narrow.column(S.URL))
    dup = np.asarray(url_duplicates(uids.take(idx), urls.take(idx)), dtype=bool)
    status[idx.to_numpy()[dup]] = S.STATUS_DUPLICATE_URL
    return status
