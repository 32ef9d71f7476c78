"""Per-host politeness for the download stage: a connection cap per host and the wait before a retry.

Both are per actor (one ``DownloadWorker``): an actor never has more than ``per_host_connections``
requests open to one server — one host name, and one resolved address whatever names lead to it; N
actors may together open N times that (docs/download.md).

The wait before a retry: a ``Retry-After`` header on a 429 or 503 answer (delta-seconds or an HTTP-date,
RFC 9110 §10.2.3) up to a cap — a server asking for longer is not retried early, the row keeps its
transient status; otherwise exponential backoff with full jitter, ``uniform(0, base · 2^k)`` before
retry k+1. The caller skips a wait that would end past its deadline and keeps the last failure instead.
"""

from __future__ import annotations

import email.utils
import ipaddress
import math
import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit


class HostSlots:
    """At most ``per_host`` holders per server at once; waiting is bounded by a deadline.

    A server is a host name *and* the address it resolved to, each capped on its own: a hold takes a slot
    of every key it names, all at once or none. ``127.0.0.1``, ``127.1``, ``2130706433``, ``0x7f000001``
    and ``localhost`` are five names of one address, and an alias or CNAME another name of its target,
    so together they stay within the cap; a name behind many addresses (a CDN) stays within it too.
    """

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host
        self._held: dict[str, int] = {}
        self._cv = threading.Condition()

    @staticmethod
    def key(url: str) -> str:
        """The name key of ``url``'s host (lower case, no trailing dot)."""
        try:
            return "name:" + (urlsplit(url.strip()).hostname or "").rstrip(".")
        except (ValueError, AttributeError):
            return "name:"

    @staticmethod
    def address_key(ip: str) -> str:
        """The address key of a resolved address: one spelling per address (an IPv4-mapped IPv6 address is
        its IPv4 address)."""
        try:
            addr = ipaddress.ip_address(ip.split("%", 1)[0])
        except ValueError:
            return "addr:" + ip
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return f"addr:{addr}"

    @contextmanager
    def hold(self, keys: str | Sequence[str], deadline: float = math.inf) -> Iterator[None]:
        """A slot of each of ``keys`` (a URL alone: its host name), taken together.

        Raises ``TimeoutError`` if they do not all free up before ``deadline``."""
        names = [self.key(keys)] if isinstance(keys, str) else list(dict.fromkeys(keys))
        with self._cv:
            ok = self._cv.wait_for(
                lambda: all(self._held.get(k, 0) < self.per_host for k in names),
                None if deadline == math.inf else max(0.0, deadline - time.monotonic()),
            )
            if not ok:
                raise TimeoutError(f"no connection slot for {', '.join(names)} before the deadline")
            for k in names:
                self._held[k] = self._held.get(k, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                for k in names:
                    left = self._held[k] - 1
                    if left:
                        self._held[k] = left
                    else:
                        del self._held[k]
                self._cv.notify_all()

    def in_use(self, key_or_url: str) -> int:
        """Slots held of a key (``name:…``/``addr:…``) or of a URL's host name."""
        key = key_or_url if key_or_url.startswith(("name:", "addr:")) else self.key(key_or_url)
        with self._cv:
            return self._held.get(key, 0)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP-date); None if absent or invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_wait(attempt: int, retry_after: float | None, base_s: float, cap_s: float) -> float | None:
    """Seconds to wait before retry ``attempt + 1`` (attempt 0 = after the first failure); None: do not retry.

    A server asking for more than ``cap_s`` is not retried early: the row keeps its transient status.
    """
    if retry_after is not None:
        return retry_after if retry_after <= cap_s else None
    return min(cap_s, random.uniform(0.0, base_s * (2**attempt)))
