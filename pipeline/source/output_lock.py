"""One build at a time per output: an exclusive lock held in the run state for the whole build.

Two builds writing one output race by construction: the fingerprint check and its write, the deletion of
uncommitted part files (a file another live build is still writing), the status table and shards written
from a part list the other is changing. So ``build()`` holds ``exclusive(output)`` from before the
fingerprint is checked until its last file is written, and a second build is refused in one line naming
the holder (``OutputLocked``, a kind of ``FingerprintMismatch``: the job reports it as a refusal).

- **Local output**: ``fcntl.flock`` on ``work/.lock`` (a hidden name: listings skip it). The kernel
  releases it when the holder exits, however it dies, so a killed build's re-run never waits. The file
  names the holder (host, pid, start) for the refusal.
- **S3 output**: ``work/lock.json`` created with a conditional write (``If-None-Match: *``, which AWS S3
  and SeaweedFS honour), renewed every ``RENEW_S`` by a conditional overwrite of the object this build
  wrote (``If-Match`` its ETag), deleted at the end. A lock not renewed for ``LEASE_S`` (the server's
  clock on both sides: its ``Last-Modified`` and its ``Date``) or held by a dead process of this host is
  stale and taken over, again conditionally, so two builds taking over one stale lock cannot both win.
  A build whose renewal fails (another build took the lock after a stall past the lease) stops before it
  writes the outputs derived from the parts (``check()``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import Storage
from pipeline.source.run_state import FingerprintMismatch, run_dirs

LEASE_S = 60.0  # an S3 lock not renewed for this long belongs to a build that is gone
RENEW_S = 10.0
LOCAL_NAME, S3_NAME = ".lock", "lock.json"


class OutputLocked(FingerprintMismatch):
    """Another build holds the output; the message names it and what to do."""


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip


def _describe(h: dict[str, Any]) -> str:
    return f"pid {h.get('pid', '?')} on {h.get('host', '?')}, started {h.get('started', '?')}"


@contextlib.contextmanager
def exclusive(output: str, store: Storage, log: Callable[[str], None] = print) -> Iterator[Any]:
    """Hold the output's lock for the block; ``OutputLocked`` when another build holds it."""
    lock = _S3Lock(output, store, log) if storage.is_s3(output) else _LocalLock(output)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


class _LocalLock:
    def __init__(self, output: str) -> None:
        self.output = output
        self.path = os.path.join(os.path.abspath(run_dirs(output)["work"]), LOCAL_NAME)
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_json(os.pread(fd, 4096, 0))
            os.close(fd)
            raise OutputLocked(
                f"{self.output} is being written by another build ({_describe(holder)}); "
                "wait for it to end or use another output"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self.fd = fd

    def check(self) -> None:
        """Nothing to check: the kernel holds the lock until this process ends."""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def _read_json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _S3Lock:
    def __init__(self, output: str, store: Storage, log: Callable[[str], None]) -> None:
        self.output, self.log = output, log
        fs_key = store.resolve(storage.join(run_dirs(output)["work"], S3_NAME))[1]
        self.bucket, self.key = fs_key.split("/", 1)
        self.client = _client(store, self.bucket)
        self.holder = _holder()
        self.etag: str | None = None
        self.lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, **condition: str) -> bool:
        """Write the lock object under ``condition``; False when the condition does not hold."""
        from botocore.exceptions import ClientError

        body = json.dumps(self.holder).encode()
        try:
            self.etag = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **condition)[
                "ETag"
            ]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
            ):
                return False
            raise
        return True

    def acquire(self) -> None:
        if self._put(IfNoneMatch="*"):
            return self._start()
        holder, etag, age = self._current()
        if etag is not None and self._stale(holder, age) and self._put(IfMatch=etag):
            self.log(f"lock: took over the lock of a build that is gone ({_describe(holder)}, "
                     f"last renewed {age:.0f} s ago)")  # fmt: skip
            return self._start()
        if etag is None and self._put(IfNoneMatch="*"):  # released between our two requests
            return self._start()
        raise OutputLocked(
            f"{self.output} is being written by another build ({_describe(holder)}, renewed {age:.0f} s ago); "
            f"wait for it to end, or if it died, re-run once its lock is {LEASE_S:.0f} s old"
        )

    def _current(self) -> tuple[dict[str, Any], str | None, float]:
        """(holder, ETag, seconds since its last renewal by the server's clock); ETag None when absent."""
        from botocore.exceptions import ClientError

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return {}, None, 0.0
            raise
        now = _http_date(got["ResponseMetadata"]["HTTPHeaders"].get("date")) or time.time()
        return _read_json(got["Body"].read()), got["ETag"], max(0.0, now - got["LastModified"].timestamp())

    def _stale(self, holder: dict[str, Any], age: float) -> bool:
        if age > LEASE_S:
            return True
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True  # a dead process of this machine renews nothing
            except PermissionError:
                return False
        return False

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="output-lock", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if not self._put(IfMatch=self.etag or ""):
                    self.lost = "another build took the lock over"
                    return
            except Exception as exc:  # the store unreachable: try again; the lease allows several misses
                self.log(f"lock: renewing {self.key} failed ({type(exc).__name__}); retrying")

    def check(self) -> None:
        """``OutputLocked`` when the lock was lost (a stall longer than the lease)."""
        if self.lost:
            raise OutputLocked(
                f"{self.output}: lost the build lock ({self.lost}); its outputs are left to it"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.etag and not self.lost:
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)


def _http_date(value: str | None) -> float | None:
    import email.utils

    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def _client(store: Storage, bucket: str) -> Any:
    """A boto3 client for the store (conditional writes; pyarrow's S3 filesystem has none)."""
    import boto3
    import pyarrow.fs as pafs

    endpoint = store.endpoint
    if endpoint and "://" not in endpoint:
        endpoint = "https://" + endpoint
    region = store.region
    if not region and not endpoint:
        with contextlib.suppress(OSError):
            region = pafs.resolve_s3_region(bucket)  # AWS proper: the bucket's own region
    keys = {"aws_access_key_id": store.access_key, "aws_secret_access_key": store.secret_key,
            "aws_session_token": store.session_token or None} if store.access_key else {}  # fmt: skip
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region or "us-east-1", **keys)
