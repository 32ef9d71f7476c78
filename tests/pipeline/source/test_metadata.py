"""The driver's pyarrow read of the metadata and the actors' read of a part's rows: pure, no Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import schema as S
from pipeline.common.storage import LOCAL
from pipeline.download.phase import LivePlan
from pipeline.source.metadata import MetadataError, open_metadata, read_columns, read_rows
from pipeline.source.row_checks import CAPTION_STATUS, ROW_KEY, pre_statuses, prepare_batch
from pipeline.stages import row_stages as RS
from pipeline.stages.layout import Pool


def _uid(i: int) -> str:
    return f"{(i * 0x9E3779B97F4A7C15) % (1 << 128):032x}"


def _write(path, lo: int, hi: int, row_group_size: int, **extra) -> None:
    n = hi - lo
    cols = {
        S.UID: pa.array([_uid(i) for i in range(lo, hi)], pa.string()),
        S.URL: pa.array([f"http://127.0.0.1/{i}.jpg" for i in range(lo, hi)], pa.string()),
        # raw bytes: some captions are not UTF-8, one is too long for max_caption_bytes=16
        S.TEXT: pa.array([b"\xff\xfe" if i % 7 == 0 else f"caption {i}".encode() * (1 + (i % 5 == 0) * 3)
                          for i in range(lo, hi)], pa.binary()),
    }  # fmt: skip
    cols.update({k: v[:n] for k, v in extra.items()})
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


@pytest.fixture
def pool_dir(tmp_path):
    d = tmp_path / "meta"
    d.mkdir()
    _write(d / "a.parquet", 0, 23, 5)
    _write(d / "b.parquet", 23, 23, 5)  # an empty file
    _write(d / "c.parquet", 23, 60, 8, original_width=pa.array(np.arange(37), pa.int64()))
    return d


def _reference(d, columns):
    """The same columns through prepare_batch over whole files read in Storage.list_files order."""
    tables = [prepare_batch(pq.read_table(p), 16) for p in LOCAL.list_files(str(d), suffix=".parquet")]
    t = pa.concat_tables(tables, promote_options="permissive")
    return t.select([c for c in columns if c in t.column_names])


def test_read_columns_equals_prepare_batch_over_whole_files(pool_dir):
    meta = open_metadata(str(pool_dir))
    assert [f.rsplit("/", 1)[-1] for f in meta.files] == ["a.parquet", "b.parquet", "c.parquet"]
    assert meta.rows == (23, 0, 37) and meta.offsets.tolist() == [0, 23, 23, 60]
    narrow = [S.UID, S.URL, CAPTION_STATUS, ROW_KEY]
    assert read_columns(meta, narrow, 16).equals(_reference(pool_dir, narrow))
    wide = read_columns(meta, [S.UID, S.TEXT, S.ORIGINAL_WIDTH, S.CLIP_B32, ROW_KEY], 16)
    assert wide.column_names == [S.UID, S.TEXT, S.ORIGINAL_WIDTH, ROW_KEY]  # no file has clip scores
    assert wide.column(S.ORIGINAL_WIDTH).null_count == 23  # a.parquet has no width column
    assert wide.column(S.ORIGINAL_WIDTH).to_pylist()[23:] == list(range(37))
    statuses = set(wide.column(S.TEXT).to_pylist())
    assert "" in statuses and "caption 1" in statuses


def test_read_rows_reads_only_the_given_rows_in_order(pool_dir):
    meta = open_metadata(str(pool_dir))
    every = _reference(pool_dir, [S.UID, S.URL, S.TEXT, CAPTION_STATUS, ROW_KEY])
    picked = np.array([3, 4, 9, 21, 22, 23, 30, 31, 59])  # across row groups and across a file boundary
    f, r = meta.locate(picked)
    assert f.tolist() == [0, 0, 0, 0, 0, 2, 2, 2, 2] and r.tolist() == [3, 4, 9, 21, 22, 0, 7, 8, 36]
    got = read_rows(meta.files, f, r, 16)
    want = every.take(pa.array(picked))
    assert got.select(want.column_names).equals(want)


def test_schema_errors_name_the_file(tmp_path):
    with pytest.raises(MetadataError, match="no parquet files"):
        open_metadata(str(tmp_path))
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(MetadataError, match=r"x\.parquet: not a readable parquet file") as exc:
        open_metadata(str(tmp_path))
    assert "\n" not in str(exc.value)
    (tmp_path / "x.parquet").unlink()
    pq.write_table(pa.table({S.UID: ["a"], S.TEXT: ["t"]}), tmp_path / "y.parquet")
    with pytest.raises(MetadataError, match=r"y\.parquet: .*url"):
        open_metadata(str(tmp_path))


def test_parts_are_consecutive_ranges_of_the_live_rows_in_read_order(pool_dir, tmp_path):
    """The pre-download stages (run here in-process, 3 uid buckets) and the part plan read back the live
    rows of ``pre_statuses`` over the whole pool, in read order, 7 a part."""
    meta = open_metadata(str(pool_dir))
    narrow = read_columns(meta, [S.UID, S.URL, CAPTION_STATUS, ROW_KEY], 16)
    status = pre_statuses(narrow)
    pool = Pool(str(tmp_path / "stages"), meta.files, meta.rows, 3, 2, 16, (), (), LOCAL)
    for f in range(len(meta.files)):
        RS.scan_file(pool, f)
    for b in range(pool.n_buckets):
        RS.decide_uids(pool, b)
    for c in range(pool.n_url):
        RS.decide_urls(pool, c)
    plan = LivePlan(pool, tuple(RS.live_rows(pool, f)["live"] for f in range(len(meta.files))))
    live = np.flatnonzero(status == "")
    assert 0 < len(live) < 60 and sum(plan.live) == len(live)
    got = []
    for k in range(plan.n_parts(7)):
        spec = plan.spec(k, 7)
        files = np.concatenate([np.full(hi - lo, f) for f, lo, hi in spec.ranges])
        rows = np.concatenate([RS.live_positions(pool, f, lo, hi) for f, lo, hi in spec.ranges])
        got.append(read_rows(meta.files, files, rows, 16).column(S.UID).to_pylist())
    uids = narrow.column(S.UID).to_pylist()
    assert got == [[uids[i] for i in live[k : k + 7]] for k in range(0, len(live), 7)]
