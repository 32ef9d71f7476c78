"""What one download actor's threads may hold at once while decoding, and glibc's large-buffer release.

``PixelBudget`` bounds the decoded pixels in flight (docs/download.md, "Decode memory: bounded by design");
``return_large_buffers_to_os`` keeps an actor's idle size flat between large images.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import math
import threading
import time
from collections.abc import Iterator


class PixelBudget:
    """Decoded pixels an actor's threads may hold at once; a FIFO so a large image is not starved.

    ``hold(n)`` blocks until ``n`` pixels are free. An image larger than the whole budget waits until the
    budget is entirely free and is then decoded alone, so pixels in flight never exceed
    ``max(total, the largest single image)``. A ``deadline`` (``time.monotonic()``) bounds the wait.
    """

    def __init__(self, total: int) -> None:
        self.total = int(total)
        self._free = self.total
        self._queue: collections.deque[object] = collections.deque()
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int, deadline: float = math.inf) -> Iterator[None]:
        need = min(int(n), self.total)
        ticket = object()
        with self._cv:
            self._queue.append(ticket)
            try:
                ok = self._cv.wait_for(
                    lambda: self._queue[0] is ticket and self._free >= need,
                    None if deadline == math.inf else max(0.0, deadline - time.monotonic()),
                )
            finally:
                self._queue.remove(ticket)
                self._cv.notify_all()
            if not ok:
                raise TimeoutError("deadline passed waiting for the decode pixel budget")
            self._free -= need
        try:
            yield
        finally:
            with self._cv:
                self._free += need
                self._cv.notify_all()


def return_large_buffers_to_os(threshold: int = 1 << 20) -> bool:
    """Ask glibc to serve allocations ≥ ``threshold`` with their own mmap, returned to the OS on free.

    By default glibc raises that threshold after freeing a large buffer (up to 32 MiB), after which Pillow's
    16 MiB blocks land in per-thread heaps that are rarely given back: an actor's idle size then grows to
    its largest image. Process-wide; a no-op (False) where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD; a fixed value also stops the adjusting
    except (OSError, AttributeError):
        return False
