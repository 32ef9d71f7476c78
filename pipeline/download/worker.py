"""The per-batch worker of a download actor: fetch → sha256 → decode/resize/blur, one output row per input.

``DownloadWorker`` runs a part's rows on a bounded thread pool with a deadline per row, counted from when a
thread starts it (``row_deadline_s``), and a backstop per call (one part) that grows with its rows
(``part_deadline_s``); a connection cap per host, a decode pixel budget and a DNS cache shared by the
actor's threads, so its memory is a function of the config (``memory_bound``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import pyarrow as pa

from pipeline import schema as S
from pipeline.common.process_memory import release_free_memory
from pipeline.config import DownloadConfig
from pipeline.download.fetch import CHUNK, DEADLINE, DEADLINE_GRACE_S, fetch
from pipeline.download.netguard import UrlGuard
from pipeline.download.pixel_budget import MMAP_THRESHOLD, PixelBudget, return_large_buffers_to_os
from pipeline.download.politeness import HostSlots
from pipeline.download.resize import DECODE_BYTES_PER_PIXEL, STRIP_PIXELS, process_image
from pipeline.download.resolver import CachingResolver

# --- ------------------------------------------------------------

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field(S.UID, pa.string()),
        pa.field(S.STATUS, pa.string()),
        pa.field("error", pa.string()),
        pa.field(S.IMAGE, pa.binary()),
        pa.field(S.WIDTH, pa.int64()),
        pa.field(S.HEIGHT, pa.int64()),
        pa.field(S.ORIGINAL_WIDTH, pa.int64()),
        pa.field(S.ORIGINAL_HEIGHT, pa.int64()),
        pa.field(S.IMAGE_SHA256, pa.string()),
        pa.field(S.PHASH, pa.int64()),
    ]
)


def _column(rows: pa.Table | Mapping[str, Any], name: str, n: int) -> list[Any]:
    if isinstance(rows, pa.Table):
        return rows.column(name).to_pylist() if name in rows.column_names else [None] * n
    if name not in rows:
        return [None] * n
    col = rows[name]
    return col.to_pylist() if hasattr(col, "to_pylist") else list(col)


def row_deadline_s(cfg: DownloadConfig) -> float:
    """How long one row may take from when a thread starts it: every attempt at its full timeout, every
    retry wait at its longest and one timeout more for host-slot waits and the decode:
    (retries + 1) · timeout_s + retries · retry_after_max_s + timeout_s (100 s with the defaults). A row
    whose fetches each end within their timeout never reaches it (docs/download.md, "Deadlines")."""
    return (cfg.retries + 2) * cfg.timeout_s + cfg.retries * cfg.retry_after_max_s


def part_deadline_s(cfg: DownloadConfig, rows: int) -> float:
    """The backstop of one ``DownloadWorker`` call of ``rows`` rows: ``cfg.part_deadline_s``, or when 0,
    what the rows can take on ``threads_per_actor`` threads when each takes its whole row deadline:
    (⌈rows / threads⌉ + 1) · ``row_deadline_s`` (greedy scheduling ends within one row of the even share),
    so it follows the part's size and never cuts rows that keep to their own deadlines."""
    if cfg.part_deadline_s:
        return cfg.part_deadline_s
    return (math.ceil(rows / cfg.threads_per_actor) + 1) * row_deadline_s(cfg)


# Strip temporaries, output-size copies, stack, and the freed buffers below the mmap threshold that a
# thread's heap keeps for its next image (pipeline/download/pixel_budget.py).
THREAD_OVERHEAD_BYTES = 40 * STRIP_PIXELS + 32 * 1024 * 1024 + MMAP_THRESHOLD


def memory_bound(cfg: DownloadConfig) -> int:
    """Bytes one actor's images in flight may hold above its idle resident size (docs/download.md).

    Decoded pixels: the budget, or a single larger image decoded alone (≤ max_pixels), at
    ``DECODE_BYTES_PER_PIXEL`` each; per thread: a body being read (≤ max_bytes, grown by bytearray's
    1/8 over-allocation) and its bytes copy, freed buffers its heap keeps for reuse (< ``MMAP_THRESHOLD``),
    plus a constant. The part's output JPEGs are not counted.
    """
    pixels = max(cfg.decode_pixel_budget, cfg.max_pixels)
    body = int(2.25 * (cfg.max_bytes + CHUNK))
    return DECODE_BYTES_PER_PIXEL * pixels + cfg.threads_per_actor * (body + THREAD_OVERHEAD_BYTES)


class DownloadWorker:
    """Callable over a batch of metadata rows → one output row per input row, same order.

    Built once per download actor: the guard, a bounded thread pool (``threads_per_actor``, the
    counterpart of img2dataset's ``thread_count``), the per-host connection slots and the decode pixel
    budget and DNS cache its threads share. Each thread runs fetch → sha256 → decode/resize/blur within
    the row's deadline (``row_deadline_s``, from when the thread starts it); a call ends by its backstop
    (``part_deadline_s``): rows still running or waiting then get ``failed_to_download:deadline``.
    """

    def __init__(self, cfg: DownloadConfig) -> None:
        import cv2

        cv2.setNumThreads(1)  # parallelism comes from threads and actors, not from OpenCV's own pool
        return_large_buffers_to_os()  # idle size stays flat between large images (pipeline/download/pixel_budget.py)
        self.cfg = cfg
        self.resolver = CachingResolver()  # one lookup per host name for the actor's threads
        self.guard = UrlGuard(cfg.allow_hosts, resolver=self.resolver)
        self.pool = ThreadPoolExecutor(cfg.threads_per_actor, thread_name_prefix="download")
        self.hosts = HostSlots(cfg.per_host_connections)
        self.budget = PixelBudget(cfg.decode_pixel_budget)

    def __call__(self, rows: pa.Table | Mapping[str, Any]) -> pa.Table:
        n = rows.num_rows if isinstance(rows, pa.Table) else len(_column(rows, S.UID, 0))
        uids = _column(rows, S.UID, n)
        urls = _column(rows, S.URL, n)
        hashes = _column(rows, S.SHA256, n)
        bboxes = _column(rows, S.FACE_BBOXES, n)
        limit = part_deadline_s(self.cfg, n)
        deadline = time.monotonic() + limit
        futures = [
            self.pool.submit(self._one, *row, deadline)
            for row in zip(uids, urls, hashes, bboxes, strict=True)
        ]
        # Every socket operation, retry wait, slot wait and budget wait ends by the deadline; the grace
        # lets rows that hit it report their own status. What is still running after that is cut here.
        wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S)
        out = []
        for uid, fut in zip(uids, futures, strict=True):
            if fut.done() and not fut.cancelled():
                out.append(fut.result())
            else:
                fut.cancel()
                out.append({S.UID: uid, S.STATUS: DEADLINE, "error": f"part deadline of {limit:g} s passed"})
        table = pa.Table.from_pylist(out, schema=OUTPUT_SCHEMA)
        release_free_memory()  # what the threads freed goes back to the OS between parts
        return table

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _one(
        self, uid: str, url: str, expected_sha: str | None, bboxes: Any, deadline: float
    ) -> dict[str, Any]:
        row: dict[str, Any] = {S.UID: uid}
        now = time.monotonic()
        if now >= deadline:
            return {**row, S.STATUS: DEADLINE, "error": "part deadline passed before the row started"}
        deadline = min(deadline, now + row_deadline_s(self.cfg))  # the row's own clock starts here
        try:
            row.update(self._process(url, expected_sha, bboxes, deadline))
        except Exception as exc:  # a bad row must never fail the batch
            row.update({S.STATUS: S.failed_resize("corrupt"), "error": f"unexpected: {exc!r}", S.IMAGE: None})
        return row

    def _process(self, url: str, expected_sha: str | None, bboxes: Any, deadline: float) -> dict[str, Any]:
        cfg = self.cfg
        res = fetch(
            url,
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            max_bytes=cfg.max_bytes,
            guard=self.guard,
            user_agent=cfg.user_agent,
            honor_robots=cfg.honor_robots,
            deadline=deadline,
            hosts=self.hosts,
            backoff_s=cfg.retry_backoff_s,
            retry_after_max_s=cfg.retry_after_max_s,
        )
        if res.status != S.STATUS_SUCCESS or res.data is None:
            return {S.STATUS: res.status, "error": res.error}
        digest = hashlib.sha256(res.data).hexdigest()
        if cfg.verify_sha256 and expected_sha and expected_sha.strip().lower() != digest:
            return {S.STATUS: S.STATUS_HASH_MISMATCH, "error": f"sha256 {digest}", S.IMAGE_SHA256: digest}
        img = process_image(
            res.data,
            image_size=cfg.image_size,
            jpeg_quality=cfg.jpeg_quality,
            max_pixels=cfg.max_pixels,
            face_bboxes=bboxes,
            blur_faces=cfg.blur_faces,
            budget=self.budget,
            deadline=deadline,
            dct_margin=cfg.jpeg_dct_margin,
        )
        return {
            S.STATUS: img.status,
            "error": img.error,
            S.IMAGE: img.jpg,
            S.WIDTH: img.width,
            S.HEIGHT: img.height,
            S.ORIGINAL_WIDTH: img.original_width,
            S.ORIGINAL_HEIGHT: img.original_height,
            S.IMAGE_SHA256: digest,
            S.PHASH: img.phash,
        }
