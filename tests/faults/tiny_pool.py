"""A tiny pool whose every row ends the same way on every run: the build kill suite compares resumed
builds with a clean one status for status and byte for byte, so nothing here depends on timing.

Rows: JPEGs of random colours (most), a 404, a private address (``blocked_address``), a non-http URL
(``invalid_url``), a body that is not an image (``failed_to_resize``), a sha256 that does not match, a
row repeating an earlier URL (``duplicate_url``), a repeated uid, an empty caption and a refused
connection (``failed_to_download:connection_error``, transient: what ``retry_failed`` fetches again). The files are
served by Python's own ``http.server`` in a subprocess bound to 127.0.0.1 (``serve``), stopped by PID;
the URLs carry the server's port, which the run fingerprint ignores for loopback URLs.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pipeline import schema as S


def _jpeg(rng: np.random.Generator, side: int) -> bytes:
    """A random 4×4 grid of colours: distinct pictures, far apart in pHash."""
    grid = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    arr = np.repeat(np.repeat(grid, side // 4, axis=0), (side + 8) // 4, axis=1)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_files(root: Path, n: int = 48, seed: int = 0) -> list[dict]:
    """The pictures under ``root/img`` and the rows (URLs relative to the server, ``{base}`` to fill)."""
    rng = np.random.default_rng(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        side = 24 + (i % 5) * 8
        body = _jpeg(rng, side)
        name = f"{i:04d}.jpg"
        (root / "img" / name).write_bytes(body)
        rows.append({S.UID: f"{seed:08x}{i:024x}", S.URL: "{base}/img/" + name,
                     S.TEXT: f"a picture number {i} in colour", S.SHA256: hashlib.sha256(body).hexdigest(),
                     S.ORIGINAL_WIDTH: side + 8, S.ORIGINAL_HEIGHT: side,
                     S.CLIP_B32: float(rng.uniform(0.1, 0.4)), S.CLIP_L14: float(rng.uniform(0.1, 0.4)),
                     S.FACE_BBOXES: [[0.1, 0.1, 0.3, 0.3]] if i % 6 == 0 else []})  # fmt: skip
    (root / "img" / "not-an-image.jpg").write_bytes(b"<html>not a picture</html>")
    rows[3][S.URL] = "{base}/img/missing.jpg"  # 404
    rows[5][S.URL] = "http://10.1.2.3/img/x.jpg"  # blocked_address, no connection
    rows[7][S.URL] = "ftp://example.com/x.jpg"  # invalid_url
    rows[9][S.URL], rows[9][S.SHA256] = "{base}/img/not-an-image.jpg", None  # failed_to_resize
    rows[11][S.SHA256] = "0" * 64  # hash_mismatch
    rows[13][S.URL] = rows[12][S.URL]  # duplicate_url
    rows[15][S.UID] = rows[14][S.UID]  # duplicate_uid
    rows[17][S.TEXT] = ""
    rows[19][S.URL] = "http://127.0.0.1:1/img/refused.jpg"  # connection refused: transient, every time
    return rows


def write_metadata(root: Path, rows: list[dict], base_url: str, name: str = "meta") -> str:
    out = root / name
    out.mkdir(exist_ok=True)
    table = pa.Table.from_pylist([{**r, S.URL: r[S.URL].replace("{base}", base_url)} for r in rows])
    pq.write_table(table, out / "part-00000.parquet", row_group_size=16)
    return str(out)


@contextmanager
def serve(root: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """``python -m http.server`` on ``host`` (any free port) over ``root``; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", host, "--directory", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 40123 (http://127.0.0.1:40123/) ..."
        port = re.search(r"port (\d+)", line)
        assert port, line
        yield f"http://{host}:{port.group(1)}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
