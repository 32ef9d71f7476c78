"""URL normalisation for URL-level dedupe: which URLs count as "the same URL".

One definition shared by the build's URL dedupe (pipeline/dedup/decisions.py) and the demo pool generator, which
predicts the dedupe outcome for its truth table. The rule is deliberately conservative — only changes that
never alter what a server returns:

1. strip surrounding whitespace;
2. lower-case the scheme and the host (RFC 3986 §6.2.2.1: both are case-insensitive);
3. drop the port when it is the scheme's default (80 for http, 443 for https; RFC 3986 §6.2.3);
4. drop the fragment (``#...`` is never sent to the server);
5. keep user info, path, params and query exactly as written (they are case- and order-sensitive).

Strings that do not parse as ``scheme://host...`` come back stripped but otherwise unchanged, so invalid
URLs still dedupe among themselves by exact text.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str:
    """The normalised form of ``url`` (see the module docstring for the exact rule)."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError on a non-numeric or out-of-range port
    except ValueError:
        return text
    if not parts.scheme or not parts.netloc:
        return text
    scheme = parts.scheme.lower()
    userinfo, _, hostport = parts.netloc.rpartition("@")
    host = parts.hostname or ""
    if hostport.startswith("["):  # IPv6 literal: keep the brackets
        host = f"[{host}]"
    netloc = host if port is None or _DEFAULT_PORTS.get(scheme) == port else f"{host}:{port}"
    if userinfo:
        netloc = f"{userinfo}@{netloc}"
    return urlunsplit((scheme, netloc, parts.path, parts.query, ""))


# The columnar form covers the URLs a pool is made of — http(s), an ASCII host name, an optional short
# port, printable ASCII after it, ASCII blanks around — and sends every other URL through
# ``normalize_url`` one by one. For such a URL ``urlsplit`` ends the host at the first of ``/?#``, the path
# at the first ``?`` or ``#``, the query at the first ``#``; ``urlunsplit`` drops an empty query's ``?``.
# One regular expression cuts it the same way.
_CHUNK = 1 << 20
_BLANK = r"[ \t\n\r\x0b\x0c]*"  # str.strip removes these (and more: those URLs go the slow way)
_SIMPLE = (
    rf"^{_BLANK}(?P<scheme>[hH][tT][tT][pP][sS]?)://(?P<host>[A-Za-z0-9._~-]+)"
    r"(?::(?P<port>[1-9][0-9]{0,3}))?"
    r"(?P<path>/[\x21\x22\x24-\x3e\x40-\x7e]*)?(?P<query>\?[\x21\x22\x24-\x7e]*)?(?:#[\x21-\x7e]*)?"
    rf"{_BLANK}$"
)


def normalize_urls(urls: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``normalize_url`` of every non-null string of ``urls`` (null stays null), columnar with Arrow."""
    if isinstance(urls, pa.ChunkedArray):
        urls = urls.combine_chunks()
    if not pa.types.is_large_string(urls.type):
        urls = urls.cast(pa.string())
    if len(urls) > _CHUNK:  # the pieces below are copies of the column: bound them
        pieces = [_normalize(urls.slice(i, _CHUNK)) for i in range(0, len(urls), _CHUNK)]
        return pa.chunked_array(pieces, urls.type).combine_chunks()
    return _normalize(urls)


def _normalize(urls: pa.Array) -> pa.Array:
    parts = pc.extract_regex(urls, _SIMPLE)
    simple = pc.fill_null(pc.is_valid(parts), False)
    typ = urls.type  # string, or large_string past 2 GiB: every piece joined below has the same type

    def field(name: str) -> pa.Array:
        return pc.struct_field(parts, name).cast(typ)

    def text(value: str) -> pa.Scalar:
        return pa.scalar(value, typ)

    scheme, port, query = pc.ascii_lower(field("scheme")), field("port"), field("query")
    default = pc.or_(
        pc.and_(pc.equal(scheme, text("http")), pc.equal(port, text("80"))),
        pc.and_(pc.equal(scheme, text("https")), pc.equal(port, text("443"))),
    )
    no_port = pc.or_(pc.equal(port, text("")), default)
    port = pc.if_else(no_port, text(""), pc.binary_join_element_wise(text(":"), port, text("")))
    query = pc.if_else(pc.equal(query, text("?")), text(""), query)
    joined = pc.binary_join_element_wise(
        scheme, text("://"), pc.ascii_lower(field("host")), port, field("path"), query, text("")
    )
    fast = pc.if_else(simple, joined, urls)
    slow = np.flatnonzero(
        ~simple.to_numpy(zero_copy_only=False) & urls.is_valid().to_numpy(zero_copy_only=False)
    )
    if not len(slow):
        return fast
    mask = np.zeros(len(urls), dtype=bool)
    mask[slow] = True
    ref = [_key(u) for u in urls.take(pa.array(slow, pa.int64())).to_pylist()]
    return pc.replace_with_mask(fast, pa.array(mask), pa.array(ref, typ))


def _key(url: str) -> str:
    try:
        return normalize_url(url)
    except ValueError:
        return url  # unparsable: the download stage gives it invalid_url; equal strings still group
