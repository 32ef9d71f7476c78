"""A tiny configurable HTTP server on 127.0.0.1 for download tests.

Routes are set per test (``server.route("/x.jpg", Route(body=...))``); each route can misbehave the way
web servers do: fail the first N hits, sleep before answering, trickle the body, declare more bytes than
it sends, redirect. ``server.hits[path]`` counts requests so tests can assert retries (or their absence), and
``server.answered[path]`` counts responses sent to the last byte, so a timeout test can assert the client
gave up before the server finished instead of timing the client. ``body_sent[path]`` counts body bytes
written to the socket, ``hit_times[path]`` the arrival time of each request and ``max_in_flight`` the most
requests answered at once (for the per-host cap).
The server runs in a thread of the test process and is shut down by the fixture.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "image/jpeg"
    fail_first: int = 0  # answer ``fail_status`` to the first N hits
    fail_status: int = 500
    fail_headers: dict[str, str] = field(default_factory=dict)  # sent with the failing answers only
    delay_s: float = 0.0  # wait before the status line (cut short when the server stops)
    trickle_s: float = 0.0  # wait between body bytes, after sending the headers (cut short likewise)
    declared_length: int | None = None  # Content-Length to announce (default: len(body))
    send_length: bool = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        with self.server.lock:
            self.server.hits[path] += 1
            hit = self.server.hits[path]
            self.server.hit_times.setdefault(path, []).append(time.monotonic())
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
            self.server.user_agents.append(self.headers.get("User-Agent", ""))
            self.server.host_headers.append(self.headers.get("Host", ""))
        route = self.server.routes.get(path)
        if route is None:
            route = Route(status=404, body=b"not found", content_type="text/plain")
        try:
            finished = self._answer(route, hit, path)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client gave up (timeout tests): expected
        finally:
            with self.server.lock:
                self.server.in_flight -= 1
        if finished:
            with self.server.lock:
                self.server.answered[path] += 1

    def _send_body(self, body: bytes, path: str, trickle_s: float) -> bool:
        step = 1 if trickle_s else 64 * 1024
        for i in range(0, len(body), step):
            self.wfile.write(body[i : i + step])
            self.wfile.flush()
            with self.server.lock:
                self.server.body_sent[path] += len(body[i : i + step])
            if trickle_s and self.server.stopping.wait(trickle_s):
                return False
        return True

    def _answer(self, route: Route, hit: int, path: str) -> bool:
        """Send the response; False when the fixture's shutdown cut it short."""
        if route.delay_s and self.server.stopping.wait(route.delay_s):
            return False  # the fixture is shutting down: never answer
        status, body, headers = route.status, route.body, route.headers
        if hit <= route.fail_first:
            status, body, headers = route.fail_status, b"transient failure", route.fail_headers
        self.send_response(status)
        self.send_header("Content-Type", route.content_type)
        if route.send_length:
            declared = route.declared_length if route.declared_length is not None else len(body)
            self.send_header("Content-Length", str(declared))
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Connection", "close")
        self.end_headers()
        if not self._send_body(body, path, route.trickle_s):
            return False
        self.wfile.flush()
        self.close_connection = True
        return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes: dict[str, Route] = {}
        self.hits: Counter[str] = Counter()
        self.answered: Counter[str] = Counter()
        self.body_sent: Counter[str] = Counter()
        self.hit_times: dict[str, list[float]] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.stopping = threading.Event()
        self.user_agents: list[str] = []
        self.host_headers: list[str] = []
        self.lock = threading.Lock()


class HttpTestServer:
    """Handle given to tests: add routes, build URLs, read hit counts."""

    def __init__(self, server: _Server, scheme: str = "http", cadata: str = "") -> None:
        self._server = server
        self.port = server.server_address[1]
        self.scheme = scheme
        self.cadata = cadata  # PEM of the self-signed certificate (https only)

    @property
    def hits(self) -> Counter[str]:
        return self._server.hits

    @property
    def answered(self) -> Counter[str]:
        return self._server.answered

    @property
    def body_sent(self) -> Counter[str]:
        return self._server.body_sent

    @property
    def hit_times(self) -> dict[str, list[float]]:
        return self._server.hit_times

    @property
    def max_in_flight(self) -> int:
        return self._server.max_in_flight

    @property
    def user_agents(self) -> list[str]:
        return self._server.user_agents

    @property
    def host_headers(self) -> list[str]:
        return self._server.host_headers

    def route(self, path: str, route: Route) -> str:
        self._server.routes[path] = route
        return self.url(path)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"


def _serve(server: _Server) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


def _stop(server: _Server, thread: threading.Thread) -> None:
    server.stopping.set()  # release handlers still waiting out a delay or a trickle
    server.shutdown()
    server.server_close()
    thread.join(timeout=2)


@pytest.fixture
def http_server() -> Iterator[HttpTestServer]:
    server = _Server()
    thread = _serve(server)
    try:
        yield HttpTestServer(server)
    finally:
        _stop(server, thread)


def _self_signed_for_127_0_0_1() -> tuple[bytes, bytes]:
    """(cert PEM, key PEM) valid for IP 127.0.0.1 only, made with ``cryptography`` if installed."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prolip test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture
def https_server(tmp_path) -> Iterator[HttpTestServer]:
    """Same server behind TLS with a throwaway self-signed certificate for 127.0.0.1."""
    cert_pem, key_pem = _self_signed_for_127_0_0_1()
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = _Server()
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = _serve(server)
    try:
        yield HttpTestServer(server, scheme="https", cadata=cert_pem.decode())
    finally:
        _stop(server, thread)


@pytest.fixture
def canary_listener() -> Iterator[tuple[str, socket.socket]]:
    """A listening socket on 127.0.0.2 that a guarded client must never connect to."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.2", 0))
    sock.listen(4)
    sock.setblocking(False)
    try:
        yield f"http://127.0.0.2:{sock.getsockname()[1]}", sock
    finally:
        sock.close()


def was_contacted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True
