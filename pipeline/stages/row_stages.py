"""The build's stages before download, as tasks: scan each metadata file, decide every row per uid bucket
and per URL bucket, then each file's live rows. Decisions equal ``row_checks.pre_statuses`` over the whole
pool (the rules decompose by key: every row of a uid meets in one uid bucket, every live row of a
normalised URL in one URL bucket; the tie between equal rows is their position in read order).

1. ``scan_file`` (per metadata file): the rows in bounded batches through ``prepare_batch`` (decoded
   strings, caption status, row key), each row's content digest and normalised URL, and the columns the
   filters need, written bucketed by uid; the per-row content digests in file order beside them.
2. ``decide_uids`` (per uid bucket): ``row_checks.row_statuses`` (invalid uid, repeated uid, null URL,
   bad caption) over every row of the bucket in read order; its rows with their statuses, the rows still
   going on bucketed by URL, the rows decided bucketed by file.
3. ``decide_urls`` (per URL bucket): DataComp's URL dedupe (the smallest uid keeps a URL), the duplicate
   rows bucketed by file and by uid.
4. ``live_rows`` (per file): the rows neither step decided, as row numbers for the download actors, and
   the file's digests for the run fingerprint (its live mask and its live rows' content).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.common import faults
from pipeline.dedup.decisions import url_key_duplicates
from pipeline.dedup.urlnorm import normalize_urls
from pipeline.source import run_state as R
from pipeline.source.content import COLUMNS as CONTENT_COLUMNS
from pipeline.source.content import content_digests
from pipeline.source.row_checks import CAPTION_STATUS, ROW_KEY, prepare_batch, row_statuses
from pipeline.stages.buckets import BucketWriter, read_bucket, string_buckets, uid_buckets, write_buckets
from pipeline.stages.layout import Pool

SCAN_BATCH = 1 << 16  # rows decoded at a time: a scan task's memory does not grow with its file
URL_KEY, PRE = "url_key", "pre_status"
FILE, ROW, CONTENT = "file", "row", "content"
_TYPES = {f.name: f.type for f in S.METADATA_SCHEMA}


def _scanned(batch: pa.Table, job: Pool, f: int, row0: int) -> tuple[pa.Table, np.ndarray]:
    t = prepare_batch(batch, job.max_caption_bytes, job.served)
    n = t.num_rows
    content = content_digests(t.select([c for c in CONTENT_COLUMNS if c in t.column_names]), job.served)
    cols = {
        S.UID: t.column(S.UID),
        ROW_KEY: t.column(ROW_KEY),
        FILE: pa.array(np.full(n, f, np.int32)),
        ROW: pa.array(np.arange(row0, row0 + n, dtype=np.int64)),
        CAPTION_STATUS: t.column(CAPTION_STATUS),
        URL_KEY: normalize_urls(t.column(S.URL).combine_chunks()),
    }
    for c in job.columns:
        if c not in cols:
            cols[c] = t.column(c) if c in t.column_names else pa.nulls(n, _TYPES.get(c, pa.null()))
    return pa.table(cols), content


def scan_file(job: Pool, f: int) -> dict:
    """Stage 1 for metadata file ``f`` (module docstring); → its row count and uid digest."""
    fs, path = job.store.resolve(job.files[f])
    pf = pq.ParquetFile(path, filesystem=fs, pre_buffer=False, buffer_size=1 << 20)
    names = pf.schema_arrow.names
    wanted = [c for c in dict.fromkeys([S.UID, S.URL, S.TEXT, *CONTENT_COLUMNS, *job.columns]) if c in names]
    writer = BucketWriter(job.scan(f), job.store)
    h, contents, rows = hashlib.sha256(), [], 0
    try:
        for batch in pf.iter_batches(batch_size=SCAN_BATCH, columns=wanted, use_threads=False):
            table, content = _scanned(pa.Table.from_batches([batch]), job, f, rows)
            writer.add(table, uid_buckets(table.column(S.UID), job.n_buckets))
            R.uid_digest_update(h, table.column(S.UID))
            contents.append(content)
            rows += table.num_rows
        writer.close(_scanned(pf.schema_arrow.empty_table().select(wanted), job, f, 0)[0].schema)
    except BaseException:
        writer.abort()
        raise
    content = np.concatenate(contents) if contents else np.zeros(0, np.uint64)
    job.store.write_parquet(pa.table({CONTENT: pa.array(content, pa.uint64())}), job.order(f))
    faults.point("stage.scan")
    return {"rows": rows, "uid_sha256": h.hexdigest()}


def decide_uids(job: Pool, b: int) -> dict:
    """Stage 2 for uid bucket ``b``; → counts per status decided."""
    t = read_bucket([job.scan(f) for f in range(len(job.files))], b, job.store)
    t = t.sort_by([(FILE, "ascending"), (ROW, "ascending")])  # read order: the tie between equal rows
    narrow = t.select([S.UID, CAPTION_STATUS, ROW_KEY]).append_column(S.URL, t.column(URL_KEY))
    status = row_statuses(narrow) if t.num_rows else np.zeros(0, dtype=object)
    t = t.append_column(PRE, pa.array(status.tolist(), pa.string()))
    job.store.write_parquet(t.drop_columns([URL_KEY]), job.rows(b))
    going = pa.array(status == "", pa.bool_())
    pending = t.filter(going).select([URL_KEY, S.UID, FILE, ROW])
    write_buckets(pending, string_buckets(pending.column(URL_KEY), job.n_url), job.urls(b), job.store)
    decided = t.filter(pc.invert(going)).select([FILE, ROW])
    write_buckets(decided, decided.column(FILE).to_numpy(), job.decided(b), job.store)
    values, counts = np.unique(status[status != ""].astype(str), return_counts=True)
    return {"rows": t.num_rows, "decided": {str(v): int(c) for v, c in zip(values, counts, strict=True)}}


def decide_urls(job: Pool, c: int) -> dict:
    """Stage 3 for URL bucket ``c``; → the number of duplicate URLs."""
    t = read_bucket([job.urls(b) for b in range(job.n_buckets)], c, job.store)
    if not t.num_columns or not t.num_rows:
        dups = pa.table({S.UID: pa.array([], pa.string()), FILE: pa.array([], pa.int32()),
                         ROW: pa.array([], pa.int64())})  # fmt: skip
    else:
        mask = url_key_duplicates(t.column(URL_KEY).combine_chunks(), t.column(S.UID).combine_chunks())
        dups = t.filter(pa.array(mask)).select([S.UID, FILE, ROW])
    write_buckets(dups.select([FILE, ROW]), dups.column(FILE).to_numpy(), job.url_dups(c, "file"), job.store)
    write_buckets(dups, uid_buckets(dups.column(S.UID), job.n_buckets), job.url_dups(c, "uid"), job.store)
    return {S.STATUS_DUPLICATE_URL: dups.num_rows}


def live_rows(job: Pool, f: int) -> dict:
    """Stage 4 for metadata file ``f``; → its live count and its fingerprint digests."""
    n = job.file_rows[f]
    gone = [read_bucket([job.decided(b) for b in range(job.n_buckets)], f, job.store, [ROW]),
            read_bucket([job.url_dups(c, "file") for c in range(job.n_url)], f, job.store, [ROW])]  # fmt: skip
    mask = np.ones(n, dtype=bool)
    for t in gone:
        if t.num_columns and t.num_rows:
            mask[t.column(ROW).to_numpy()] = False
    live = np.flatnonzero(mask).astype("<i8")
    job.store.write_bytes(live.tobytes(), job.live(f))
    content = job.store.read_parquet(job.order(f)).column(CONTENT).to_numpy()
    return {"live": len(live), **R.live_digests(mask, content)}


def live_positions(job: Pool, f: int, lo: int, hi: int) -> np.ndarray:
    """Row numbers of file ``f``'s live rows ``lo .. hi`` (in live order): one ranged read."""
    if hi <= lo:
        return np.zeros(0, np.int64)
    with job.store.open_input(job.live(f)) as fh:
        data = fh.read_at(8 * (hi - lo), 8 * lo)
    return np.frombuffer(data, "<i8").astype(np.int64)
