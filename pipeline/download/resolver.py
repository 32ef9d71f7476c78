"""A DNS cache for one download actor: each host name is looked up once, whatever number of threads ask.

DataComp's pool names about one host per few rows, and a download actor's threads would otherwise ask the
node's resolver once per fetch (and again per redirect hop). On AWS the VPC resolver answers at most 1,024
packets per second per network interface, and a build's threads ask more than that; DataComp's own advice is
a caching resolver on every node. ``CachingResolver`` is that cache inside the actor, in front of
``socket.getaddrinfo`` (docs/download.md, "DNS"):

- an answer is kept ``ttl_s`` (300 s; getaddrinfo does not give the record's TTL, and five minutes is what
  common caching resolvers cap a short TTL at for a crawl);
- "no such name" (``EAI_NONAME``/``EAI_NODATA``, a final ``unknown_host``) is kept ``negative_ttl_s`` (60 s);
  a resolver that could not answer (``EAI_AGAIN``, a socket error) is never kept: the next fetch asks again;
- threads asking for a name being looked up wait for that one lookup instead of sending their own;
- at most ``max_entries`` names, the least recently used going first, so memory stays bounded.

Keys are the lookup's arguments (host, port, type), so an answer is reused only for the same question.
The guard still checks every address of a cached answer (pipeline/download/netguard.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

NO_SUCH_NAME = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


class _Lookup:
    """One lookup in flight: its waiters block on ``done`` and read ``value`` or ``error``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: list | None = None
        self.error: BaseException | None = None


class CachingResolver:
    """``getaddrinfo``-compatible callable with a bounded, thread-safe cache (see the module docstring)."""

    def __init__(
        self,
        ttl_s: float = 300.0,
        negative_ttl_s: float = 60.0,
        max_entries: int = 100_000,
        resolve: Callable[..., list] = socket.getaddrinfo,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.negative_ttl_s, self.max_entries = ttl_s, negative_ttl_s, max_entries
        self._resolve, self._clock = resolve, clock
        self._lock = threading.Lock()
        # key → (expires, answer list or the gaierror of a name that does not exist)
        self._cache: OrderedDict[tuple, tuple[float, list | socket.gaierror]] = OrderedDict()
        self._inflight: dict[tuple, _Lookup] = {}
        self.lookups = 0  # lookups sent to the underlying resolver
        self.hits = 0  # answers served from the cache or from another thread's lookup

    def __call__(self, host: str, port: Any, *args: Any, **kwargs: Any) -> list:
        key = (
            host.lower().rstrip(".") if isinstance(host, str) else host,
            port,
            args,
            tuple(sorted(kwargs.items())),
        )
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > self._clock():
                self._cache.move_to_end(key)
                self.hits += 1
                return self._answer(cached[1])
            lookup = self._inflight.get(key)
            mine = lookup is None
            if mine:
                lookup = self._inflight[key] = _Lookup()
                self.lookups += 1
            else:
                self.hits += 1
        if not mine:
            lookup.done.wait()
            if lookup.error is not None:
                raise lookup.error
            return list(lookup.value or [])
        try:
            lookup.value = self._resolve(host, port, *args, **kwargs)
            self._store(key, self.ttl_s, lookup.value)
            return list(lookup.value)
        except socket.gaierror as exc:
            lookup.error = exc
            if exc.errno in NO_SUCH_NAME:
                self._store(key, self.negative_ttl_s, exc)
            raise
        except BaseException as exc:  # an unanswered lookup is shared with its waiters, never kept
            lookup.error = exc
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)
            lookup.done.set()

    @staticmethod
    def _answer(value: list | socket.gaierror) -> list:
        if isinstance(value, socket.gaierror):
            raise socket.gaierror(value.errno, value.strerror)
        return list(value)

    def _store(self, key: tuple, ttl: float, value: list | socket.gaierror) -> None:
        if ttl <= 0:
            return
        with self._lock:
            self._cache[key] = (self._clock() + ttl, value)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
