"""A synthetic DataComp-schema pool at real string lengths, and the fetch stand-in that serves it.

Used by the scale benchmark (bench/build_scale.py) and the equal-results checks of the build: the pool is
generated columnar (no Python object per row) in files of ``file_rows`` rows, with what makes every stage
of the build work:

- URLs of ~140 bytes (the URL column passes 2 GiB at 16M rows) (``https://img<h>.cdn<k>.example.com/<path>/<image>/<variant>/<row>.jpg``) and
  captions of ~70 bytes; a sha256 string per row (not checked: the bench turns ``verify_sha256`` off);
- 0.5% of rows repeat an earlier row's uid (a quarter of them in another file), 0.5% repeat an earlier
  URL up to case in the host, 0.1% have an invalid uid, 0.1% a null URL, 0.1% an empty caption;
- 1% of rows show the picture of another row (an exact duplicate image), 0.5% a re-encode of another
  (a near duplicate), ``fail`` (3% by default) fail to download (a 404 by the stand-in, from the URL);
- CLIP scores, sizes and a face box on 10% of rows.

The stand-in (``standin_fetch``) answers every URL at memory speed with a deterministic small JPEG drawn
from the URL's image id (an 8×8 colour grid of 32×32 pixels, so pHashes are far apart) — the download
stays tested against real servers elsewhere; here it stands in for the web, not for the build.
``install_standin`` patches it into the download worker of the process it runs in (a Ray
``worker_process_setup_hook``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import schema as S

FILE_ROWS = 1_000_000
_PATH = "/photos/2024/collections/gallery-original-uploads/full-resolution-files"  # pads the URLs to DataComp's ~130 bytes
_WORDS = np.array(
    "a photo of the red blue green small large old new dog cat house tree car street city beach "
    "mountain river table chair woman man child flower garden kitchen window light night day".split()
)


def _hex(values: np.ndarray, width: int) -> pa.Array:
    """Lowercase hex of uint64 ``values``, zero-padded to ``width`` digits, as an Arrow string column."""
    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    out = np.empty((len(values), width), np.uint8)
    v = values.astype(np.uint64).copy()
    for k in range(width - 1, -1, -1):
        out[:, k] = digits[(v & np.uint64(15)).astype(np.int64)]
        v >>= np.uint64(4)
    return pa.array(out.view(f"S{width}").ravel()).cast(pa.string())


def _mix(i: np.ndarray, k: int) -> np.ndarray:
    """A 64-bit mix of row numbers (wrapping arithmetic): uids and hosts that look random."""
    with np.errstate(over="ignore"):
        return (i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(k)) * np.uint64(0xBF58476D1CE4E5B9)


def _unit(i: np.ndarray, k: int) -> np.ndarray:
    """A uniform draw in [0, 1) per row number: any row's draw can be recomputed from its number."""
    return (_mix(i, k) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _earlier(i: np.ndarray) -> np.ndarray:
    return np.maximum(i.astype(np.int64) - 1 - (_mix(i, 4) % np.uint64(5000)).astype(np.int64), 0).astype(
        np.uint64
    )


def _picture_of(row: np.ndarray, fail: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image id, variant, whether it fails) of row numbers: 1% show an earlier row's picture, 0.5% a
    re-encode of one (variant 1), a ``fail`` share are a 404."""
    r = _unit(row, 5)
    copy = r < 0.015
    image = np.where(copy, _earlier(row), row)
    return image, np.where((r >= 0.01) & copy, 1, 0), (r >= 0.015) & (r < 0.015 + fail)


def _join(*parts) -> pa.Array:
    return pc.binary_join_element_wise(*parts, "")


def pool_file(n: int, start: int, seed: int, fail: float = 0.03) -> pa.Table:
    """Rows ``start .. start+n`` of the pool of ``seed`` (each file generated on its own)."""
    rng = np.random.default_rng([seed, start])
    idx = np.arange(start, start + n, dtype=np.uint64)
    hi, lo = _mix(idx, 1), _mix(idx, 2)
    # A row repeating an earlier row's URL (up to the case of its host) carries that row's whole URL.
    dup_url = (_unit(idx, 3) < 0.005) & (idx > 0)
    url_row = np.where(dup_url, _earlier(idx), idx)
    image, variant, fail = _picture_of(url_row, fail)
    # A repeated uid: the previous row's or, a quarter of them, a row of an earlier file.
    back = np.where(rng.random(n) < 0.25, idx % np.uint64(max(start, 1)), idx - np.uint64(1))
    back = np.where((rng.random(n) < 0.005) & (idx > 0), back, idx)
    uid_hi, uid_lo = _mix(back, 1), _mix(back, 2)
    uids = _join(_hex(uid_hi, 16), _hex(uid_lo, 16))
    bad_uid = rng.random(n) < 0.001
    uids = pc.if_else(pa.array(bad_uid), _join(pa.array(["UID-"] * n), _hex(lo, 8)), uids)
    host = _join(pa.array(["https://img"] * n), _hex(url_row % np.uint64(4096), 3), pa.array([".cdn"] * n),
                 _hex(url_row % np.uint64(64), 2), pa.array([".example.com"] * n))  # fmt: skip
    host = pc.if_else(pa.array(dup_url & (rng.random(n) < 0.5)), pc.utf8_upper(host), host)
    tag = pa.array(np.where(fail, "/e404/", "/ok/"))
    urls = _join(host, pa.array([_PATH] * n), tag, _hex(image, 12), pa.array(["/"] * n),
                 pa.array(variant.astype(str)), pa.array(["/"] * n), _hex(url_row, 10), pa.array([".jpg"] * n))  # fmt: skip
    urls = pc.if_else(pa.array(rng.random(n) < 0.001), pa.scalar(None, pa.string()), urls)
    words = _WORDS[rng.integers(0, len(_WORDS), (n, 12))]
    text = pa.array([" ".join(w) for w in words.tolist()], pa.string())
    text = pc.if_else(pa.array(rng.random(n) < 0.001), pa.scalar("", pa.string()), text)
    has_box = rng.random(n) < 0.1
    offsets = np.concatenate([[0], np.cumsum(has_box)]).astype(np.int32)
    boxes = pa.ListArray.from_arrays(
        pa.array(np.arange(int(has_box.sum()) + 1, dtype=np.int32) * 4),
        pa.array(rng.random(4 * int(has_box.sum()))),
    )
    cols = {
        S.UID: uids,
        S.URL: urls,
        S.TEXT: text,
        S.ORIGINAL_WIDTH: rng.integers(64, 2000, n),
        S.ORIGINAL_HEIGHT: rng.integers(64, 2000, n),
        S.SHA256: _join(_hex(hi, 16), _hex(lo, 16), _hex(hi ^ lo, 16), _hex(idx, 16)),
        S.CLIP_B32: rng.normal(0.3, 0.05, n),
        S.CLIP_L14: rng.normal(0.25, 0.05, n),
        S.FACE_BBOXES: pa.ListArray.from_arrays(pa.array(offsets), boxes),
    }
    return pa.table(cols, schema=S.METADATA_SCHEMA)


def write_pool(
    folder: Path,
    n: int,
    seed: int = 0,
    file_rows: int = FILE_ROWS,
    row_group: int = 100_000,
    fail: float = 0.03,
) -> Path:
    """The pool of ``n`` rows as parquet files in ``folder`` (kept when a finished one is there)."""
    folder = Path(folder)
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f, start in enumerate(range(0, n, file_rows)):
        table = pool_file(min(file_rows, n - start), start, seed, fail)
        pq.write_table(table, folder / f"{f:05d}.parquet", row_group_size=row_group)
    (folder / "done").write_text("")
    return folder


# --- the fetch stand-in -------------------------------------------------------------------------------


def picture(image_id: int, variant: int) -> bytes:
    """The JPEG the stand-in serves for an image id: an 8×8 colour grid of 32×32 pixels; variant 1 is the
    same grid re-encoded at another quality (other bytes, nearly the same pHash)."""
    import simplejpeg

    rng = np.random.default_rng(image_id)
    grid = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    arr = np.ascontiguousarray(np.repeat(np.repeat(grid, 4, axis=0), 4, axis=1))
    return simplejpeg.encode_jpeg(arr, quality=90 if variant == 0 else 70, colorspace="RGB")


def standin_fetch(url: str, **_: object):
    """``pipeline.download.fetch.fetch`` for the synthetic pool: a 404 for ``/e404/`` URLs, else the
    picture named by the URL's image id and variant."""
    from pipeline.download.fetch import FetchResult

    parts = url.rsplit("/", 4)
    if parts[1] == "e404":
        return FetchResult(S.failed_download("http_404"), None, "HTTP 404", 404)
    return FetchResult(S.STATUS_SUCCESS, picture(int(parts[2], 16), int(parts[3])))


def install_standin() -> None:
    """Route the download worker's fetches to ``standin_fetch`` in this process."""
    import pipeline.download.worker as W

    W.fetch = standin_fetch


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
