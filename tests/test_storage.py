"""pipeline.storage: one path API over local disk and S3 (a real SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from pipeline import storage
from tests.fixtures_s3 import s3_server  # noqa: F401


def _table(n: int = 5, start: int = 0) -> pa.Table:
    return pa.table(
        {"uid": [f"{i:032x}" for i in range(start, start + n)], "x": list(range(start, start + n))}
    )


def test_resolve_local_and_s3():
    fs, p = storage.resolve("some/dir/file.txt")
    assert isinstance(fs, pafs.LocalFileSystem) and p == os.path.abspath("some/dir/file.txt")
    fs, p = storage.resolve("s3://bucket/a/b/", s3_endpoint="http://127.0.0.1:1")
    assert isinstance(fs, pafs.S3FileSystem) and p == "bucket/a/b"
    assert storage.join("s3://b/k", "x", "y.tar") == "s3://b/k/x/y.tar"
    assert storage.join("/tmp/a", "b") == "/tmp/a/b"


def test_ray_filesystem_strips_scheme_and_refuses_mixed():
    fs, paths = storage.ray_filesystem(["s3://b/x.parquet", "s3://b/y.parquet"], "http://127.0.0.1:1")
    assert isinstance(fs, pafs.S3FileSystem) and paths == ["b/x.parquet", "b/y.parquet"]
    with pytest.raises(ValueError, match="mix"):
        storage.ray_filesystem(["s3://b/x.parquet", "/tmp/y.parquet"])


def test_local_bytes_json_parquet_round_trip(tmp_path):
    base = str(tmp_path / "run")
    storage.write_bytes(b"\x00\x01abc", storage.join(base, "deep", "f.bin"))  # parents created
    assert storage.read_bytes(storage.join(base, "deep", "f.bin")) == b"\x00\x01abc"
    storage.write_json({"a": 1, "b": [1, 2]}, storage.join(base, "m.json"))
    assert storage.read_json(storage.join(base, "m.json")) == {"a": 1, "b": [1, 2]}
    storage.write_parquet(_table(3), storage.join(base, "p", "0.parquet"))
    storage.write_parquet(_table(2, 3), storage.join(base, "p", "1.parquet"))
    assert storage.read_parquet(storage.join(base, "p", "0.parquet")).equals(_table(3))
    both = storage.read_parquet(storage.join(base, "p"))  # a directory
    assert both.column("x").to_pylist() == [0, 1, 2, 3, 4]
    assert storage.read_parquet(storage.join(base, "p", "*.parquet"), columns=["x"]).column_names == ["x"]
    assert not [n for n in os.listdir(tmp_path / "run") if ".tmp-" in n]


def test_local_write_is_atomic_on_error(tmp_path):
    path = str(tmp_path / "out.tar")
    with pytest.raises(RuntimeError):
        with storage.open_output(path) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    storage.write_bytes(b"old", path)
    with pytest.raises(RuntimeError):
        with storage.open_output(path) as f:
            f.write(b"new, half written")
            raise RuntimeError("boom")
    assert storage.read_bytes(path) == b"old"  # the previous version survives a failed rewrite


def test_local_list_files(tmp_path):
    for name in ["b.tar", "a.tar", "a_stats.json", ".hidden.tar", "_tmp.tar"]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.tar").write_bytes(b"x")
    d = str(tmp_path)
    assert storage.list_files(d) == [f"{d}/a.tar", f"{d}/a_stats.json", f"{d}/b.tar"]
    assert storage.list_files(d, suffix=".tar") == [f"{d}/a.tar", f"{d}/b.tar"]
    assert storage.list_files(f"{d}/*.tar") == [f"{d}/a.tar", f"{d}/b.tar"]
    assert storage.list_files(f"{d}/**/*.tar") == [f"{d}/a.tar", f"{d}/b.tar", f"{d}/sub/c.tar"]
    assert storage.list_files(f"{d}/a.tar") == [f"{d}/a.tar"]
    assert storage.list_files(f"{d}/nothing/*.tar") == []
    assert storage.list_files(f"{d}/nothing") == []  # as on S3, where a missing prefix is just empty
    assert storage.exists(f"{d}/a.tar") and storage.isdir(d) and not storage.exists(f"{d}/zz")
    storage.remove_files([f"{d}/a.tar", f"{d}/zz"])
    assert not storage.exists(f"{d}/a.tar")


def test_s3_round_trip(s3_server):
    base = s3_server.url("storage-rt")
    storage.write_bytes(b"hello", storage.join(base, "a", "f.bin"))
    assert storage.read_bytes(storage.join(base, "a", "f.bin")) == b"hello"
    storage.write_json({"k": [1, 2]}, storage.join(base, "m.json"))
    assert storage.read_json(storage.join(base, "m.json")) == {"k": [1, 2]}
    storage.write_parquet(_table(3), storage.join(base, "p", "0.parquet"))
    storage.write_parquet(_table(2, 3), storage.join(base, "p", "1.parquet"))
    assert storage.read_parquet(storage.join(base, "p")).column("x").to_pylist() == [0, 1, 2, 3, 4]
    with storage.open_input(storage.join(base, "a", "f.bin")) as f:
        f.seek(2)
        assert f.read(2) == b"ll"
    # visible through a plain S3 client too: these are real objects on the server
    keys = [
        o["Key"]
        for o in s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="storage-rt/")["Contents"]
    ]
    assert sorted(keys) == [
        "storage-rt/a/f.bin",
        "storage-rt/m.json",
        "storage-rt/p/0.parquet",
        "storage-rt/p/1.parquet",
    ]


def test_s3_list_exists_remove(s3_server):
    base = s3_server.url("storage-list")
    for name in ["b.tar", "a.tar", "a_stats.json", "sub/c.tar"]:
        storage.write_bytes(b"x", storage.join(base, name))
    storage.makedirs(base)  # a no-op on S3
    assert storage.list_files(base) == [f"{base}/a.tar", f"{base}/a_stats.json", f"{base}/b.tar"]
    assert storage.list_files(f"{base}/*.tar") == [f"{base}/a.tar", f"{base}/b.tar"]
    assert storage.list_files(base, suffix=".json") == [f"{base}/a_stats.json"]
    assert storage.exists(f"{base}/a.tar") and storage.isdir(base)
    storage.remove(f"{base}/a.tar")
    assert not storage.exists(f"{base}/a.tar")
    assert storage.list_files(s3_server.url("no-such-prefix")) == []


def test_s3_failed_write_leaves_no_object(s3_server):
    path = s3_server.url("storage-atomic", "x.tar")
    with pytest.raises(RuntimeError):
        with storage.open_output(path) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert not storage.exists(path)


def test_s3_credentials_are_enforced(s3_server):
    import boto3
    from botocore.exceptions import ClientError

    bad = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key="wrong",
        region_name="us-east-1",
    )
    with pytest.raises(ClientError):
        bad.list_objects_v2(Bucket=s3_server.bucket)


def test_s3_filesystem_carries_its_settings_when_pickled(s3_server, monkeypatch):
    import pickle

    storage.write_bytes(b"x", s3_server.url("pickle", "a.bin"))
    fs, path = storage.ray_filesystem(s3_server.url("pickle", "a.bin"))
    for name in s3_server.env:  # a Ray worker started before the env was set has none of it
        monkeypatch.delenv(name)
    with pickle.loads(pickle.dumps(fs)).open_input_stream(path) as f:
        assert f.read() == b"x"


@pytest.mark.ray
@pytest.mark.slow  # Ray Data start-up: ~25 s on 2 busy cores
def test_ray_reads_parquet_from_s3(s3_server, ray_local):
    import ray.data

    files = []
    for i in range(2):
        files.append(s3_server.url("ray-read", f"{i}.parquet"))
        storage.write_parquet(_table(3, 3 * i), files[-1])
    fs, paths = storage.ray_filesystem(storage.list_files(s3_server.url("ray-read"), suffix=".parquet"))
    rows = ray.data.read_parquet(paths, filesystem=fs).take_all()
    assert sorted(r["x"] for r in rows) == list(range(6))
