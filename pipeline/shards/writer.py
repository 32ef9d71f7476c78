"""Webdataset tar shards: writing, streaming them back, and the stats JSON beside each shard.

Layout (img2dataset's, which DataComp's resharder and open_clip read): ``{shard:08d}.tar`` holding
``{key}.jpg``, ``{key}.txt``, ``{key}.json`` per sample — the members of one sample contiguous, always in
that order (other extensions after them, sorted) — and ``{shard:08d}_stats.json`` beside it with
img2dataset's fields (``count``, ``successes``, ``failed_to_download``, ``failed_to_resize``, times,
``status_dict``). A finished shard set also gets ``sizes.json`` (open_clip's convention: shard file name →
sample count, ``{"00000000.tar": 10000, ...}``), from which open_clip_train's ``get_dataset_size`` reads
the number of samples, so it needs no ``--train-num-samples``. Download *parts* use the same tar layout
with key = uid (``part-{i:06d}.tar``).

The tar bytes are produced here rather than by ``tarfile``'s stream writer so every header is fixed
(mtime 0, uid/gid 0, mode 0644, no user names): the same samples always give byte-identical shards.
Reading is a small streaming parser of its own for the opposite reason: ``tarfile`` stops silently at a
damaged or truncated header, and a shard cut at a member boundary looks complete to it. ``iter_shard``
instead demands the end-of-archive block and raises ``ShardError`` naming the file. Memory while reading
is one sample; while writing, nothing beyond the caller's sample.
"""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage

BLOCK = 512
RECORD = 20 * BLOCK  # tar's default record size; archives are padded to it, as GNU tar and tarfile do
MTIME = 0  # fixed for reproducible shards
MEMBER_ORDER = ("jpg", "txt", "json")
# Headers that only carry the next member's name (PAX per-file records, GNU long names).
_NAME_HEADERS = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME)
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


class ShardError(RuntimeError):
    """A shard is truncated or malformed; the message names the file and the byte offset."""


def shard_name(i: int) -> str:
    return f"{i:08d}.tar"


def stats_name(i: int) -> str:
    return f"{i:08d}_stats.json"


def part_name(i: int, ext: str = "tar") -> str:
    return f"part-{i:06d}.{ext}"


# --- writing ------------------------------------------------------------------------------------------


def _as_bytes(ext: str, value: Any) -> bytes | None:
    if value is None:
        return b"" if ext == "txt" else None  # img2dataset writes an empty caption rather than none
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, ensure_ascii=False, default=storage.json_default).encode("utf-8")


def sample_members(sample: Mapping[str, Any] | Sequence[Any]) -> tuple[str, list[tuple[str, bytes]]]:
    """(key, [(ext, bytes), ...]) in the canonical member order.

    ``sample`` is a dict with ``__key__`` (or ``key``) plus one entry per extension — bytes as they are,
    str as UTF-8, anything else as JSON — or a tuple ``(key, jpg_bytes, caption, meta_dict)``.
    """
    if isinstance(sample, Mapping):
        key = sample.get("__key__", sample.get("key"))
        fields = {k: v for k, v in sample.items() if not k.startswith("__") and k != "key"}
    else:
        key, jpg, caption, meta = sample
        fields = {"jpg": jpg, "txt": caption, "json": meta}
    if not isinstance(key, str) or not key or "." in key or "/" in key:
        raise ValueError(f"sample key must be a non-empty string without '.' or '/', got {key!r}")
    order = [e for e in MEMBER_ORDER if e in fields] + sorted(e for e in fields if e not in MEMBER_ORDER)
    members = []
    for ext in order:
        data = _as_bytes(ext, fields[ext])
        if data is not None:
            members.append((ext, data))
    if not members:
        raise ValueError(f"sample {key!r} has no members")
    return key, members


def _header_slow(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    # PAX only adds an extended header when a name needs it (long or non-ASCII); plain keys stay ustar.
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


_TEMPLATE = _header_slow("x", 0)
_MAX_OCTAL_SIZE = 8**11  # 8 GiB: the ustar size field's limit


def _header(name: str, size: int) -> bytes:
    """The header ``tarfile`` would write, built by patching a template (≈10× faster per member)."""
    raw = name.encode("utf-8")
    if len(raw) >= 100 or not raw.isascii() or size >= _MAX_OCTAL_SIZE:
        return _header_slow(name, size)
    buf = bytearray(_TEMPLATE)
    buf[0:100] = raw.ljust(100, b"\0")
    buf[124:136] = b"%011o\0" % size
    buf[148:156] = b"        "
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


def _parse_header(buf: bytes) -> tuple[str, int, bytes]:
    """(name, size, type) of a plain ustar header; anything unusual goes through ``tarfile``."""
    stored = buf[148:156].strip(b"\0 ")
    if buf[257:263] == b"ustar\0" and buf[345] == 0 and buf[124] != 0x80 and stored:
        if int(stored, 8) == sum(buf) - sum(buf[148:156]) + 256:
            name = buf[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            return name, int(buf[124:136].strip(b"\0 ") or b"0", 8), buf[156:157]
    info = tarfile.TarInfo.frombuf(buf, "utf-8", "surrogateescape")
    return info.name, info.size, info.type


class ShardWriter:
    """Write one tar shard sample by sample; published atomically on ``close()`` (see pipeline.common.storage).

    ``with ShardWriter(path) as w: w.write(sample)``; an exception inside the block discards the shard.
    """

    def __init__(self, path: str, store: Storage = LOCAL) -> None:
        self.path = path
        self.count = 0
        self.nbytes = 0
        self._out = store.open_output(path)

    def write(self, sample: Mapping[str, Any] | Sequence[Any]) -> None:
        key, members = sample_members(sample)
        self.write_members(key, members)

    def write_members(self, key: str, members: Sequence[tuple[str, bytes]]) -> None:
        """Low-level: members written as given (bytes untouched) — resharding copies through this."""
        for ext, data in members:
            self._put(_header(f"{key}.{ext}", len(data)))
            self._put(data)
            pad = -len(data) % BLOCK
            if pad:
                self._put(b"\0" * pad)
        self.count += 1

    def _put(self, data: bytes) -> None:
        self._out.write(data)
        self.nbytes += len(data)

    def close(self) -> None:
        end = 2 * BLOCK + (-(self.nbytes + 2 * BLOCK) % RECORD)
        self._put(b"\0" * end)
        self._out.close()

    def abort(self) -> None:
        self._out.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


class PartWriter(ShardWriter):
    """A download part: a shard whose keys are the samples' uids (validated), json carrying ``uid``."""

    def add(self, uid: str, jpg: bytes, caption: str | None, meta: Mapping[str, Any]) -> None:
        if not S.is_valid_uid(uid):
            raise ValueError(f"part sample key must be a 32-hex uid, got {uid!r}")
        self.write({"__key__": uid, "jpg": jpg, "txt": caption, "json": {S.UID: uid, **meta}})


def write_shard(
    path: str, samples: Iterable[Mapping[str, Any] | Sequence[Any]], store: Storage = LOCAL
) -> int:
    """Write ``samples`` to one tar at ``path`` (local or s3://); returns the number written."""
    with ShardWriter(path, store) as w:
        for s in samples:
            w.write(s)
    return w.count


# --- reading ------------------------------------------------------------------------------------------


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
                name, size, kind = _parse_header(buf)
            except (tarfile.HeaderError, ValueError) as exc:
                raise ShardError(f"{path}: corrupt tar header at byte {offset} ({exc})") from None
            offset += BLOCK
            padded = size + (-size % BLOCK)
            name = long_name or name
            meta_member = kind in _NAME_HEADERS
            keep = kind in _REGULAR and (extensions is None or _split(name)[1] in extensions)
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


# --- stats --------------------------------------------------------------------------------------------


def shard_stats(status_counts: Mapping[str, int], start_time: float, end_time: float | None = None) -> dict:
    """img2dataset's ``{shard}_stats.json`` fields from per-status counts (``failed_to_*`` families summed)."""
    end = time.time() if end_time is None else end_time
    counts = {str(k): int(v) for k, v in sorted(status_counts.items())}
    return {
        "count": sum(counts.values()),
        "successes": counts.get(S.STATUS_SUCCESS, 0),
        "failed_to_download": sum(v for k, v in counts.items() if k.startswith(S.DOWNLOAD_FAILED)),
        "failed_to_resize": sum(v for k, v in counts.items() if k.startswith(S.RESIZE_FAILED)),
        "duration": end - start_time,
        "start_time": start_time,
        "end_time": end,
        "status_dict": counts,
    }


def write_stats(path: str, stats: Mapping[str, Any], store: Storage = LOCAL) -> None:
    store.write_json(dict(stats), path)


SIZES_NAME = "sizes.json"


def write_sizes(directory: str, counts: Mapping[str, int], store: Storage = LOCAL) -> str:
    """``directory/sizes.json``: each shard's base name → its sample count (open_clip's convention)."""
    path = storage.join(directory, SIZES_NAME)
    store.write_json({str(k).rsplit("/", 1)[-1]: int(v) for k, v in counts.items()}, path)
    return path
