"""Fetch one image URL with DataComp's semantics, safely (the per-batch worker is pipeline/download/worker.py).

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
"""

from __future__ import annotations

import http.client
import math
import socket
import ssl
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

from pipeline import schema as S
from pipeline.download.netguard import GuardDecision, UrlGuard
from pipeline.download.politeness import HostSlots, parse_retry_after, retry_wait

MAX_REDIRECTS = 5
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
# img2dataset 1.47 main.download's default ``disallowed_header_directives`` (DataComp passes none).
OPT_OUT_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "noimageindex"})
CHUNK = 64 * 1024
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
            chunk = resp.read1(min(CHUNK, max_bytes + 1 - len(buf)))
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


def _attempt(url: str, deadline: float, timeout_s: float, max_bytes: int, guard: UrlGuard,
             headers: dict[str, str], honor_robots: bool, hosts: HostSlots | None) -> FetchResult:  # fmt: skip
    """One attempt: every redirect hop checked by the guard and holding its server's slots.

    The first hop may wait for its slots until ``deadline`` (the part's: ``TimeoutError``); the attempt's
    ``timeout_s`` starts once it holds them and covers every later hop, slot waits included."""
    ends: float | None = None  # the attempt's own deadline, set when the first hop holds its slots
    code = 0
    for _hop in range(MAX_REDIRECTS + 1):
        decision = guard.resolve(url)
        if decision.status is not None:
            cls = _Transient if decision.transient else FetchResult
            return cls(decision.status, None, decision.error)
        # The slots are the server's: its name and the address the connection goes to first.
        keys = [HostSlots.key(url), HostSlots.address_key(str(decision.addresses[0][1][0]))]
        slots = hosts.hold(keys, deadline if ends is None else ends) if hosts else nullcontext()
        try:
            slots.__enter__()
        except TimeoutError:
            if ends is None:
                raise
            return _Transient(S.failed_download("timeout"), None, f"no slot for {decision.host} in time")
        try:
            ends = min(deadline, time.monotonic() + timeout_s) if ends is None else ends
            result = _request(decision, ends, max_bytes, headers, honor_robots)
        finally:
            slots.__exit__(None, None, None)
        if isinstance(result, FetchResult):
            return result
        url, code = urljoin(url, result[0]), result[1]
    return FetchResult(S.failed_download(f"http_{code}"), None, f"more than {MAX_REDIRECTS} redirects", code)


def _request(decision: GuardDecision, deadline: float, max_bytes: int, headers: dict[str, str],
             honor_robots: bool) -> FetchResult | tuple[str, int]:  # fmt: skip
    """GET on the checked addresses: the result, or (Location, code) of a redirect to follow."""
    timeout_s = round(deadline - time.monotonic(), 3)
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
            return resp.getheader("Location", "").strip(), code
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

    ``deadline`` (``time.monotonic()``; the row's, pipeline/download/worker.py) bounds everything, retries
    and waits included: reaching it gives ``failed_to_download:deadline``. ``hosts`` caps concurrent connections per server (its name and its
    resolved address: a slot is held for one hop of one attempt, not while waiting to retry).
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
            result = _attempt(url, deadline, timeout_s, max_bytes, guard, headers, honor_robots, hosts)
        except TimeoutError as exc:
            return FetchResult(DEADLINE, None, str(exc))
        if not isinstance(result, _Transient):
            return result
        if time.monotonic() >= deadline:
            return FetchResult(DEADLINE, None, f"deadline reached ({result.status}: {result.error})")
    return FetchResult(result.status, result.data, result.error, result.http_status)
