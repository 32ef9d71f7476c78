"""One place that turns a path — local or ``s3://bucket/key`` — into a ``pyarrow.fs`` filesystem and path.

Every stage reads and writes through these helpers so the same code runs on a laptop (local run directory)
and on a cluster (S3 run directory). S3 goes through ``pyarrow.fs.S3FileSystem``: credentials come from the
standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` env vars, config files, instance
profile) and are never logged; a custom endpoint (SeaweedFS, MinIO) comes from the ``s3_endpoint`` argument
or else the ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` env vars (the AWS SDKs' names).

Writes are atomic per file: local files are written to a hidden temp name in the same directory and renamed
on a successful close; an S3 object appears only when its (multipart) upload completes, and an output that
fails mid-write is deleted, so a reader never sees half a shard. Hidden names (leading ``.`` or ``_``) are
skipped by ``list_files`` — the Hadoop/Spark convention Ray Data also follows.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import io
import json
import os
import posixpath
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

S3_PREFIX = "s3://"
# Sequential reads (tar shards) go through a buffer this large so one S3 GET serves many small reads.
READ_BUFFER_BYTES = 8 * 1024 * 1024
# Writes are buffered so the many small pieces of a tar (headers, padding) cost no syscall each.
WRITE_BUFFER_BYTES = 1024 * 1024
_GLOB_CHARS = "*?["


def is_s3(path: str) -> bool:
    return path.startswith(S3_PREFIX)


def _endpoint(s3_endpoint: str) -> str:
    return s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3", "") or os.environ.get("AWS_ENDPOINT_URL", "")


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    """``http://host:port`` → (``host:port``, ``http``); a bare ``host:port`` means https."""
    if "://" in endpoint:
        scheme, rest = endpoint.split("://", 1)
        return rest.rstrip("/"), scheme
    return endpoint.rstrip("/"), "https"


@functools.lru_cache(maxsize=16)
def _s3_filesystem(endpoint: str, region: str, _env_fingerprint: str) -> pafs.S3FileSystem:
    # Keys from the environment are passed explicitly so the filesystem object carries them when Ray
    # pickles it to workers whose environment lacks them; without env keys the SDK's chain (config
    # files, instance profile) runs where the filesystem is used. The fingerprint only keys the cache.
    kwargs: dict[str, Any] = {"region": region or None}
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        kwargs.update(
            access_key=os.environ["AWS_ACCESS_KEY_ID"],
            secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            session_token=os.environ.get("AWS_SESSION_TOKEN") or None,
        )
    if endpoint:
        override, scheme = _split_endpoint(endpoint)
        kwargs.update(endpoint_override=override, scheme=scheme)
    return pafs.S3FileSystem(**kwargs)


@functools.lru_cache(maxsize=64)
def _bucket_region(bucket: str) -> str:
    try:
        return pafs.resolve_s3_region(bucket)
    except OSError:
        return ""  # let the SDK decide


def _env_fingerprint() -> str:
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    raw = "\0".join(os.environ.get(n, "") for n in names)
    return hashlib.sha256(raw.encode()).hexdigest()


def resolve(path: str, s3_endpoint: str = "") -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path inside it)``: ``s3://b/k`` → (S3FileSystem, ``b/k``); else (local, absolute path).

    On AWS proper (no endpoint) without ``AWS_REGION``/``AWS_DEFAULT_REGION``, the bucket's region is
    looked up once, so buckets outside us-east-1 work without configuration.
    """
    if is_s3(path):
        key = path[len(S3_PREFIX) :].rstrip("/")
        endpoint = _endpoint(s3_endpoint)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""
        if not endpoint and not region:
            region = _bucket_region(key.split("/", 1)[0])
        return _s3_filesystem(endpoint, region, _env_fingerprint()), key
    if path.startswith("file://"):
        path = path[len("file://") :]
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def ray_filesystem(
    paths: str | Sequence[str], s3_endpoint: str = ""
) -> tuple[pafs.FileSystem, str | list[str]]:
    """``(fs, paths)`` for ``ray.data.read_parquet(paths, filesystem=fs)``: scheme stripped, one filesystem."""
    if isinstance(paths, str):
        return resolve(paths, s3_endpoint)
    if not paths:
        raise ValueError("ray_filesystem: no paths given")
    kinds = {is_s3(p) for p in paths}
    if len(kinds) > 1:
        raise ValueError("ray_filesystem: cannot mix s3:// and local paths in one read")
    resolved = [resolve(p, s3_endpoint) for p in paths]
    return resolved[0][0], [p for _, p in resolved]


def join(base: str, *parts: str) -> str:
    """Join path parts, keeping an ``s3://`` prefix (always ``/``-separated there)."""
    if is_s3(base):
        return S3_PREFIX + posixpath.join(base[len(S3_PREFIX) :], *parts)
    return os.path.join(base, *parts)


def _unresolve(path: str, like: str) -> str:
    """Inverse of ``resolve`` for listing results: put the scheme back when the query was s3://."""
    return S3_PREFIX + path if is_s3(like) else path


# --- streams ------------------------------------------------------------------------------------------


class AtomicOutput(io.RawIOBase):
    """A binary write stream that publishes its file only on a clean ``close()``.

    Used as a context manager, an exception inside the block discards the partial file instead.
    """

    def __init__(self, path: str, s3_endpoint: str = "") -> None:
        super().__init__()
        self.path = path
        self._fs, self._final = resolve(path, s3_endpoint)
        self._local = not is_s3(path)
        if self._local:
            parent = os.path.dirname(self._final)
            os.makedirs(parent, exist_ok=True)
            self._target = os.path.join(
                parent, f".{os.path.basename(self._final)}.tmp-{uuid.uuid4().hex[:12]}"
            )
        else:
            self._target = self._final
        self._stream = self._fs.open_output_stream(self._target, buffer_size=WRITE_BUFFER_BYTES)
        self._done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._stream.write(data)
        return memoryview(data).nbytes

    def tell(self) -> int:
        return self._stream.tell()

    def flush(self) -> None:
        if not self._done:
            self._stream.flush()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._stream.close()
        if self._local:
            self._fs.move(self._target, self._final)
        super().close()

    def abort(self) -> None:
        """Drop what was written; the destination is left as it was before (absent for S3)."""
        if self._done:
            return
        self._done = True
        try:
            self._stream.close()
        finally:
            try:
                self._fs.delete_file(self._target)
            except (FileNotFoundError, OSError):
                pass
            super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __del__(self) -> None:
        # An output dropped without close() is an error path: never publish it.
        if not getattr(self, "_done", True):
            self.abort()


def open_output(path: str, s3_endpoint: str = "") -> AtomicOutput:
    """Binary write stream for ``path``; parent directories are created; see ``AtomicOutput``."""
    return AtomicOutput(path, s3_endpoint)


def open_input(path: str, s3_endpoint: str = "", seekable: bool = True) -> Any:
    """Binary read stream. ``seekable=True``: random access (one ranged request per read on S3);
    ``seekable=False``: sequential, buffered in ``READ_BUFFER_BYTES`` chunks — use it to stream a shard."""
    fs, p = resolve(path, s3_endpoint)
    if seekable:
        return fs.open_input_file(p)
    return fs.open_input_stream(p, buffer_size=READ_BUFFER_BYTES)


def read_bytes(path: str, s3_endpoint: str = "") -> bytes:
    fs, p = resolve(path, s3_endpoint)
    with fs.open_input_stream(p) as f:
        return f.read()


def write_bytes(data: bytes, path: str, s3_endpoint: str = "") -> None:
    """Atomically write ``data`` to ``path`` (argument order as ``write_parquet(table, path)``)."""
    with open_output(path, s3_endpoint) as f:
        f.write(data)


def write_json(obj: Any, path: str, s3_endpoint: str = "") -> None:
    write_bytes((json.dumps(obj, indent=2, default=json_default) + "\n").encode(), path, s3_endpoint)


def read_json(path: str, s3_endpoint: str = "") -> Any:
    return json.loads(read_bytes(path, s3_endpoint))


def json_default(obj: Any) -> Any:
    # numpy scalars/arrays show up in counts and stats; JSON has no other way to hold them.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_parquet(table: pa.Table, path: str, s3_endpoint: str = "") -> None:
    with open_output(path, s3_endpoint) as f:
        pq.write_table(table, f)


def read_parquet(
    path: str | Sequence[str], s3_endpoint: str = "", columns: Sequence[str] | None = None
) -> pa.Table:
    """One table from a file, a list of files, a directory or a glob (``*.parquet`` files, sorted)."""
    paths = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for p in paths:
        files.extend(list_files(p, suffix=".parquet") if (_has_glob(p) or isdir(p, s3_endpoint)) else [p])
    if not files:
        raise FileNotFoundError(f"no parquet files at {path!r}")
    fs, resolved = ray_filesystem(files, s3_endpoint)
    tables = [pq.read_table(p, filesystem=fs, columns=list(columns) if columns else None) for p in resolved]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


# --- namespace ----------------------------------------------------------------------------------------


def exists(path: str, s3_endpoint: str = "") -> bool:
    fs, p = resolve(path, s3_endpoint)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def isdir(path: str, s3_endpoint: str = "") -> bool:
    fs, p = resolve(path, s3_endpoint)
    return fs.get_file_info(p).type == pafs.FileType.Directory


def makedirs(path: str, s3_endpoint: str = "") -> None:
    """Create a local directory tree; a no-op on S3, where prefixes exist as soon as an object does."""
    if is_s3(path):
        return
    fs, p = resolve(path, s3_endpoint)
    fs.create_dir(p, recursive=True)


def remove(path: str, s3_endpoint: str = "") -> None:
    """Delete one file; missing files are fine (idempotent clean-up)."""
    fs, p = resolve(path, s3_endpoint)
    try:
        fs.delete_file(p)
    except FileNotFoundError:
        pass


def remove_files(paths: Sequence[str], s3_endpoint: str = "") -> None:
    for p in paths:
        remove(p, s3_endpoint)


def _has_glob(path: str) -> bool:
    return any(c in path for c in _GLOB_CHARS)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def list_files(path_or_glob: str, suffix: str | None = None, s3_endpoint: str = "") -> list[str]:
    """Sorted full paths (with ``s3://`` when asked that way) of the files at a path.

    A file → itself; a directory → the files directly inside it; a glob such as ``dir/*.tar`` or
    ``dir/**/*.parquet`` → the matching files. Hidden names (``.``/``_`` prefix) are skipped; ``suffix``
    filters on the name's ending. A missing path or a glob matching nothing gives ``[]`` (callers that
    need files say so with the path in the message).
    """
    if not _has_glob(path_or_glob):
        fs, p = resolve(path_or_glob, s3_endpoint)
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.File:
            return [_unresolve(p, path_or_glob)] if suffix is None or p.endswith(suffix) else []
        if info.type == pafs.FileType.NotFound:
            return []  # S3 cannot tell a missing prefix from an empty one, so neither is an error
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=False))
        out = [i.path for i in infos if i.type == pafs.FileType.File and not _hidden(i.base_name)]
    else:
        head = path_or_glob
        first = min(head.index(c) for c in _GLOB_CHARS if c in head)
        base = head[: head.rfind("/", 0, first)] if "/" in head[:first] else "."
        fs, p = resolve(base, s3_endpoint)
        pattern = head[len(base) + 1 :] if "/" in head[:first] else head
        if fs.get_file_info(p).type != pafs.FileType.Directory:
            return []
        recursive = "**" in pattern or "/" in pattern
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=recursive))
        out = []
        for i in infos:
            if i.type != pafs.FileType.File:
                continue
            rel = i.path[len(p) :].lstrip("/")
            if any(_hidden(part) for part in rel.split("/")):
                continue
            if fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(rel, pattern.replace("**/", "")):
                out.append(i.path)
    if suffix is not None:
        out = [o for o in out if o.endswith(suffix)]
    return sorted(_unresolve(o, path_or_glob) for o in out)


_FORWARDED_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


def forwarded_env() -> dict[str, str]:
    """The driver's AWS settings, to hand to Ray actors whose processes started without them.

    Passed as a constructor argument (object store), never through runtime_env or logs. On a cluster with
    an instance profile this is usually empty and the SDK's own chain applies.
    """
    return {k: os.environ[k] for k in _FORWARDED_ENV if os.environ.get(k)}


def adopt_env(env: dict[str, str]) -> None:
    """In a worker: take the forwarded settings that this process does not have already."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
