"""The download stage's limits against a real HTTP server on 127.0.0.1: the part deadline, the per-host
connection cap, Retry-After and backoff on 429/503, and an opted-out body never read."""
# ruff: noqa: F811
# (pytest fixtures imported from tests/fixtures/http_server.py are re-bound as test arguments)

from __future__ import annotations

import email.utils
import io
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pipeline.common.config import ConfigError
from pipeline.config import DownloadConfig
from pipeline.download.fetch import fetch
from pipeline.download.netguard import UrlGuard
from pipeline.download.politeness import HostSlots, parse_retry_after, retry_wait
from pipeline.download.worker import DownloadWorker, memory_bound, part_deadline_s
from tests.fixtures.http_server import Route, http_server  # noqa: F401

GUARD = UrlGuard(["127.0.0.1"])


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 60, 3), (10, 120, 200), np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


JPEG = _jpeg()


def _fetch(url: str, **kw):
    args = dict(
        timeout_s=2.0, retries=1, max_bytes=128 << 20, guard=GUARD, user_agent="t/1", honor_robots=True
    )
    args.update(kw)
    return fetch(url, **args)


def _run(cfg: DownloadConfig, urls: list[str]) -> list[str]:
    worker = DownloadWorker(cfg)
    try:
        out = worker(pa.table({"uid": [f"{i:032x}" for i in range(len(urls))], "url": urls}))
    finally:
        worker.close()
    return out.column("status").to_pylist()


# --- opt-out decided on the headers ------------------------------------------------------------------------


def _settled(server, path: str) -> int:
    """body_sent once the handler has stopped writing (it ends on a broken pipe after our close)."""
    last = -1
    while server.body_sent[path] != last:
        last = server.body_sent[path]
        time.sleep(0.2)
    return last


def test_opted_out_huge_body_is_not_read(http_server) -> None:
    body = b"\xff\xd8\xff" + bytes(64 << 20)
    hdr = {"X-Robots-Tag": "noai"}
    assert _fetch(http_server.route("/opt.jpg", Route(body=body, headers=hdr))).status == "opted_out"
    # Only what the kernel buffers took before our close: a small part of the 64 MiB, never all of it.
    assert _settled(http_server, "/opt.jpg") < 16 << 20 and http_server.answered["/opt.jpg"] == 0
    # Control: the same body without the header is read to the end (the counter counts).
    assert _fetch(http_server.route("/in.jpg", Route(body=body))).status == "success"
    assert http_server.body_sent["/in.jpg"] == len(body)


def test_opted_out_trickled_body_returns_after_the_headers(http_server) -> None:
    url = http_server.route("/t.jpg", Route(body=JPEG, headers={"X-Robots-Tag": "noimageai"}, trickle_s=0.2))
    assert _fetch(url).status == "opted_out"
    assert http_server.body_sent["/t.jpg"] <= 1  # returned before the server's second body byte


# --- Retry-After and backoff ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [429, 503])
def test_retry_after_seconds_is_waited_out(http_server, code) -> None:
    url = http_server.route("/r.jpg", Route(body=JPEG, fail_first=1, fail_status=code,
                                            fail_headers={"Retry-After": "1"}))  # fmt: skip
    res = _fetch(url, retry_after_max_s=5.0)
    assert res.status == "success" and http_server.hits["/r.jpg"] == 2
    first, second = http_server.hit_times["/r.jpg"]
    assert second - first >= 1.0  # the server's request is honoured, not just retried


def test_retry_after_http_date_is_waited_out(http_server) -> None:
    when = email.utils.formatdate(time.time() + 2, usegmt=True)  # whole seconds: at least 1 s away
    url = http_server.route("/d.jpg", Route(body=JPEG, fail_first=1, fail_status=503,
                                            fail_headers={"Retry-After": when}))  # fmt: skip
    assert _fetch(url, retry_after_max_s=5.0).status == "success"
    first, second = http_server.hit_times["/d.jpg"]
    assert second - first >= 0.9


def test_retry_after_beyond_cap_or_deadline_is_not_retried_early(http_server) -> None:
    url = http_server.route("/c.jpg", Route(body=JPEG, fail_first=9, fail_status=429,
                                            fail_headers={"Retry-After": "60"}))  # fmt: skip
    assert _fetch(url, retries=3, retry_after_max_s=5.0).status == "failed_to_download:http_429"
    assert http_server.hits["/c.jpg"] == 1
    url = http_server.route("/e.jpg", Route(body=JPEG, fail_first=9, fail_status=503,
                                            fail_headers={"Retry-After": "3"}))  # fmt: skip
    res = _fetch(url, retries=3, retry_after_max_s=5.0, deadline=time.monotonic() + 1.0)
    assert res.status == "failed_to_download:http_503" and http_server.hits["/e.jpg"] == 1


def test_parse_retry_after_and_jittered_backoff() -> None:
    now = time.time()
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(email.utils.formatdate(now + 30, usegmt=True), now=now) == pytest.approx(
        30, abs=1
    )
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0
    for bad in (None, "", "soon", "-3", "1.5", "Wed, 99 Foo 2026 00:00:00 GMT"):
        assert parse_retry_after(bad) is None
    waits = [retry_wait(2, None, 0.5, 30.0) for _ in range(200)]
    assert all(0 <= w <= 2.0 for w in waits) and len(set(waits)) > 100  # full jitter over [0, 0.5·2²]
    assert retry_wait(10, None, 0.5, 30.0) <= 30.0
    assert retry_wait(0, 4.0, 0.5, 30.0) == 4.0 and retry_wait(0, 31.0, 0.5, 30.0) is None


# --- per-host cap ----------------------------------------------------------------------------------------------


def test_per_host_cap_inside_one_actor(http_server) -> None:
    url = http_server.route("/slow.jpg", Route(body=JPEG, delay_s=0.15))
    cfg = DownloadConfig(threads_per_actor=8, per_host_connections=2, allow_hosts=["127.0.0.1"], timeout_s=5)
    assert _run(cfg, [url] * 8) == ["success"] * 8
    assert http_server.max_in_flight == 2


def test_host_slots_count_per_host_and_time_out() -> None:
    slots = HostSlots(1)
    with slots.hold("http://A.example:80/x"):
        assert slots.in_use("http://a.example./y") == 1 and slots.in_use("http://b.example/") == 0
        with slots.hold("http://b.example/"):
            pass
        with pytest.raises(TimeoutError):
            with slots.hold("http://a.example/z", deadline=time.monotonic() + 0.1):
                pass
    assert slots.in_use("http://a.example/") == 0


# --- the part deadline -------------------------------------------------------------------------------------------


def test_part_deadline_cuts_a_hanging_host_and_queued_rows(http_server) -> None:
    hang = http_server.route("/hang.jpg", Route(body=JPEG, delay_s=30))
    fast = http_server.route("/fast.jpg", Route(body=JPEG))
    cfg = DownloadConfig(threads_per_actor=1, timeout_s=20, part_deadline_s=1.0, allow_hosts=["127.0.0.1"])
    t0 = time.monotonic()
    statuses = _run(cfg, [fast, hang, fast, fast])
    assert statuses == ["success"] + ["failed_to_download:deadline"] * 3
    assert http_server.answered["/hang.jpg"] == 0 and http_server.hits["/fast.jpg"] == 1
    assert time.monotonic() - t0 < 20  # ended by the part deadline, not by the 20 s timeout


def test_part_deadline_default_and_config_ranges() -> None:
    # (⌈2000 / 16⌉ + 1) rows a thread, each at most (2 + 2) · 10 s + 2 · 30 s
    assert part_deadline_s(DownloadConfig(), 2000) == 126 * 100.0
    assert part_deadline_s(DownloadConfig(part_deadline_s=7.5), 2000) == 7.5
    for bad in (
        {"part_deadline_s": -1.0},
        {"part_deadline_s": float("nan")},
        {"per_host_connections": 0},
        {"retry_after_max_s": -1.0},
        {"retry_backoff_s": float("inf")},
        {"decode_pixel_budget": 0},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            DownloadConfig(**bad)


def test_memory_bound_is_a_function_of_the_config() -> None:
    base = DownloadConfig()
    assert memory_bound(DownloadConfig(threads_per_actor=32)) > memory_bound(base)
    assert memory_bound(DownloadConfig(decode_pixel_budget=200_000_000)) - memory_bound(base) == 7 * (
        200_000_000 - base.max_pixels
    )
    # A budget below max_pixels does not lower the bound: one image up to max_pixels is decoded alone.
    assert memory_bound(DownloadConfig(decode_pixel_budget=1)) == memory_bound(base)


def test_pixel_budget_fifo_big_image_alone_and_deadline() -> None:
    from pipeline.download.pixel_budget import PixelBudget

    budget = PixelBudget(100)
    events: list[str] = []

    def hold(name: str, n: int) -> None:
        with budget.hold(n):
            events.append(f"{name} in")
            time.sleep(0.1)
            events.append(f"{name} out")

    with budget.hold(60):
        with pytest.raises(TimeoutError):
            with budget.hold(50, deadline=time.monotonic() + 0.1):
                pass
        big = threading.Thread(target=hold, args=("big", 500))  # more than the budget: waits for all of it
        big.start()
        time.sleep(0.05)
        small = threading.Thread(target=hold, args=("small", 10))  # 40 are free, but big is ahead
        small.start()
        time.sleep(0.1)
        assert events == []
    big.join(5)
    small.join(5)
    assert events == ["big in", "big out", "small in", "small out"]


def test_port_scoped_allow_list_refuses_a_redirect_to_another_local_port(http_server) -> None:
    port = http_server.port
    guard = UrlGuard([f"127.0.0.1:{port}"])
    url = http_server.route("/a.jpg", Route(body=JPEG))
    assert _fetch(url, guard=guard).status == "success"
    hop = http_server.route("/hop", Route(status=302, headers={"Location": f"http://127.0.0.1:{port + 1}/x"}))
    assert _fetch(hop, guard=guard).status == "blocked_address"
    assert _fetch(url, guard=UrlGuard([f"127.0.0.1:{port + 1}"])).status == "blocked_address"
