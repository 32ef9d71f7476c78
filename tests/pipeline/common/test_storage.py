"""pipeline.common.storage: one ``Storage`` object over local disk and S3 (a real SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from pipeline.common import storage
from pipeline.common.manifest import write_manifest
from pipeline.common.storage import LOCAL, Storage

REPO = Path(__file__).resolve().parents[3]
_AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


def _table(n: int = 5, start: int = 0) -> pa.Table:
    return pa.table(
        {"uid": [f"{i:032x}" for i in range(start, start + n)], "x": list(range(start, start + n))}
    )


def _clear_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _AWS_ENV:
        monkeypatch.delenv(name, raising=False)


def test_resolve_local_and_s3():
    fs, p = LOCAL.resolve("some/dir/file.txt")
    assert isinstance(fs, pafs.LocalFileSystem) and p == os.path.abspath("some/dir/file.txt")
    fs, p = Storage.from_env("http://127.0.0.1:1").resolve("s3://bucket/a/b/")
    assert isinstance(fs, pafs.S3FileSystem) and p == "bucket/a/b"
    assert storage.join("s3://b/k", "x", "y.tar") == "s3://b/k/x/y.tar"
    assert storage.join("/tmp/a", "b") == "/tmp/a/b"


def test_filesystem_for_strips_scheme_and_refuses_mixed():
    fs, paths = Storage.from_env("http://127.0.0.1:1").filesystem_for(
        ["s3://b/x.parquet", "s3://b/y.parquet"]
    )
    assert isinstance(fs, pafs.S3FileSystem) and paths == ["b/x.parquet", "b/y.parquet"]
    with pytest.raises(ValueError, match="mix"):
        LOCAL.filesystem_for(["s3://b/x.parquet", "/tmp/y.parquet"])


def test_from_env_resolves_endpoint_region_and_keys_once(monkeypatch):
    _clear_aws_env(monkeypatch)
    assert Storage.from_env() == Storage() == LOCAL
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env-host:1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID-FROM-ENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-from-env")
    store = Storage.from_env()
    assert (store.endpoint, store.region, store.access_key) == (
        "http://env-host:1",
        "eu-west-3",
        "AKID-FROM-ENV",
    )
    assert Storage.from_env("http://given:2").endpoint == "http://given:2"  # the argument wins
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "changed-later")
    assert store.secret_key == "secret-from-env"  # resolved once, at construction


def test_repr_and_describe_show_no_secret(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID-VISIBLE-NOWHERE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-visible-nowhere")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-visible-nowhere")
    store = Storage.from_env("http://user:userinfo-pass@127.0.0.1:8333")
    assert store.secret_key == "secret-visible-nowhere"
    shown = repr(store) + str(store) + json.dumps(store.describe())
    for secret in (
        "AKID-VISIBLE-NOWHERE",
        "secret-visible-nowhere",
        "token-visible-nowhere",
        "userinfo-pass",
    ):
        assert secret not in shown
    assert store.describe()["s3_endpoint"] == "http://127.0.0.1:8333"


def test_manifest_carries_redacted_storage_and_no_credentials(tmp_path, monkeypatch):
    _clear_aws_env(monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID-NOT-IN-MANIFEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-not-in-manifest")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-not-in-manifest")
    endpoint = "http://alice:pa55w0rd@127.0.0.1:8333"
    store = Storage.from_env(endpoint)
    path = write_manifest(
        str(tmp_path / "run"),
        job="build_dataset",
        config={"s3_endpoint": endpoint, "nested": {"urls": [endpoint + "/bucket/x"]}},
        counts={"rows": 1},
        timings={"total": 1.0},
        store=store,
        extra={"source": endpoint},
    )
    text = Path(path).read_text()
    for secret in (
        "alice",
        "pa55w0rd",
        "AKID-NOT-IN-MANIFEST",
        "secret-not-in-manifest",
        "token-not-in-manifest",
    ):
        assert secret not in text
    job = json.loads(text)["jobs"]["build_dataset"]
    assert job["storage"] == {"s3_endpoint": "http://127.0.0.1:8333", "region": ""}
    assert job["config"]["s3_endpoint"] == "http://127.0.0.1:8333"
    assert job["config"]["nested"]["urls"] == ["http://127.0.0.1:8333/bucket/x"]
    assert job["source"] == "http://127.0.0.1:8333"


def test_local_bytes_json_parquet_round_trip(tmp_path):
    base = str(tmp_path / "run")
    LOCAL.write_bytes(b"\x00\x01abc", storage.join(base, "deep", "f.bin"))  # parents created
    assert LOCAL.read_bytes(storage.join(base, "deep", "f.bin")) == b"\x00\x01abc"
    LOCAL.write_json({"a": 1, "b": [1, 2]}, storage.join(base, "m.json"))
    assert LOCAL.read_json(storage.join(base, "m.json")) == {"a": 1, "b": [1, 2]}
    LOCAL.write_parquet(_table(3), storage.join(base, "p", "0.parquet"))
    LOCAL.write_parquet(_table(2, 3), storage.join(base, "p", "1.parquet"))
    assert LOCAL.read_parquet(storage.join(base, "p", "0.parquet")).equals(_table(3))
    both = LOCAL.read_parquet(storage.join(base, "p"))  # a directory
    assert both.column("x").to_pylist() == [0, 1, 2, 3, 4]
    assert LOCAL.read_parquet(storage.join(base, "p", "*.parquet"), columns=["x"]).column_names == ["x"]
    assert not [n for n in os.listdir(tmp_path / "run") if ".tmp-" in n]


def test_local_write_is_atomic_on_error(tmp_path):
    path = str(tmp_path / "out.tar")
    with pytest.raises(RuntimeError):
        with LOCAL.open_output(path) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    LOCAL.write_bytes(b"old", path)
    with pytest.raises(RuntimeError):
        with LOCAL.open_output(path) as f:
            f.write(b"new, half written")
            raise RuntimeError("boom")
    assert LOCAL.read_bytes(path) == b"old"  # the previous version survives a failed rewrite


def test_local_list_files(tmp_path):
    for name in ["b.tar", "a.tar", "a_stats.json", ".hidden.tar", "_tmp.tar"]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.tar").write_bytes(b"x")
    d = str(tmp_path)
    assert LOCAL.list_files(d) == [f"{d}/a.tar", f"{d}/a_stats.json", f"{d}/b.tar"]
    assert LOCAL.list_files(d, suffix=".tar") == [f"{d}/a.tar", f"{d}/b.tar"]
    assert LOCAL.list_files(f"{d}/*.tar") == [f"{d}/a.tar", f"{d}/b.tar"]
    assert LOCAL.list_files(f"{d}/**/*.tar") == [f"{d}/a.tar", f"{d}/b.tar", f"{d}/sub/c.tar"]
    assert LOCAL.list_files(f"{d}/a.tar") == [f"{d}/a.tar"]
    assert LOCAL.list_files(f"{d}/nothing/*.tar") == []
    assert LOCAL.list_files(f"{d}/nothing") == []  # as on S3, where a missing prefix is just empty
    assert LOCAL.exists(f"{d}/a.tar") and LOCAL.isdir(d) and not LOCAL.exists(f"{d}/zz")
    LOCAL.remove_files([f"{d}/a.tar", f"{d}/zz"])
    assert not LOCAL.exists(f"{d}/a.tar")


def test_s3_round_trip(s3_server):
    store = Storage.from_env(s3_server.endpoint)
    base = s3_server.url("storage-rt")
    store.write_bytes(b"hello", storage.join(base, "a", "f.bin"))
    assert store.read_bytes(storage.join(base, "a", "f.bin")) == b"hello"
    store.write_json({"k": [1, 2]}, storage.join(base, "m.json"))
    assert store.read_json(storage.join(base, "m.json")) == {"k": [1, 2]}
    store.write_parquet(_table(3), storage.join(base, "p", "0.parquet"))
    store.write_parquet(_table(2, 3), storage.join(base, "p", "1.parquet"))
    assert store.read_parquet(storage.join(base, "p")).column("x").to_pylist() == [0, 1, 2, 3, 4]
    with store.open_input(storage.join(base, "a", "f.bin")) as f:
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
    store = Storage.from_env()  # the endpoint from AWS_ENDPOINT_URL, as the fixture exports it
    base = s3_server.url("storage-list")
    for name in ["b.tar", "a.tar", "a_stats.json", "sub/c.tar"]:
        store.write_bytes(b"x", storage.join(base, name))
    store.makedirs(base)  # a no-op on S3
    assert store.list_files(base) == [f"{base}/a.tar", f"{base}/a_stats.json", f"{base}/b.tar"]
    assert store.list_files(f"{base}/*.tar") == [f"{base}/a.tar", f"{base}/b.tar"]
    assert store.list_files(base, suffix=".json") == [f"{base}/a_stats.json"]
    assert store.exists(f"{base}/a.tar") and store.isdir(base)
    store.remove(f"{base}/a.tar")
    assert not store.exists(f"{base}/a.tar")
    assert store.list_files(s3_server.url("no-such-prefix")) == []


def test_s3_failed_write_leaves_no_object(s3_server):
    store = Storage.from_env(s3_server.endpoint)
    path = s3_server.url("storage-atomic", "x.tar")
    with pytest.raises(RuntimeError):
        with store.open_output(path) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert not store.exists(path)


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
    wrong = Storage(endpoint=s3_server.endpoint, region="us-east-1", access_key="nobody", secret_key="wrong")
    with pytest.raises(OSError):
        wrong.read_bytes(s3_server.url("anything"))


def test_s3_filesystem_carries_its_settings_when_pickled(s3_server, monkeypatch):
    store = Storage.from_env(s3_server.endpoint)
    store.write_bytes(b"x", s3_server.url("pickle", "a.bin"))
    fs, path = store.filesystem_for(s3_server.url("pickle", "a.bin"))
    for name in s3_server.env:  # a Ray worker started before the env was set has none of it
        monkeypatch.delenv(name)
    with pickle.loads(pickle.dumps(fs)).open_input_stream(path) as f:
        assert f.read() == b"x"


_READ_IN_FRESH_PROCESS = """
import os, pickle, sys
assert not any(k.startswith("AWS_") and k != "AWS_EC2_METADATA_DISABLED" for k in os.environ), "env leaked"
store = pickle.loads(sys.stdin.buffer.read())
path = sys.argv[1]
sys.stdout.write(store.read_bytes(path).decode())
store.write_bytes(b"written by the child", path + ".child")
"""


def test_storage_pickles_with_its_credentials_to_a_fresh_process(s3_server):
    store = Storage.from_env(s3_server.endpoint)
    path = s3_server.url("pickle-store", "a.txt")
    store.write_bytes(b"from the parent", path)
    # The child has no AWS settings at all: endpoint, region and keys come only from the pickled Storage.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _READ_IN_FRESH_PROCESS, path],
        input=pickle.dumps(store),
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode() == "from the parent"
    assert store.read_bytes(path + ".child") == b"written by the child"


@pytest.mark.ray
@pytest.mark.slow  # Ray Data start-up: ~25 s on 2 busy cores
def test_ray_reads_parquet_from_s3(s3_server, ray_local):
    import ray
    import ray.data

    store = Storage.from_env(s3_server.endpoint)
    files = []
    for i in range(2):
        files.append(s3_server.url("ray-read", f"{i}.parquet"))
        store.write_parquet(_table(3, 3 * i), files[-1])
    fs, paths = store.filesystem_for(store.list_files(s3_server.url("ray-read"), suffix=".parquet"))
    rows = ray.data.read_parquet(paths, filesystem=fs).take_all()
    assert sorted(r["x"] for r in rows) == list(range(6))

    @ray.remote
    def read_in_worker(st: Storage, path: str, names: list[str]) -> int:
        # Whatever env this worker started with, take the AWS settings away while reading: the
        # Storage argument alone must carry endpoint and credentials.
        saved = {k: os.environ.pop(k) for k in names if k in os.environ}
        try:
            return st.read_parquet(path).num_rows
        finally:
            os.environ.update(saved)

    assert ray.get(read_in_worker.remote(store, files[1], list(_AWS_ENV))) == 3
