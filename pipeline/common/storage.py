"""One place that turns a path — local or ``s3://bucket/key`` — into a ``pyarrow.fs`` filesystem and path.

Every stage reads and writes through one ``Storage`` object so the same code runs on a laptop (local run
directory) and on a cluster (S3 run directory). S3 goes through ``pyarrow.fs.S3FileSystem``: credentials
come from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` env vars, config files,
instance profile) and are never logged; a custom endpoint (SeaweedFS, MinIO) is the job's
``storage.s3_endpoint`` (``pipeline.common.storage_config``, declared once, held by every job config) or else
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``. ``StorageConfig.store()`` reads it all once, in the job.

Writes are atomic per file: local files are written to a hidden temp name in the same directory and renamed
on a successful close; an S3 object appears only when its (multipart) upload completes, and an output that
fails mid-write is deleted, so a reader never sees half a shard. Hidden names (leading ``.`` or ``_``) are
skipped by ``list_files`` — the Hadoop/Spark convention Ray Data also follows.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import io
import json
import os
import posixpath
import re
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.common import faults

S3_PREFIX = "s3://"
# Sequential reads (tar shards) go through a buffer this large so one S3 GET serves many small reads.
READ_BUFFER_BYTES = 8 * 1024 * 1024
# Writes are buffered so the many small pieces of a tar (headers, padding) cost no syscall each.
WRITE_BUFFER_BYTES = 1024 * 1024
_GLOB_CHARS = "*?["


# Query parameters that carry a credential (S3/GCS/Azure presigned URLs, common API tokens).
_SECRET_PARAMS = re.compile(
    r"(?i)([?&](?:x-amz-(?:credential|signature|security-token)|x-goog-(?:credential|signature)|signature|sig"
    r"|awsaccesskeyid|access_token|token|api_key|apikey|password|secret)=)[^&#\s]*"
)
_USERINFO = re.compile(r"(?i)^((?:[a-z][a-z0-9+.-]*:)?//)[^/?#\s]*@")  # scheme://userinfo@ or //userinfo@
_BARE_USERINFO = re.compile(
    r"^[^/?#@\s:]*:[^/?#@\s]*@(?=[^/?#@\s])"
)  # user:secret@host (endpoint, no scheme)


def redact_url(url: str) -> str:
    """``scheme://user:secret@host:port/x`` → ``scheme://host:port/x``: userinfo never reaches a file or log.

    Also a scheme-less endpoint ``user:secret@host:port`` (a bare endpoint means https) and the values of
    credential query parameters (``X-Amz-Signature=…`` → ``X-Amz-Signature=REDACTED``).
    """
    out = _BARE_USERINFO.sub("", _USERINFO.sub(r"\1", url, count=1), count=1)
    return _SECRET_PARAMS.sub(r"\1REDACTED", out) if ("?" in out or "&" in out) else out


def redact_text(text: str) -> str:
    """Every URL inside free text (an error message, a log line) with its userinfo and credentials removed."""
    text = re.sub(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]*@", r"\1", text)
    return _SECRET_PARAMS.sub(r"\1REDACTED", text)


def is_s3(path: str) -> bool:
    return path.startswith(S3_PREFIX)


def _endpoint(endpoint: str) -> str:
    return endpoint or os.environ.get("AWS_ENDPOINT_URL_S3", "") or os.environ.get("AWS_ENDPOINT_URL", "")


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    """``http://host:port`` → (``host:port``, ``http``); a bare ``host:port`` means https."""
    if "://" in endpoint:
        scheme, rest = endpoint.split("://", 1)
        return rest.rstrip("/"), scheme
    return endpoint.rstrip("/"), "https"


@functools.lru_cache(maxsize=16)
def _s3_filesystem(
    endpoint: str, region: str, access_key: str, secret_key: str, session_token: str
) -> pafs.S3FileSystem:
    # Keys are passed explicitly so the filesystem object carries them when Ray pickles it to workers
    # whose environment lacks them; without keys the SDK's chain (config files, instance profile) runs
    # where the filesystem is used.
    kwargs: dict[str, Any] = {"region": region or None}
    if (attempts := os.environ.get("AWS_MAX_ATTEMPTS", "")).isdigit() and int(attempts) > 0:  # the SDKs' name
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=int(attempts))  # else 3
    if access_key and secret_key:
        kwargs.update(access_key=access_key, secret_key=secret_key, session_token=session_token or None)
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


def join(base: str, *parts: str) -> str:
    """Join path parts, keeping an ``s3://`` prefix (always ``/``-separated there)."""
    if is_s3(base):
        return S3_PREFIX + posixpath.join(base[len(S3_PREFIX) :], *parts)
    return os.path.join(base, *parts)


def _unresolve(path: str, like: str) -> str:
    """Inverse of ``resolve`` for listing results: put the scheme back when the query was s3://."""
    return S3_PREFIX + path if is_s3(like) else path


# --- the storage object -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Storage:
    """Where a run's files live, resolved once: an optional S3 endpoint plus the credentials in force.

    Built by a job from its config (``cfg.storage.store()``) and passed down as one object, so
    no library function takes an endpoint string. It pickles to Ray workers with the credentials it was
    built with (workers need not share the driver's environment); ``repr`` and ``describe`` never show
    them. Local paths ignore everything here; ``s3://`` paths get a ``pyarrow.fs.S3FileSystem`` per
    (endpoint, region), cached per process.
    """

    endpoint: str = ""  # custom S3 endpoint (SeaweedFS, MinIO); "" = AWS proper
    region: str = ""  # "" = AWS_REGION/AWS_DEFAULT_REGION, else looked up per bucket on AWS proper
    access_key: str = dataclasses.field(default="", repr=False)
    secret_key: str = dataclasses.field(default="", repr=False)
    session_token: str = dataclasses.field(default="", repr=False)

    @classmethod
    def from_env(cls, endpoint: str = "") -> Storage:
        """``endpoint`` (else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) and the AWS env credentials."""
        env = os.environ
        keys = bool(env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"))
        return cls(
            endpoint=_endpoint(endpoint),
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "",
            access_key=env["AWS_ACCESS_KEY_ID"] if keys else "",
            secret_key=env["AWS_SECRET_ACCESS_KEY"] if keys else "",
            session_token=env.get("AWS_SESSION_TOKEN", "") if keys else "",
        )

    def __repr__(self) -> str:
        # Logs and tracebacks show the object: the endpoint may carry userinfo, the keys never show.
        return f"Storage(endpoint={redact_url(self.endpoint)!r}, region={self.region!r})"

    def describe(self) -> dict[str, str]:
        """What may be written to a manifest: the endpoint without userinfo, never a credential."""
        return {"s3_endpoint": redact_url(self.endpoint), "region": self.region}

    def resolve(self, path: str) -> tuple[pafs.FileSystem, str]:
        """``(filesystem, path inside it)``: ``s3://b/k`` → (S3FileSystem, ``b/k``); else (local, absolute).

        On AWS proper (no endpoint) with no region configured, the bucket's region is looked up once, so
        buckets outside us-east-1 work without configuration.
        """
        if is_s3(path):
            key = path[len(S3_PREFIX) :].rstrip("/")
            region = self.region
            if not self.endpoint and not region:
                region = _bucket_region(key.split("/", 1)[0])
            fs = _s3_filesystem(self.endpoint, region, self.access_key, self.secret_key, self.session_token)
            return fs, key
        if path.startswith("file://"):
            path = path[len("file://") :]
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))

    def filesystem_for(self, paths: str | Sequence[str]) -> tuple[pafs.FileSystem, str | list[str]]:
        """``(fs, paths)`` for ``ray.data.read_*(paths, filesystem=fs)``: scheme stripped, one filesystem."""
        if isinstance(paths, str):
            return self.resolve(paths)
        if not paths:
            raise ValueError("filesystem_for: no paths given")
        if len({is_s3(p) for p in paths}) > 1:
            raise ValueError("filesystem_for: cannot mix s3:// and local paths in one read")
        resolved = [self.resolve(p) for p in paths]
        return resolved[0][0], [p for _, p in resolved]

    def open_output(self, path: str) -> AtomicOutput:
        """Binary write stream for ``path``; parent directories are created; see ``AtomicOutput``."""
        return AtomicOutput(path, self)

    def open_input(self, path: str, seekable: bool = True) -> Any:
        """Binary read stream. ``seekable=True``: random access (one ranged request per read on S3);
        ``seekable=False``: sequential, buffered in ``READ_BUFFER_BYTES`` chunks — to stream a shard."""
        fs, p = self.resolve(path)
        if seekable:
            return fs.open_input_file(p)
        return fs.open_input_stream(p, buffer_size=READ_BUFFER_BYTES)

    def read_bytes(self, path: str) -> bytes:
        fs, p = self.resolve(path)
        with fs.open_input_stream(p) as f:
            return f.read()

    def write_bytes(self, data: bytes, path: str) -> None:
        """Atomically write ``data`` to ``path`` (argument order as ``write_parquet(table, path)``)."""
        with self.open_output(path) as f:
            f.write(data)

    def write_json(self, obj: Any, path: str) -> None:
        self.write_bytes((json.dumps(obj, indent=2, default=json_default) + "\n").encode(), path)

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    def write_parquet(self, table: pa.Table, path: str) -> None:
        with self.open_output(path) as f:
            pq.write_table(table, f)

    def read_parquet(self, path: str | Sequence[str], columns: Sequence[str] | None = None) -> pa.Table:
        """One table from a file, a list of files, a directory or a glob (``*.parquet`` files, sorted)."""
        files: list[str] = []
        for p in [path] if isinstance(path, str) else list(path):
            many = _has_glob(p) or self.isdir(p)
            files.extend(self.list_files(p, suffix=".parquet") if many else [p])
        if not files:
            raise FileNotFoundError(f"no parquet files at {path!r}")
        fs, resolved = self.filesystem_for(files)
        cols = list(columns) if columns else None
        tables = [pq.read_table(p, filesystem=fs, columns=cols) for p in resolved]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")

    def exists(self, path: str) -> bool:
        fs, p = self.resolve(path)
        return fs.get_file_info(p).type != pafs.FileType.NotFound

    def isdir(self, path: str) -> bool:
        fs, p = self.resolve(path)
        return fs.get_file_info(p).type == pafs.FileType.Directory

    def makedirs(self, path: str) -> None:
        """Create a local directory tree; a no-op on S3, where prefixes exist as soon as an object does."""
        if not is_s3(path):
            fs, p = self.resolve(path)
            fs.create_dir(p, recursive=True)

    def remove(self, path: str) -> None:
        """Delete one file; missing files are fine (idempotent clean-up)."""
        fs, p = self.resolve(path)
        try:
            fs.delete_file(p)
        except FileNotFoundError:
            pass

    def remove_files(self, paths: Sequence[str]) -> None:
        for p in paths:
            self.remove(p)

    def list_files(self, path_or_glob: str, suffix: str | None = None) -> list[str]:
        """Sorted full paths (with ``s3://`` when asked that way) of the files at a path.

        A file → itself; a directory → the files directly inside it; a glob such as ``dir/*.tar`` or
        ``dir/**/*.parquet`` → the matching files. Hidden names (``.``/``_`` prefix) are skipped; ``suffix``
        filters on the name's ending. A missing path or a glob matching nothing gives ``[]`` (callers that
        need files say so with the path in the message).
        """
        out = _glob_files(self, path_or_glob) if _has_glob(path_or_glob) else _dir_files(self, path_or_glob)
        if suffix is not None:
            out = [o for o in out if o.endswith(suffix)]
        return sorted(_unresolve(o, path_or_glob) for o in out)


LOCAL = Storage()  # local paths only need no settings; s3:// through it uses the SDK's default chain

# --- streams ------------------------------------------------------------------------------------------


class AtomicOutput(io.RawIOBase):
    """A binary write stream that publishes its file only on a clean ``close()``.

    Used as a context manager, an exception inside the block discards the partial file instead.
    """

    def __init__(self, path: str, store: Storage | None = None) -> None:
        super().__init__()
        self.path = path
        self._fs, self._final = (store or LOCAL).resolve(path)
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
        faults.point("storage.publish")  # a crash before the file appears (pipeline/common/faults.py)
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


def json_default(obj: Any) -> Any:
    # numpy scalars/arrays show up in counts and stats; JSON has no other way to hold them.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _has_glob(path: str) -> bool:
    return any(c in path for c in _GLOB_CHARS)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _dir_files(store: Storage, path: str) -> list[str]:
    """A file → itself; a directory → the visible files directly inside; missing → ``[]``."""
    fs, p = store.resolve(path)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.File:
        return [p]
    if info.type == pafs.FileType.NotFound:
        return []  # S3 cannot tell a missing prefix from an empty one, so neither is an error
    infos = fs.get_file_info(pafs.FileSelector(p, recursive=False))
    return [i.path for i in infos if i.type == pafs.FileType.File and not _hidden(i.base_name)]


def _glob_files(store: Storage, pattern_path: str) -> list[str]:
    first = min(pattern_path.index(c) for c in _GLOB_CHARS if c in pattern_path)
    nested = "/" in pattern_path[:first]
    base = pattern_path[: pattern_path.rfind("/", 0, first)] if nested else "."
    fs, p = store.resolve(base)
    pattern = pattern_path[len(base) + 1 :] if nested else pattern_path
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    recursive = "**" in pattern or "/" in pattern
    out = []
    for i in fs.get_file_info(pafs.FileSelector(p, recursive=recursive)):
        if i.type != pafs.FileType.File:
            continue
        rel = i.path[len(p) :].lstrip("/")
        if any(_hidden(part) for part in rel.split("/")):
            continue
        if fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(rel, pattern.replace("**/", "")):
            out.append(i.path)
    return out
