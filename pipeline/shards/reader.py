"""The one reader of our webdataset shards: listing them, and one shard → columnar chunks (no Ray here).

Training ingest, scoring and embedding all read shards through ``ShardReader``; pipeline/ingest/dataset.py
wraps it as Ray Data's file-based read (one read task per shard). Why not ``read_webdataset``: Ray's
reader streams through ``tarfile`` in ``r|`` mode, which silently stops at a damaged header or at a shard
cut on a member boundary (a 10-sample shard cut after 5 reads as 5 samples; tested), so a corrupt shard
could never be counted. We parse with ``iter_shard`` below, which demands the end-of-archive
block: the intact samples before the damage are kept, the rest of the shard is skipped with a warning,
and the distinct damaged shards are counted by a ``report`` callable (in a Ray job, the shared counters
actor of pipeline/ingest/dataset.py). Past ``max_bad_shards`` the read raises ``TooManyBadShards`` naming the
shard, which stops the job.

Output columns: ``key`` (string), ``jpg`` (binary: the sample's image, whichever of ``IMAGE_EXTS`` it
has), ``txt`` (string) and, with ``with_json``, ``json`` (binary, empty when the sample has none). A
sample without an image is skipped, as webdataset does: it can neither train nor be scored.
"""

from __future__ import annotations

import json
import logging
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.common.errors import InputError
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.checksums import CHECKSUM_FIELD, mismatched_members, sample_meta
from pipeline.shards.tar_format import BLOCK, NAME_HEADERS, REGULAR, ShardError, parse_header

log = logging.getLogger(__name__)

READ_CHUNK_ROWS = 256  # rows per table yielded for one shard: a few MB of JPEG bytes
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # image members, in order of preference (webdataset's)

BadShardReport = Callable[[str, str], int]  # (shard path, error) → distinct damaged shards so far
MismatchReport = Callable[[str, str, list[str]], None]  # (shard path, sample key, members that differ)


class TooManyBadShards(InputError, RuntimeError):
    """More distinct corrupt/truncated shards than ``max_bad_shards``; names the last one."""


def stop_reason(counts: dict[str, Any], max_bad_shards: int) -> TooManyBadShards | None:
    """The ingest's own reason for a job that stopped, from the counters every read task reports to
    (``bad_shards``, ``bad_shard_paths``): the error a distributed run's framework cuts short."""
    n, paths = int(counts.get("bad_shards", 0)), list(counts.get("bad_shard_paths", []))
    if n <= max_bad_shards or not paths:
        return None
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return TooManyBadShards(
        f"{n} damaged shards exceed data.max_bad_shards={max_bad_shards}: {', '.join(paths[:3])}{more}"
    )


# --- the streaming tar parser ------------------------------------------------------------------------------------------


def _read_exact(f: Any, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _skip(f: Any, n: int) -> int:
    """Skip ``n`` bytes of a sequential stream (no seek on buffered S3 streams); returns bytes skipped."""
    left = n
    while left:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
            break
        left -= len(chunk)
    return n - left


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a PAX extended header ("<len> key=value\\n" records)."""
    pos, path = 0, None
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        record = data[space + 1 : pos + length - 1]
        k, _, v = record.partition(b"=")
        if k == b"path":
            path = v.decode("utf-8", "surrogateescape")
        pos += length
    return path


def iter_members(
    path: str, store: Storage = LOCAL, extensions: set[str] | None = None
) -> Iterator[tuple[str, bytes]]:
    """Stream ``(member name, data)`` of the regular files in a tar, in archive order.

    Members whose extension is not in ``extensions`` (when given) are skipped without being kept.
    Raises ``ShardError`` naming ``path`` on a bad header checksum, a short header or data, or a missing
    end-of-archive block — after yielding every member read intact before the damage.
    """
    with store.open_input(path, seekable=False) as f:
        offset = 0
        long_name: str | None = None
        while True:
            buf = _read_exact(f, BLOCK)
            if len(buf) < BLOCK:
                what = "end-of-archive block missing" if not buf else "header cut short"
                raise ShardError(f"{path}: truncated at byte {offset + len(buf)} ({what})")
            if buf.count(0) == BLOCK:
                return  # end of archive (the second zero block and record padding need not be read)
            try:
                name, size, kind = parse_header(buf)
            except (tarfile.HeaderError, ValueError) as exc:
                raise ShardError(f"{path}: corrupt tar header at byte {offset} ({exc})") from None
            offset += BLOCK
            padded = size + (-size % BLOCK)
            name = long_name or name
            meta_member = kind in NAME_HEADERS
            keep = kind in REGULAR and (extensions is None or _split(name)[1] in extensions)
            data = b""
            if meta_member or keep:
                data = _read_exact(f, size)
                got = len(data) + (_skip(f, padded - size) if len(data) == size else 0)
            else:
                got = _skip(f, padded)
            if got < padded:
                raise ShardError(f"{path}: truncated inside member {name!r} (byte {offset + got})")
            offset += padded
            if kind in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
                long_name = _pax_path(data)
                continue
            if kind == tarfile.GNUTYPE_LONGNAME:
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
                continue
            long_name = None
            if keep:
                yield name, data


def _split(name: str) -> tuple[str, str]:
    """``dir/key.ext.more`` → (``dir/key``, ``ext.more``): webdataset splits at the first dot of the basename."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def iter_shard(
    path: str, store: Storage = LOCAL, decode: bool = True, extensions: set[str] | None = None
) -> Iterator[dict[str, Any]]:
    """Samples of one shard, in order: ``{"__key__", "__url__", ext: value, ...}``.

    Contiguous members with one key form a sample. ``decode=True`` turns ``txt`` into str and ``json``
    into a dict; ``decode=False`` leaves every member as raw bytes (what resharding copies). On damage
    (see ``iter_members``) every complete sample before it is yielded, the one in progress is dropped, and
    ``ShardError`` is raised. A key that reappears later, or an extension repeated within a sample, is
    also a ``ShardError``: samples must be contiguous.
    """
    current: dict[str, Any] | None = None
    seen: set[str] = set()
    for name, data in iter_members(path, store, extensions):
        key, ext = _split(name)
        if not ext:
            continue  # not a sample member (webdataset ignores these too)
        if current is None or key != current["__key__"]:
            if current is not None:
                yield _decoded(current, path) if decode else current
            if key in seen:
                raise ShardError(f"{path}: members of sample {key!r} are not contiguous")
            seen.add(key)
            current = {"__key__": key, "__url__": path}
        if ext in current:
            raise ShardError(f"{path}: sample {key!r} has two {ext!r} members")
        current[ext] = data
    if current is not None:
        yield _decoded(current, path) if decode else current


def _decoded(sample: dict[str, Any], path: str) -> dict[str, Any]:
    out = dict(sample)
    if "txt" in out:
        out["txt"] = out["txt"].decode("utf-8", "replace")
    if "json" in out:
        try:
            out["json"] = json.loads(out["json"])
        except ValueError as exc:
            raise ShardError(f"{path}: sample {sample['__key__']!r} has invalid json ({exc})") from None
    return out


def list_shards(spec: str, store: Storage = LOCAL) -> list[str]:
    """Shard paths from a directory, a glob, or a comma-separated list (local or s3://), sorted."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.endswith(".tar") and not any(c in part for c in "*?["):
            out.append(part)
        else:
            out.extend(store.list_files(part, suffix=".tar"))
    if not out:
        raise FileNotFoundError(f"no .tar shards at {spec!r}")
    return sorted(set(out))


@dataclass
class ShardCheck:
    """One shard verified against its stored checksums (pipeline/shards/checksums.py)."""

    path: str
    samples: int = 0
    checked: int = 0  # samples that record checksums
    mismatched: dict[str, list[str]] = field(default_factory=dict)  # sample key → members that differ
    error: str = ""  # the shard is damaged from some byte on (ShardError); "" when read to its end

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.error


def verify_shard(path: str, store: Storage = LOCAL) -> ShardCheck:
    """Read every sample of ``path`` and compare its members with the checksums its json records."""
    check = ShardCheck(path)
    try:
        for sample in iter_shard(path, store, decode=False):
            check.samples += 1
            bad = mismatched_members(sample, sample_meta(sample))
            if bad is None:
                continue
            check.checked += 1
            if bad:
                check.mismatched[sample["__key__"]] = bad
    except ShardError as exc:
        check.error = str(exc)
    return check


def _text(value: bytes | None) -> str:
    return "" if value is None else bytes(value).decode("utf-8", "replace")


class ShardReader:
    """One shard path → ``pa.Table`` chunks of at most ``chunk_rows`` samples (columns: module docstring).

    ``max_bad_shards=None`` logs damaged shards and goes on (scoring: every intact pair still gets a
    score); an int stops the read once ``report`` says more distinct shards than that are damaged.
    Without ``report`` each damaged shard counts as the first one. ``verify=True`` drops every sample
    whose bytes differ from the checksums its json records (pipeline/shards/checksums.py), counted in
    ``mismatched`` and reported through ``on_mismatch`` (else logged).
    """

    def __init__(
        self,
        store: Storage = LOCAL,
        *,
        max_bad_shards: int | None = None,
        report: BadShardReport | None = None,
        with_json: bool = False,
        chunk_rows: int = READ_CHUNK_ROWS,
        verify: bool = False,
        on_mismatch: MismatchReport | None = None,
    ) -> None:
        self.store, self.max_bad, self.report = store, max_bad_shards, report
        self.with_json, self.chunk_rows = with_json, chunk_rows
        self.verify, self.on_mismatch = verify, on_mismatch
        self.mismatched = 0  # samples dropped because their bytes differ from their stored checksums
        self.extensions = {*IMAGE_EXTS, "txt", *(("json",) if with_json or verify else ())}

    def __call__(self, path: str) -> Iterator[pa.Table]:
        rows: list[dict[str, bytes | None]] = []
        try:
            for s in iter_shard(path, self.store, decode=False, extensions=self.extensions):
                image = next((s[e] for e in IMAGE_EXTS if e in s), None)
                if image is None:
                    continue  # a sample without an image cannot train or be scored; webdataset skips it
                if self.verify and self._mismatch(path, s):
                    continue
                rows.append({"key": s["__key__"], "jpg": image, "txt": s.get("txt"), "json": s.get("json")})
                if len(rows) >= self.chunk_rows:
                    yield self._table(rows)
                    rows = []
        except (ShardError, OSError) as exc:
            self._bad_shard(path, exc)
        if rows:
            yield self._table(rows)

    def _mismatch(self, path: str, sample: dict[str, Any]) -> bool:
        """True (and reported) when the sample's bytes differ from the checksums its json records."""
        bad = mismatched_members(sample, sample_meta(sample))
        if not bad:
            return False
        self.mismatched += 1
        if self.on_mismatch is not None:
            self.on_mismatch(path, sample["__key__"], bad)
        else:
            log.warning("dropped sample %s of %s: %s differ from its %s", sample["__key__"], path,
                        "+".join(bad), CHECKSUM_FIELD)  # fmt: skip
        return True

    def _table(self, rows: list[dict[str, bytes | None]]) -> pa.Table:
        cols = {
            "key": pa.array([r["key"] for r in rows], pa.string()),
            "jpg": pa.array([r["jpg"] for r in rows], pa.binary()),
            "txt": pa.array([_text(r["txt"]) for r in rows], pa.string()),
        }
        if self.with_json:
            cols["json"] = pa.array([r["json"] or b"" for r in rows], pa.binary())
        return pa.table(cols)

    def _bad_shard(self, path: str, exc: Exception) -> None:
        n = self.report(path, f"{type(exc).__name__}: {exc}") if self.report is not None else 1
        if self.max_bad is not None and n > self.max_bad:
            raise TooManyBadShards(
                f"{n} damaged shards exceed data.max_bad_shards={self.max_bad}; last: {path} ({exc})"
            ) from exc
        log.warning("skipping the rest of damaged shard %s (%d so far): %s", path, n, exc)
