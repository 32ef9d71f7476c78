"""The tar layout our shards and download parts share: names, the fixed member header, and its parser.

Shards are img2dataset's layout (pipeline/shards/writer.py has it in full). Every header is fixed (mtime
0, uid/gid 0, mode 0644, no user names) so the same samples always give byte-identical shards; the parser
reads plain ustar headers itself and hands anything unusual to ``tarfile``.
"""

from __future__ import annotations

import tarfile

from pipeline.common.errors import InputError

BLOCK = 512
RECORD = 20 * BLOCK  # tar's default record size; archives are padded to it, as GNU tar and tarfile do
MTIME = 0  # fixed for reproducible shards
MEMBER_ORDER = ("jpg", "txt", "json")
# Headers that only carry the next member's name (PAX per-file records, GNU long names).
NAME_HEADERS = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME)
REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


class ShardError(InputError, RuntimeError):
    """A shard is truncated or malformed; the message names the file and the byte offset."""


def shard_name(i: int) -> str:
    return f"{i:08d}.tar"


def stats_name(i: int) -> str:
    return f"{i:08d}_stats.json"


def part_name(i: int, ext: str = "tar") -> str:
    return f"part-{i:06d}.{ext}"


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


def member_header(name: str, size: int) -> bytes:
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


def parse_header(buf: bytes) -> tuple[str, int, bytes]:
    """(name, size, type) of a plain ustar header; anything unusual goes through ``tarfile``."""
    stored = buf[148:156].strip(b"\0 ")
    if buf[257:263] == b"ustar\0" and buf[345] == 0 and buf[124] != 0x80 and stored:
        if int(stored, 8) == sum(buf) - sum(buf[148:156]) + 256:
            name = buf[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            return name, int(buf[124:136].strip(b"\0 ") or b"0", 8), buf[156:157]
    info = tarfile.TarInfo.frombuf(buf, "utf-8", "surrogateescape")
    return info.name, info.size, info.type
