"""The bodies the demo server sends for the fault kinds that are about content, not transport.

- ``html_page``: a 200 response that is a web page, not a picture (→ ``failed_to_resize:not_an_image``).
- ``corrupt_jpeg``: a real JPEG's SOI + JFIF APP0 header followed by garbage with no 0xFF byte, so no
  further marker is ever found: every decoder (Pillow, OpenCV) refuses it (→ ``failed_to_resize:corrupt``).
- ``bomb_png``: a valid 1-bit PNG declaring 30000×30000 pixels (9 × 10⁸, ten times DownloadConfig's
  ``max_pixels`` of 89,478,485 = Pillow's own bomb limit) that compresses to ~110 kB
  (→ ``failed_to_resize:too_many_pixels``). A decoder that trusts it allocates ~900 MB.
- ``oversize_body``: a valid JPEG padded with zeros to exactly ``OVERSIZE_BYTES`` (3 MiB). The demo build
  caps downloads at 2 MiB, so it ends ``failed_to_download:too_large``; under a larger cap the picture is
  still valid (decoders stop at the JPEG's EOI marker).
"""

from __future__ import annotations

import struct
import zlib
from functools import lru_cache

import numpy as np

OVERSIZE_BYTES = 3 * 1024 * 1024
BOMB_SIDE = 30_000


def html_page(token: str) -> bytes:
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Photo gallery</title></head>\n'
        f'<body><h1>Gallery</h1><p>This picture moved to a new page.</p><a href="/gallery/{token}">'
        f"{token}</a></body></html>\n"
    ).encode()


def corrupt_jpeg(jpeg: bytes, rng: np.random.Generator) -> bytes:
    """The header of ``jpeg`` up to the end of its APP0 segment, then 2–6 kB of marker-free garbage."""
    if jpeg[:4] != b"\xff\xd8\xff\xe0":
        raise ValueError("expected a JFIF JPEG (SOI followed by APP0)")
    header_end = 4 + struct.unpack(">H", jpeg[4:6])[0]
    garbage = rng.integers(0, 255, size=int(rng.integers(2048, 6144)), dtype=np.uint8).tobytes()  # < 0xFF
    return jpeg[:header_end] + garbage


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


@lru_cache(maxsize=1)
def bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A valid all-black 1-bit greyscale PNG of side × side pixels.

    Compressing ~112 MB of zero scanlines at level 9 takes over a second, so one block of scanlines is
    compressed once, ending in a full flush (which resets the compressor), and repeated: a full flush
    makes each repetition an independent, byte-aligned run of deflate blocks.
    """
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte 0 + packed bits
    rows_per_block = 1000
    block_raw = row * rows_per_block
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = co.compress(block_raw) + co.flush(zlib.Z_FULL_FLUSH)
    full, rest = divmod(side, rows_per_block)
    tail = co.compress(row * rest) + co.flush(zlib.Z_FINISH)
    # Adler-32 of n zero bytes in closed form (a stays 1, b counts the bytes): hashing 112 MB costs more.
    n_raw = len(row) * side
    adler = ((n_raw % 65521) << 16) | 1
    stream = b"\x78\xda" + block * full + tail + struct.pack(">I", adler)
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1 bit, greyscale, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", stream)
        + _png_chunk(b"IEND", b"")
    )


def oversize_body(jpeg: bytes, size: int = OVERSIZE_BYTES) -> bytes:
    if len(jpeg) >= size:
        raise ValueError("picture already larger than the oversize body")
    return jpeg + b"\x00" * (size - len(jpeg))
