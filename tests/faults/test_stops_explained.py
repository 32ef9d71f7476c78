"""Failure 5: errors that stopped a job but hid why.

- ``data.max_bad_shards`` exceeded ended in Ray Train's truncated ``WorkerGroupError``; the project's
  ``TooManyBadShards``, naming the shards, was only in worker logs. The job now prints it in one line.
- A parquet file naming a column twice was a ``KeyError`` traceback from the schema check; it is one
  line naming the file and the column.
- A full disk and an unreachable object store were ~40-line tracebacks; each is one line naming the
  output (the state they leave is consistent: the re-run resumes).
"""

from __future__ import annotations

import errno
import shutil
import socket
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import build_dataset as build_job
from jobs import train as train_job
from pipeline import schema as S
from pipeline.build import build
from pipeline.common.config import merge
from pipeline.common.errors import explain
from pipeline.common.storage import Storage
from pipeline.config import BUILD_PRESETS
from tests.faults.tiny_pool import serve, write_files, write_metadata
from tests.fixtures.build_runs import check_invariants, snapshot
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


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 KiB filesystem (tmpfs, mounted as root and unmounted after): the build's disk fills up."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _tiny_build_argv(meta: str, output: str) -> list[str]:
    return ["--preset", "demo", "--set", f"metadata={meta}", "--set", f"output={output}",
            "--set", "download_actors=0", "--set", "part_size=8", "--set", "filters.names=[no_filter]",
            "--set", "download.retries=0"]  # fmt: skip


@pytest.mark.ray
def test_a_full_disk_stops_the_build_in_one_line_and_a_rerun_resumes(ray_local, tmp_path, small_disk, capsys):
    rows = write_files(tmp_path / "pool", n=48, seed=5)
    with serve(tmp_path / "pool") as base:
        meta = write_metadata(tmp_path, rows, base)
        rc = build_job.main(_tiny_build_argv(meta, str(small_disk / "out")))
        line = _one_line(capsys.readouterr().err)
        assert rc == 4 and line.startswith("storage error: disk full: no space left on the device of "), line
        assert str(small_disk) in line and "a re-run resumes" in line
        out = tmp_path / "out"  # the same build, moved to a disk with room, finishes from the copied state
        shutil.copytree(small_disk / "out", out)
        assert build_job.main(_tiny_build_argv(meta, str(out))) == 0, capsys.readouterr().err[-3000:]
    check_invariants(
        snapshot(out), len(rows)
    )  # every input row in exactly one status, each uid once per subset


@pytest.mark.ray
def test_an_unreachable_object_store_stops_the_build_in_one_line(ray_local, tmp_path, monkeypatch, capsys):
    with socket.socket() as s:  # a port of 127.0.0.1 nothing listens on: the store is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    rows = write_files(tmp_path / "pool", seed=5)
    meta = write_metadata(tmp_path, rows, "http://127.0.0.1:1")
    argv = [*_tiny_build_argv(meta, "s3://bucket/out"), "--set", f"s3_endpoint=http://127.0.0.1:{port}"]
    rc = build_job.main(argv)
    line = _one_line(capsys.readouterr().err)
    # caught by the job's check of its output, before Ray starts
    assert rc == 4 and line.startswith("storage error: output s3://bucket/out: "), line
    assert "Could not connect" in line
    assert f"127.0.0.1:{port}" in line and "s3cr3t-value" not in line


def test_the_storage_errors_a_build_meets_are_explained_and_others_are_not(tmp_path, small_disk, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    rows = write_files(tmp_path / "pool", n=48, seed=5)
    with serve(tmp_path / "pool") as base:
        meta = write_metadata(tmp_path, rows, base)
        cfg = merge(BUILD_PRESETS["demo"], {"metadata": meta, "output": str(small_disk / "out"),
                                            "download_actors": 0, "part_size": 8})  # fmt: skip
        with pytest.raises(OSError) as full:  # the build itself, without Ray, on the 64 KiB disk
            build(cfg, log=lambda _: None)
    line = explain(full.value, cfg.output)
    assert full.value.errno == errno.ENOSPC or "[errno 28]" in str(full.value).lower()
    assert line is not None and line.startswith("disk full: no space left on the device of ")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = Storage.from_env(f"http://127.0.0.1:{port}")
    with pytest.raises(Exception) as down:
        store.write_bytes(b"x", "s3://bucket/x")
    line = explain(down.value, "s3://bucket/x")
    assert line is not None and line.startswith("storage unreachable: s3://bucket/x: "), repr(down.value)
    assert (
        explain(KeyError("text"), "out") is None and explain(OSError(errno.EACCES, "denied"), "out") is None
    )
