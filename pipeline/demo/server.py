"""A threaded HTTP server on 127.0.0.1 that serves a generated demo pool and injects its faults.

``routes.json`` (written by pipeline/demo/pool.py) maps each URL path to a body file and a fault kind; the
server obeys it, so a given URL always fails the same way:

==========  ==========================================================================================
ok          200, the file, its content type (JPEG, or the HTML page / corrupt JPEG / PNG bomb bodies)
http_404    404 (also any unknown path)
http_500    500
slow        waits ``slow_s`` seconds (default 3 s, above the demo client's 1 s timeout), then the file
truncated   Content-Length of the whole file, only the first half of it sent, connection closed
oversize    the JPEG padded with zeros to ``pad_to`` bytes (3 MiB; the demo build caps at 2 MiB)
opted_out   200, the picture, with ``X-Robots-Tag: noai`` or ``noimageai``
==========  ==========================================================================================

One thread per connection (``ThreadingHTTPServer``, daemon threads), HTTP/1.0 (one request per
connection), a deep listen backlog for bursts of concurrent fetches, and no request logging.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

_QUIET_ERRORS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, socket.timeout, TimeoutError)


class _PoolHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a sleeping "slow" handler never holds up shutdown
    request_queue_size = 256
    allow_reuse_address = True

    def __init__(self, addr, pool_dir: Path, routes: dict, slow_s: float):
        self.pool_dir, self.routes, self.slow_s = pool_dir, routes, slow_s
        self.stopping = threading.Event()
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()
        super().__init__(addr, _Handler)

    def body(self, rel: str) -> bytes:
        data = self._cache.get(rel)
        if data is None:
            data = (self.pool_dir / rel).read_bytes()
            if len(data) <= 1 << 20:  # bodies are small except the bomb; keep them in memory
                with self._lock:
                    self._cache[rel] = data
        return data

    def handle_error(self, request, client_address) -> None:
        import sys

        exc = sys.exc_info()[1]
        if not isinstance(exc, _QUIET_ERRORS):  # clients hanging up on slow/truncated routes are expected
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _PoolHTTPServer
    protocol_version = "HTTP/1.0"
    server_version = "demo-pool/1"

    def log_message(self, format, *args) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        pass

    def _status(self, code: int) -> None:
        body = f"{code}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        route = self.server.routes.get(urlsplit(self.path).path)
        kind = route["fault"] if route else "http_404"
        if kind.startswith("http_"):
            return self._status(int(kind[5:]))
        if kind == "slow" and self.server.stopping.wait(self.server.slow_s):
            return  # shutting down: drop the connection
        data = self.server.body(route["file"])
        length = len(data)
        if kind == "oversize":
            length = max(length, int(route["pad_to"]))
        self.send_response(200)
        self.send_header("Content-Type", route.get("type", "image/jpeg"))
        self.send_header("Content-Length", str(length))
        if kind == "opted_out":
            self.send_header("X-Robots-Tag", route["robots"])
        self.end_headers()
        if self.command == "HEAD":
            return
        if kind == "truncated":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)
        if length > len(data):
            pad = b"\x00" * 65536
            for start in range(len(data), length, len(pad)):
                self.wfile.write(pad[: min(len(pad), length - start)])


class DemoServer:
    """A running pool server; ``stop()`` (or leaving the ``with`` block) shuts it down."""

    def __init__(self, httpd: _PoolHTTPServer):
        self._httpd = httpd
        self.host, self.port = httpd.server_address[:2]
        self.base_url = f"http://{self.host}:{self.port}"
        self.pool_dir = str(httpd.pool_dir)
        self.slow_s = httpd.slow_s
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="demo-pool-server", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._httpd.stopping.set()  # releases handlers sleeping on "slow" routes
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> DemoServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_pool(
    pool_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0, slow_s: float = 3.0
) -> DemoServer:
    """Serve ``pool_dir`` (a generated demo pool) on ``host:port`` (0 = any free port) in a background thread."""
    pool = Path(pool_dir)
    routes = json.loads((pool / "routes.json").read_text())
    return DemoServer(_PoolHTTPServer((host, port), pool, routes, slow_s))
