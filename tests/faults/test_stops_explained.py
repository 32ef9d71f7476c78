"""Failure 5: errors that stopped a job but hid why.

- ``data.max_bad_shards`` exceeded ended in Ray Train's truncated ``WorkerGroupError``; the project's
  ``TooManyBadShards``, naming the shards, was only in worker logs. The job now prints it in one line.
- A parquet file naming a column twice was a ``KeyError`` traceback from the schema check; it is one
  line naming the file and the column.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import build_dataset as build_job
from jobs import train as train_job
from pipeline import schema as S
from tests.fixtures.train_shards import write_demo_shards


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.ray
def test_a_column_named_twice_is_one_line_naming_file_and_column(ray_local, tmp_path, capsys) -> None:
    meta = tmp_path / "meta" / "part-00000.parquet"
    meta.parent.mkdir()
    cols = [pa.array([f"{i:032x}" for i in range(4)]), pa.array(["http://x.example/a.jpg"] * 4),
            pa.array(["a caption"] * 4), pa.array(["another caption"] * 4)]  # fmt: skip
    pq.write_table(pa.Table.from_arrays(cols, names=[S.UID, S.URL, S.TEXT, S.TEXT]), meta)
    rc = build_job.main(["--preset", "demo", "--set", f"metadata={meta.parent}",
                         "--set", f"output={tmp_path / 'out'}"])  # fmt: skip
    line = _one_line(capsys.readouterr().err)
    assert rc != 0 and str(meta) in line and "text: column name appears 2 times" in line


@pytest.mark.ray
@pytest.mark.slow
def test_too_many_bad_shards_stop_the_job_in_one_line_naming_them(ray_local, tmp_path, capfd) -> None:
    shards = Path(tmp_path / "shards")
    paths = write_demo_shards(shards, n_shards=4, per_shard=24, size=32)
    for p in paths[1:3]:  # two shards cut short, one allowed
        data = Path(p).read_bytes()
        Path(p).write_bytes(data[: len(data) // 2])
    argv = ["--preset", "demo", "--shards", str(shards), "--set", "model=demo-32px", "--set", "global_batch_size=8",
            "--set", "samples_seen=400", "--set", "tokenizer_vocab=512", "--set", "data.max_bad_shards=1",
            "--set", "scaling.num_workers=1", "--set", "data.shuffle_window=0",
            "--set", f"run.storage_path={tmp_path / 'train'}", "--set", "run.name=bad"]  # fmt: skip
    capfd.readouterr()
    rc = train_job.main(argv)
    err = capfd.readouterr().err
    stops = [line for line in err.splitlines() if "max_bad_shards" in line]
    assert rc == 3 and len(stops) == 1, err[-3000:]
    assert stops[0].startswith("input error: 2 damaged shards exceed data.max_bad_shards=1: ")
    assert paths[1] in stops[0] and paths[2] in stops[0]
    assert "WorkerGroupError" not in err and "Traceback" not in err
