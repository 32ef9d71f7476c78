"""URL normalisation for URL-level dedupe: which URLs count as "the same URL".

One definition shared by the build's URL dedupe (pipeline/dedupe.py) and the demo pool generator, which
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
