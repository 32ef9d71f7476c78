"""What one download actor's threads may hold at once while decoding, and glibc's large-buffer release.

``PixelBudget`` bounds the decoded pixels in flight (docs/download.md, "Decode memory: bounded by design");
``return_large_buffers_to_os`` and ``pipeline.common.process_memory.release_free_memory`` keep an actor's
idle size flat between large images without mapping fresh pages for every image.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Iterator

from pipeline.common.process_memory import glibc


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


# Buffers at least this large get their own mmap, unmapped on free. Below it (a decoded web photo up to
# ~2.8 MP, its resized copy, a body) glibc reuses freed memory: with a 1 MiB threshold every image mapped
# and zero-filled fresh pages, ~390 page faults and ~0.6 ms of CPU an image (docs/download.md).
MMAP_THRESHOLD = 8 << 20
# Free memory at the top of a heap is kept for reuse up to this much, not handed back after every image;
# ``process_memory.release_free_memory`` hands it all back between parts.
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def return_large_buffers_to_os(threshold: int = MMAP_THRESHOLD, keep: int = TRIM_THRESHOLD) -> bool:
    """Ask glibc to serve allocations ≥ ``threshold`` with their own mmap, returned to the OS on free, and
    to keep up to ``keep`` bytes of freed heap for reuse (``process_memory.release_free_memory`` returns
    them).

    By default glibc raises the mmap threshold after freeing a large buffer (up to 32 MiB), after which
    Pillow's 16 MiB blocks land in per-thread heaps that are rarely given back: an actor's idle size then
    grows to its largest image. Fixed values also stop that adjusting. Process-wide; a no-op (False) where
    the C library is not glibc.
    """
    libc = glibc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, threshold) and libc.mallopt(_M_TRIM_THRESHOLD, keep))
