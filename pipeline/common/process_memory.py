"""Handing a long-lived worker's freed memory back to the OS, so its size between tasks is what it holds.

A Ray worker runs task after task; glibc keeps freed heap pages for reuse and Arrow's allocator keeps
freed blocks, so without a release a worker's resident size is the largest any earlier task reached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Hand every arena's free pages back to the OS (``malloc_trim(0)``) and Arrow's default pool's unused
    blocks. False where the C library is not glibc."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    libc = glibc()
    return bool(libc and libc.malloc_trim(0) >= 0)
