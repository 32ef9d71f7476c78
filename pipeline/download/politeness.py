"""Per-host politeness for the download stage: a connection cap per host and the wait before a retry.

Both are per actor (one ``DownloadWorker``): an actor never has more than ``per_host_connections``
requests open to one host name; N actors may together open N times that (docs/download.md).

The wait before a retry: a ``Retry-After`` header on a 429 or 503 answer (delta-seconds or an HTTP-date,
RFC 9110 §10.2.3) up to a cap — a server asking for longer is not retried early, the row keeps its
transient status; otherwise exponential backoff with full jitter, ``uniform(0, base · 2^k)`` before
retry k+1. The caller skips a wait that would end past its deadline and keeps the last failure instead.
"""

from __future__ import annotations

import email.utils
import math
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit


class HostSlots:
    """At most ``per_host`` holders per host name at once; waiting is bounded by a deadline."""

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host
        self._held: dict[str, int] = {}
        self._cv = threading.Condition()

    @staticmethod
    def key(url: str) -> str:
        try:
            return (urlsplit(url.strip()).hostname or "").rstrip(".")
        except (ValueError, AttributeError):
            return ""

    @contextmanager
    def hold(self, url: str, deadline: float = math.inf) -> Iterator[None]:
        """Raises ``TimeoutError`` if no slot for ``url``'s host frees up before ``deadline``."""
        host = self.key(url)
        with self._cv:
            ok = self._cv.wait_for(
                lambda: self._held.get(host, 0) < self.per_host,
                None if deadline == math.inf else max(0.0, deadline - time.monotonic()),
            )
            if not ok:
                raise TimeoutError(f"no connection slot for {host!r} before the deadline")
            self._held[host] = self._held.get(host, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                left = self._held[host] - 1
                if left:
                    self._held[host] = left
                else:
                    del self._held[host]
                self._cv.notify_all()

    def in_use(self, url: str) -> int:
        with self._cv:
            return self._held.get(self.key(url), 0)


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
