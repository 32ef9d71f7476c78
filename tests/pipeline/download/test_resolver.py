"""The download actor's DNS cache: one lookup per name for every thread, "no such name" kept briefly, a
resolver that could not answer never kept, a bounded size; and a worker's rows to one host ask once."""

from __future__ import annotations

import io
import socket
import threading
import time

import numpy as np
import pyarrow as pa
from PIL import Image

from pipeline.config import DownloadConfig
from pipeline.download.resolver import CachingResolver
from pipeline.download.worker import DownloadWorker
from tests.fixtures.http_server import Route, http_server  # noqa: F401


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


JPEG = _jpeg()
ANSWER = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", 80))]


class FakeDns:
    """Counts questions; answers after ``delay`` s, or raises ``error``."""

    def __init__(self, delay: float = 0.0, error: socket.gaierror | None = None) -> None:
        self.asked: list[str] = []
        self.delay, self.error = delay, error

    def __call__(self, host, port, *args, **kwargs):
        self.asked.append(host)
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return ANSWER


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_answer_is_kept_for_its_ttl_and_names_are_case_insensitive() -> None:
    dns, clock = FakeDns(), Clock()
    r = CachingResolver(ttl_s=300, resolve=dns, clock=clock)
    assert r("Example.COM", 80, type=socket.SOCK_STREAM) == ANSWER
    assert r("example.com.", 80, type=socket.SOCK_STREAM) == ANSWER
    clock.now = 299
    r("example.com", 80, type=socket.SOCK_STREAM)
    assert dns.asked == ["Example.COM"] and r.hits == 2
    clock.now = 301
    r("example.com", 80, type=socket.SOCK_STREAM)
    r("example.com", 443, type=socket.SOCK_STREAM)  # another question: another lookup
    assert len(dns.asked) == 3


def test_threads_asking_for_one_name_share_one_lookup() -> None:
    dns = FakeDns(delay=0.2)
    r = CachingResolver(resolve=dns)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(r("a.example", 80))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert got == [ANSWER] * 16 and dns.asked == ["a.example"]


def test_no_such_name_is_kept_briefly_and_an_unanswered_lookup_never() -> None:
    clock = Clock()
    gone = FakeDns(error=socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    r = CachingResolver(negative_ttl_s=60, resolve=gone, clock=clock)
    for _ in range(3):
        try:
            r("gone.example", 80)
        except socket.gaierror as exc:
            assert exc.errno == socket.EAI_NONAME  # the guard's unknown_host, from the cache too
    assert len(gone.asked) == 1
    clock.now = 61
    try:
        r("gone.example", 80)
    except socket.gaierror:
        pass
    assert len(gone.asked) == 2
    busy = FakeDns(error=socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    r = CachingResolver(resolve=busy)
    for _ in range(3):
        try:
            r("busy.example", 80)
        except socket.gaierror as exc:
            assert exc.errno == socket.EAI_AGAIN
    assert len(busy.asked) == 3  # asked again every time: the next fetch may get an answer


def test_the_cache_is_bounded_least_recently_used_first() -> None:
    dns = FakeDns()
    r = CachingResolver(max_entries=2, resolve=dns)
    r("a", 80), r("b", 80), r("a", 80), r("c", 80)  # b is the least recently used when c comes in
    r("a", 80)
    r("b", 80)
    assert dns.asked == ["a", "b", "c", "b"]


def test_a_workers_rows_to_one_host_ask_the_resolver_once(http_server) -> None:
    url = http_server.route("/x.jpg", Route(body=JPEG))
    urls = [url.replace("127.0.0.1", "localhost") + f"?{i}" for i in range(24)]
    worker = DownloadWorker(DownloadConfig(allow_hosts=["localhost"], threads_per_actor=8))
    try:
        out = worker(pa.table({"uid": [f"{i:032x}" for i in range(24)], "url": urls}))
    finally:
        worker.close()
    assert out.column("status").to_pylist() == ["success"] * 24
    assert worker.resolver.lookups == 1 and worker.resolver.hits == 23
