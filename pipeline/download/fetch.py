"""Fetch one image URL with DataComp's semantics, safely; and the per-batch worker of the download stage.

``fetch`` is our replacement for img2dataset 1.47's ``downloader.download_image_with_retry``; the reasons
(no SSRF guard, no size bound, per-socket-op timeout only, retries on every error) are in
docs/download.md. Defaults come from ``DownloadConfig`` (DataComp's ``download_upstream.py`` calls
img2dataset with its defaults: timeout 10 s; we retry transient failures twice, img2dataset's default is 0).

Semantics:

- Every hop of a redirect chain (301/302/303/307/308, at most ``MAX_REDIRECTS``) passes the guard, and
  the connection goes to the address the guard resolved (no second DNS lookup: no rebinding window).
- ``timeout_s`` is a deadline for one attempt: connect, TLS, request, headers, every redirect hop and the
  whole body. Each socket operation gets the time left, so a server trickling bytes cannot stretch it.
- X-Robots-Tag opt-out exactly as img2dataset 1.47 with DataComp's settings: directives ``noai``,
  ``noimageai``, ``noindex``, ``noimageindex``; a ``token: directives`` value applies only when the token is
  our user-agent token, and DataComp set none, so only un-prefixed values count. ``none`` is not in the list.
- Body bounded: Content-Length above ``max_bytes`` is refused before reading; otherwise we read at most
  ``max_bytes + 1`` bytes. Fewer bytes than Content-Length, or a dropped connection, is ``truncated``.
- Retries only for transient failures: timeout, 429, 5xx, connection errors and truncation. Other 4xx,
  opt-out, blocked/invalid URLs and oversize bodies are final. Before a retry we wait ``Retry-After`` (on
  429/503, capped) or an exponential backoff with jitter (``pipeline/download/politeness.py``), never past the deadline.
- The X-Robots-Tag opt-out is decided on the headers: an opted-out body is never read.
- ``DownloadWorker``: a hard deadline per call (one part), a connection cap per host and a decode pixel
  budget shared by the actor's threads, so its memory is a function of the config (``memory_bound``).
"""

from __future__ import annotations

import hashlib
import http.client
import math
import socket
import ssl
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import pyarrow as pa

from pipeline import schema as S
from pipeline.config import DownloadConfig
from pipeline.download.netguard import GuardDecision, UrlGuard
from pipeline.download.pixel_budget import (
    MMAP_THRESHOLD,
    PixelBudget,
    release_free_memory,
    return_large_buffers_to_os,
)
from pipeline.download.politeness import HostSlots, parse_retry_after, retry_wait
from pipeline.download.resize import DECODE_BYTES_PER_PIXEL, STRIP_PIXELS, process_image

MAX_REDIRECTS = 5
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
# img2dataset 1.47 main.download's default ``disallowed_header_directives`` (DataComp passes none).
OPT_OUT_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "noimageindex"})
_CHUNK = 64 * 1024
RETRY_AFTER_CODES = frozenset({429, 503})
DEADLINE = S.failed_download("deadline")
DEADLINE_GRACE_S = 1.0  # rows still running this long after the part deadline are cut


@dataclass(frozen=True)
class FetchResult:
    status: str  # "success" or a schema status
    data: bytes | None = None
    error: str = ""
    http_status: int | None = None
    retry_after: float | None = None  # seconds a 429/503 asked us to wait


class _Transient(FetchResult):
    """Marker subclass: a failed attempt worth retrying."""


# --- sockets that enforce one deadline over many operations -------------------------------------------


class _DeadlineMixin:
    _deadline: float = math.inf

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        self.settimeout(left)  # type: ignore[attr-defined]

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().recv_into(*args, **kwargs)  # type: ignore[misc]

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return super().recv(*args, **kwargs)  # type: ignore[misc]

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()
        return super().sendall(*args, **kwargs)  # type: ignore[misc]


class _DeadlineSocket(_DeadlineMixin, socket.socket):
    pass


class _DeadlineSSLSocket(_DeadlineMixin, ssl.SSLSocket):
    pass


def tls_context(cadata: str | None = None) -> ssl.SSLContext:
    """Verifying client context (as urllib's, hence img2dataset's) whose sockets obey our deadline."""
    ctx = ssl.create_default_context(cadata=cadata)
    ctx.sslsocket_class = _DeadlineSSLSocket
    return ctx


_TLS = tls_context()  # tests swap in one that trusts their self-signed certificate


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) connection to pre-checked addresses; Host header, SNI and cert checks use the URL's host."""

    def __init__(self, decision: GuardDecision, deadline: float, tls: ssl.SSLContext | None) -> None:
        super().__init__(decision.host, decision.port)
        self._addresses = decision.addresses
        self._deadline = deadline
        self._tls = tls

    def connect(self) -> None:
        last: OSError = OSError("no address to connect to")
        for family, sockaddr in self._addresses:
            sock = _DeadlineSocket(family, socket.SOCK_STREAM)
            sock._deadline = self._deadline
            try:
                sock._arm()
                sock.connect(sockaddr)
                break
            except OSError as exc:
                sock.close()
                last = exc
        else:
            raise last
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self.host, do_handshake_on_connect=False)
            sock._deadline = self._deadline
            sock._arm()
            sock.do_handshake()
        self.sock = sock


# --- fetch ----------------------------------------------------------------------------------------------


def is_opted_out(values: list[str], user_agent_token: str | None = None) -> bool:
    """img2dataset's X-Robots-Tag rule: any listed directive in a value that applies to us."""
    for value in values:
        token, sep, rest = value.partition(":")
        directives = rest if sep else value
        applies = not sep or (user_agent_token is not None and token.strip().lower() == user_agent_token)
        if applies and any(d.strip().lower() in OPT_OUT_DIRECTIVES for d in directives.split(",")):
            return True
    return False


def _read_body(resp: http.client.HTTPResponse, max_bytes: int) -> FetchResult:
    code = resp.status
    if resp.length is not None and resp.length > max_bytes:
        return FetchResult(S.failed_download("too_large"), None, f"Content-Length {resp.length}", code)
    declared = resp.length
    buf = bytearray()
    try:
        while True:
            # read1: at most one recv per call, so the per-op deadline bounds a trickling server.
            chunk = resp.read1(min(_CHUNK, max_bytes + 1 - len(buf)))
            if not chunk:
                break
            buf += chunk
            if len(buf) > max_bytes:
                return FetchResult(S.failed_download("too_large"), None, f"body > {max_bytes} bytes", code)
    except TimeoutError:
        return _Transient(S.failed_download("timeout"), None, "timed out reading body", code)
    except (http.client.IncompleteRead, OSError, http.client.HTTPException) as exc:
        return _Transient(S.failed_download("truncated"), None, f"body read failed: {exc!r}", code)
    if declared is not None and len(buf) < declared:
        return _Transient(S.failed_download("truncated"), None, f"got {len(buf)} of {declared} bytes", code)
    return FetchResult(S.STATUS_SUCCESS, bytes(buf), "", code)


def _attempt(url: str, deadline: float, max_bytes: int, guard: UrlGuard, headers: dict[str, str],
             honor_robots: bool) -> FetchResult:  # fmt: skip
    timeout_s = round(deadline - time.monotonic(), 3)
    for _hop in range(MAX_REDIRECTS + 1):
        decision = guard.resolve(url)
        if decision.status is not None:
            cls = _Transient if decision.transient else FetchResult
            return cls(decision.status, None, decision.error)
        tls = _TLS if decision.scheme == "https" else None
        conn = _PinnedConnection(decision, deadline, tls)
        try:
            try:
                conn.request("GET", decision.target, headers=headers)
                resp = conn.getresponse()
            except TimeoutError:
                return _Transient(S.failed_download("timeout"), None, f"timed out ({timeout_s} s)")
            except ssl.SSLCertVerificationError as exc:
                return FetchResult(S.failed_download("connection_error"), None, f"TLS: {exc}")
            except (OSError, http.client.HTTPException, UnicodeError, ValueError) as exc:
                return _Transient(S.failed_download("connection_error"), None, repr(exc))
            code = resp.status
            if code in REDIRECT_CODES and resp.getheader("Location"):
                url = urljoin(url, resp.getheader("Location", "").strip())
                continue
            if not 200 <= code < 300:
                cls = _Transient if S.is_transient(S.failed_download(f"http_{code}")) else FetchResult
                wait = parse_retry_after(resp.getheader("Retry-After")) if code in RETRY_AFTER_CODES else None
                return cls(S.failed_download(f"http_{code}"), None, resp.reason or "", code, wait)
            # Decided on the headers alone: the body of an opted-out image is never read (the close drops it).
            if honor_robots and is_opted_out(resp.headers.get_all("X-Robots-Tag") or []):
                return FetchResult(S.STATUS_OPTED_OUT, None, "X-Robots-Tag opt-out", code)
            return _read_body(resp, max_bytes)
        finally:
            conn.close()
    return FetchResult(S.failed_download(f"http_{code}"), None, f"more than {MAX_REDIRECTS} redirects", code)


def fetch(
    url: str,
    *,
    timeout_s: float,
    retries: int,
    max_bytes: int,
    guard: UrlGuard,
    user_agent: str,
    honor_robots: bool,
    deadline: float = math.inf,
    hosts: HostSlots | None = None,
    backoff_s: float = 0.0,
    retry_after_max_s: float = 0.0,
) -> FetchResult:
    """Download ``url``; never raises for network or server misbehaviour (those become statuses).

    ``deadline`` (``time.monotonic()``) bounds everything, retries and waits included: reaching it gives
    ``failed_to_download:deadline``. ``hosts`` caps concurrent connections per host (a slot is held for
    one attempt, not while waiting to retry).
    """
    # http.client adds "Accept-Encoding: identity": the bytes we hash are the bytes the sha256 was taken on.
    headers = {"User-Agent": user_agent, "Accept": "image/*,*/*;q=0.8", "Connection": "close"}
    result = FetchResult(S.failed_download("connection_error"), None, "not attempted")
    for attempt in range(max(0, retries) + 1):
        if attempt:
            wait = retry_wait(attempt - 1, result.retry_after, backoff_s, retry_after_max_s)
            if wait is None or time.monotonic() + wait >= deadline:
                break  # not allowed, or no time left, for another attempt: keep the last failure
            time.sleep(wait)
        try:
            with hosts.hold(url, deadline) if hosts else nullcontext():
                result = _attempt(url, min(deadline, time.monotonic() + timeout_s), max_bytes, guard, headers,
                                  honor_robots)  # fmt: skip
        except TimeoutError as exc:
            return FetchResult(DEADLINE, None, str(exc))
        if not isinstance(result, _Transient):
            return result
        if time.monotonic() >= deadline:
            return FetchResult(DEADLINE, None, f"part deadline reached ({result.status}: {result.error})")
    return FetchResult(result.status, result.data, result.error, result.http_status)


# --- the per-batch worker of a download actor ------------------------------------------------------------

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


def part_deadline_s(cfg: DownloadConfig) -> float:
    """The hard time limit of one ``DownloadWorker`` call: ``cfg.part_deadline_s``, or when 0,
    ten rows each exhausting every attempt one after another: 10 · (retries + 1) · timeout_s."""
    return cfg.part_deadline_s or 10 * (cfg.retries + 1) * cfg.timeout_s


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
    body = int(2.25 * (cfg.max_bytes + _CHUNK))
    return DECODE_BYTES_PER_PIXEL * pixels + cfg.threads_per_actor * (body + THREAD_OVERHEAD_BYTES)


class DownloadWorker:
    """Callable over a batch of metadata rows → one output row per input row, same order.

    Built once per download actor: the guard, a bounded thread pool (``threads_per_actor``, the
    counterpart of img2dataset's ``thread_count``), the per-host connection slots and the decode pixel
    budget its threads share. Each thread runs fetch → sha256 → decode/resize/blur. A call ends by its
    deadline (``part_deadline_s``): rows still running then get ``failed_to_download:deadline``.
    """

    def __init__(self, cfg: DownloadConfig) -> None:
        import cv2

        cv2.setNumThreads(1)  # parallelism comes from threads and actors, not from OpenCV's own pool
        return_large_buffers_to_os()  # idle size stays flat between large images (pipeline/download/pixel_budget.py)
        self.cfg = cfg
        self.guard = UrlGuard(cfg.allow_hosts)
        self.pool = ThreadPoolExecutor(cfg.threads_per_actor, thread_name_prefix="download")
        self.hosts = HostSlots(cfg.per_host_connections)
        self.budget = PixelBudget(cfg.decode_pixel_budget)

    def __call__(self, rows: pa.Table | Mapping[str, Any]) -> pa.Table:
        n = rows.num_rows if isinstance(rows, pa.Table) else len(_column(rows, S.UID, 0))
        uids = _column(rows, S.UID, n)
        urls = _column(rows, S.URL, n)
        hashes = _column(rows, S.SHA256, n)
        bboxes = _column(rows, S.FACE_BBOXES, n)
        limit = part_deadline_s(self.cfg)
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
        if time.monotonic() >= deadline:
            return {**row, S.STATUS: DEADLINE, "error": "part deadline passed before the row started"}
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
