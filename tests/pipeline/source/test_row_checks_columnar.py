"""The columnar row checks, URL normalisation and subset row selection against the per-row definitions they
replaced (kept below as the references), on pools holding every kind of bad row, in several row orders."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import schema as S
from pipeline.dedup.decisions import _dropped_within_groups
from pipeline.dedup.urlnorm import normalize_url, normalize_urls
from pipeline.source.row_checks import CAPTION_STATUS, ROW_KEY, _decode, pre_statuses, prepare_batch, row_key
from pipeline.subsets import eligibility as SR
from pipeline.subsets.uid_files import arrow_u8pairs, to_subset_array

# --- the per-row references ---------------------------------------------------------------------------


def ref_raw(col):
    t = col.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        col = col.cast(pa.binary())
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        col = col.cast(pa.large_binary())
    elif pa.types.is_null(t):
        return [None] * len(col)
    return col.to_pylist()


def ref_caption_status(raw, max_bytes):
    if raw is None:
        return S.invalid_caption(S.CAPTION_NULL), ""
    if len(raw) > max_bytes:
        return S.invalid_caption(S.CAPTION_TOO_LONG), ""
    text, ok = _decode(raw)
    return ("", text or "") if ok else (S.invalid_caption(S.CAPTION_UTF8), "")


def _no_loopback_port(url):
    """The row key leaves a loopback URL's port out (pipeline/source/content.py), per row here."""
    if url is None:
        return None
    return re.sub(
        rb"^((?i:https?)://(?:127(?:\.[0-9]{1,3}){3}|(?i:localhost)|\[::1\]))(:[0-9]+)", rb"\1", url
    )


def ref_prepare(batch, max_caption_bytes):
    n = batch.num_rows
    uids = [_decode(u)[0] for u in ref_raw(batch.column(S.UID))]
    raw_urls = ref_raw(batch.column(S.URL))
    urls = [_decode(u)[0] if u is not None and _decode(u)[1] else None for u in raw_urls]
    raw_text = ref_raw(batch.column(S.TEXT)) if S.TEXT in batch.column_names else [None] * n
    checked = [ref_caption_status(t, max_caption_bytes) for t in raw_text]
    keys = [row_key(_no_loopback_port(u), t) for u, t in zip(raw_urls, raw_text, strict=True)]
    return {
        S.UID: uids,
        S.URL: urls,
        S.TEXT: [c for _, c in checked],
        CAPTION_STATUS: [s for s, _ in checked],
        ROW_KEY: keys,
    }


def ref_canonical(uids, keys, valid):
    keep = np.zeros(len(uids), dtype=bool)
    last = None
    for i in sorted(np.flatnonzero(valid).tolist(), key=lambda i: (uids[i], keys[i], i)):
        if uids[i] != last:
            keep[i] = True
            last = uids[i]
    return keep


def ref_url_duplicates(uids, urls):
    keys = [None if u is None else normalize_url(u) for u in urls]
    return _dropped_within_groups(pa.array(keys, pa.string()), pa.array(list(uids), pa.string()))


def ref_pre_statuses(narrow):
    uids = narrow.column(S.UID).to_pylist()
    urls = narrow.column(S.URL).to_pylist()
    cap = narrow.column(CAPTION_STATUS).to_pylist()
    keys = narrow.column(ROW_KEY).to_pylist()
    status = np.full(len(uids), "", dtype=object)
    valid = np.array([S.is_valid_uid(u) for u in uids], dtype=bool)
    status[~valid] = S.STATUS_INVALID_UID
    status[valid & ~ref_canonical(uids, keys, valid)] = S.STATUS_DUPLICATE_UID
    for i in np.flatnonzero(status == ""):
        if urls[i] is None:
            status[i] = S.STATUS_INVALID_URL
        elif cap[i]:
            status[i] = cap[i]
    idx = np.flatnonzero(status == "")
    dup = ref_url_duplicates([uids[i] for i in idx], [urls[i] for i in idx])
    status[idx[np.asarray(dup, dtype=bool)]] = S.STATUS_DUPLICATE_URL
    return status


def ref_row_ids(table):
    return list(zip(table.column(S.UID).to_pylist(), table.column(ROW_KEY).to_pylist(), strict=True))


def ref_listable(rows, live):
    pick = {}
    for r in rows:
        if S.is_valid_uid(r[0]) and (r[0] not in pick or (r in live and pick[r[0]] not in live)):
            pick[r[0]] = r
    chosen = set(pick.values())
    return np.array([r in chosen for r in rows], dtype=bool)


# --- a pool with every kind of bad row ----------------------------------------------------------------

URLS = [
    "http://example.com/a.jpg",
    "  HTTP://Example.COM/a.jpg  ",  # the same URL as the first, normalised
    "http://example.com:80/a.jpg",
    "https://example.com:443/b.jpg",
    "http://example.com:443/b.jpg",
    "http://example.com/a.jpg#top",
    "http://example.com/A.jpg?Size=L&b=2",
    "http://example.com/x?",
    "http://example.com/x",
    "http://User:Pw@Example.com:8080/x",
    "http://[::1]:8080/x#f",
    "http://[::1]:8080/x",
    "HTTP://127.0.0.1:5000/img/x.jpg#main",
    "not a url",
    "http://host:notaport/x",
    "http://host:99999/x",
    "http://h:/x",
    "http:///nohost",
    "ftp://Files.Example.com/x",
    "https://xn--bcher-kva.example/é.jpg",
    "https://ÉXAMPLE.com/x",
    "\x1chttp://example.com/ctl",
    "http://example.com/tab\there",
    "\u00a0http://example.com/nbsp\u3000",
    "http://example.com:0080/zero",
    "http://example.com/x?#f",
    "http://example.com?#",
    "http://example.com/x?a?",
    "http://example.com/p#frag?x",
    " \thttp://example.com/x?q=1#f \n",
    "https://example.com:443",
    "http://example.com:8080?q",
]


def _pool(seed: int, n: int = 400) -> pa.Table:
    """Raw metadata rows: bad and repeated uids, null/undecodable/long captions, null/undecodable URLs,
    repeated URLs in many spellings, rows repeated exactly."""
    rng = random.Random(seed)
    good = [f"{rng.getrandbits(128):032x}" for _ in range(n // 4)]
    uid_kinds = [
        lambda: rng.choice(good).encode(),
        lambda: rng.choice(good).upper().encode(),
        lambda: rng.choice(good)[:31].encode(),
        lambda: b"\xff" * 32,
        lambda: None,
        lambda: (rng.choice(good) + "\n").encode(),
    ]
    url_kinds = [
        lambda: rng.choice(URLS).encode(),
        lambda: f"http://H{rng.randrange(5)}.example:80/{rng.randrange(40)}.jpg#x".encode(),
        lambda: None,
        lambda: b"http://bad.example/\xc3\x28",
    ]
    text_kinds = [
        lambda: f"a photo of thing {rng.randrange(20)}".encode(),
        lambda: "ünïcödé caption".encode(),
        lambda: None,
        lambda: b"\xc3\x28 broken",
        lambda: b"lone \xed\xa0\x80 surrogate",
        lambda: b"x" * 150,
        lambda: b"",
    ]
    rows = []
    for _ in range(n):
        if rows and rng.random() < 0.1:
            rows.append(rng.choice(rows))  # an exact repeat
            continue
        uid = rng.choice(uid_kinds)() if rng.random() < 0.3 else uid_kinds[0]()
        url = rng.choice(url_kinds)() if rng.random() < 0.4 else url_kinds[1]()
        rows.append((uid, url, rng.choice(text_kinds)()))
    uids, urls, texts = zip(*rows, strict=True)
    binary_as_string = pa.array(list(uids), pa.binary()).view(pa.string())
    return pa.table(
        {
            S.UID: binary_as_string,
            S.URL: pa.array(list(urls), pa.binary()),
            S.TEXT: pa.array(list(texts), pa.large_binary()),
            "n": pa.array(range(n), pa.int64()),
        }
    )


@pytest.mark.parametrize("seed", range(4))
def test_prepare_and_pre_statuses_equal_the_per_row_definitions(seed):
    raw = _pool(seed)
    for order_seed in range(3):
        order = list(range(raw.num_rows))
        random.Random(order_seed).shuffle(order)
        batch = raw.take(pa.array(order))
        got = prepare_batch(batch, max_caption_bytes=100)
        want = ref_prepare(batch, 100)
        for col, values in want.items():
            assert got.column(col).to_pylist() == values, col
        assert got.column("n").to_pylist() == batch.column("n").to_pylist()
        narrow = got.select([S.UID, S.URL, CAPTION_STATUS, ROW_KEY])
        status = pre_statuses(narrow)
        assert status.tolist() == ref_pre_statuses(narrow).tolist()
        kinds = set(status.tolist())
        assert {S.STATUS_INVALID_UID, S.STATUS_DUPLICATE_UID, S.STATUS_INVALID_URL} <= kinds
        assert {S.STATUS_DUPLICATE_URL, "", S.invalid_caption(S.CAPTION_NULL)} <= kinds
        assert {S.invalid_caption(S.CAPTION_UTF8), S.invalid_caption(S.CAPTION_TOO_LONG)} <= kinds


def test_batches_without_bad_bytes_take_the_columnar_path_and_agree():
    batch = pa.table({S.UID: ["a" * 32, "b" * 32], S.URL: ["http://a/1", None], S.TEXT: ["ok", None]})
    got = prepare_batch(batch, 10)
    want = ref_prepare(batch, 10)
    assert {c: got.column(c).to_pylist() for c in want} == want


@pytest.mark.parametrize("url", URLS)
def test_columnar_url_normalisation_equals_the_reference(url):
    assert normalize_urls(pa.array([url, None])).to_pylist() == [normalize_url(url), None]


_URL_CHARS = st.sampled_from(list("aZ09.-_~:/?#@[]% \t\n=&") + ["é", "\x1c", "\u3000", "HTTP", "https", "80"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_URL_CHARS, max_size=14).map("".join), st.sampled_from(["http://", "HtTpS://", "", " "]))
def test_columnar_url_normalisation_equals_the_reference_on_generated_urls(tail, head):
    url = head + tail
    assert normalize_urls(pa.array([url])).to_pylist() == [normalize_url(url)]


# --- the build's row selection for subsets ------------------------------------------------------------


def _filter_table(seed: int):
    """(meta, pool, status_table): the filter columns in one order, the narrow columns in another."""
    raw = _pool(seed)
    narrow = prepare_batch(raw, 100).select([S.UID, S.URL, CAPTION_STATUS, ROW_KEY])
    status_pre = pre_statuses(narrow)
    order = list(range(raw.num_rows))
    random.Random(seed + 100).shuffle(order)
    meta = narrow.take(pa.array(order)).select([S.UID, ROW_KEY])
    live = np.flatnonzero(status_pre == "")
    rng = random.Random(seed)
    statuses = [rng.choice([S.STATUS_SUCCESS, "failed_to_download:timeout"]) for _ in live]
    status_table = pa.table(
        {
            S.UID: narrow.column(S.UID).take(pa.array(live)),
            S.STATUS: pa.array(statuses, pa.string()),
        }
    )
    return meta, SimpleNamespace(narrow=narrow, live=lambda: status_pre == ""), status_table


@pytest.mark.parametrize("seed", range(4))
def test_subset_row_selection_equals_the_tuple_definitions(seed):
    meta, pool, status_table = _filter_table(seed)
    live_set = {r for r, k in zip(ref_row_ids(pool.narrow), pool.live(), strict=True) if k}
    ok = {u for u, s in zip(*status_table.to_pydict().values(), strict=True) if s == S.STATUS_SUCCESS}
    rows = ref_row_ids(meta)
    live = SR.LiveRows.of(pool.narrow, pool.live(), status_table)
    live_rows = live.rows(meta)
    assert live_rows.tolist() == [r in live_set for r in rows]
    success = SR.eligible(live, meta, live_rows)
    assert success.tolist() == [r in live_set and r[0] in ok for r in rows]
    listable = SR.listable(meta, live_rows)
    assert listable.tolist() == ref_listable(rows, live_set).tolist()
    keep = np.array([random.Random(i * 7 + seed).random() < 0.6 for i in range(len(rows))])
    for mask in (keep & listable, keep & success):
        want = np.unique(np.array([r[0] for r, k in zip(rows, mask, strict=True) if k], dtype=object))
        got = SR.uids_where(meta, mask)
        assert sorted(got.to_pylist()) == want.tolist()
        # the .npy bytes: the same sorted u8,u8 array
        assert to_subset_array(got).tobytes() == to_subset_array(want.tolist()).tobytes()


def test_language_labels_follow_their_rows_whatever_the_order():
    meta, pool, _ = _filter_table(1)
    label = {r: f"l{i % 7}" for i, r in enumerate(sorted(set(ref_row_ids(meta)), key=str))}
    order = list(range(meta.num_rows))
    random.Random(5).shuffle(order)
    tagged = meta.take(pa.array(order))
    tagged = tagged.append_column("lang", pa.array([label[r] for r in ref_row_ids(tagged)], pa.string()))
    got = SR.align_labels(meta, tagged)
    assert got.to_pylist() == [label[r] for r in ref_row_ids(meta)]


def test_arrow_uid_packing_equals_the_per_row_one_and_is_as_strict():
    rng = random.Random(0)
    uids = [f"{rng.getrandbits(128):032x}" for _ in range(300)] + ["0" * 32, "f" * 32]
    arr = pa.chunked_array([uids[:100], uids[100:]]).combine_chunks().slice(7)
    assert arrow_u8pairs(arr).tobytes() == S.uids_to_u8pairs(uids[7:]).tobytes()
    for bad in ("F" * 32, "0" * 31, "0" * 31 + "g", None):
        with pytest.raises(ValueError, match="not a uid"):
            arrow_u8pairs(pa.array(uids[:3] + [bad], pa.string()))


def test_large_string_columns_give_the_same_keys_and_statuses():
    """A URL column past 2 GiB arrives as large_string (32-bit offsets overflow): same results."""
    assert normalize_urls(pa.array(URLS, pa.large_string())).to_pylist() == [normalize_url(u) for u in URLS]
    narrow = prepare_batch(_pool(2), 100).select([S.UID, S.URL, CAPTION_STATUS, ROW_KEY])
    large = narrow.set_column(1, S.URL, narrow.column(S.URL).cast(pa.large_string()))
    assert pre_statuses(large).tolist() == ref_pre_statuses(narrow).tolist()


def test_url_normalisation_in_chunks_equals_one_pass(monkeypatch):
    import pipeline.dedup.urlnorm as U

    monkeypatch.setattr(U, "_CHUNK", 4)  # a long column goes through in slices of bounded memory
    urls = URLS + [None] + URLS[:3]
    assert normalize_urls(pa.array(urls)).to_pylist() == [
        None if u is None else normalize_url(u) for u in urls
    ]
