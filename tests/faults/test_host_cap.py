"""Failure 4: the per-host connection cap is per server, not per spelling of its name.

Five spellings of one loopback server (``127.0.0.1``, ``127.1``, ``2130706433``, ``0x7f000001``,
``localhost``) gave 16 concurrent connections under a cap of 2 when the cap was keyed on the URL's host
text. A real HTTP server counts the requests it is answering at once (``max_in_flight``).
"""
# ruff: noqa: F811

from __future__ import annotations

import io
import time

import numpy as np
import pyarrow as pa
from PIL import Image

from pipeline.config import DownloadConfig
from pipeline.download.politeness import HostSlots
from pipeline.download.worker import DownloadWorker
from tests.fixtures.http_server import Route, http_server  # noqa: F401

SPELLINGS = ("127.0.0.1", "127.1", "2130706433", "0x7f000001", "localhost")


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((24, 32, 3), (30, 140, 90), np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_spellings_of_one_server_share_its_cap(http_server) -> None:
    http_server.route("/slow.jpg", Route(body=_jpeg(), delay_s=0.25))
    port = http_server.url("/").split(":")[2].split("/")[0]
    urls = [f"http://{SPELLINGS[i % len(SPELLINGS)]}:{port}/slow.jpg" for i in range(20)]
    cfg = DownloadConfig(
        threads_per_actor=16, per_host_connections=2, timeout_s=20, allow_hosts=["127.0.0.1"]
    )
    worker = DownloadWorker(cfg)
    try:
        rows = pa.table({"uid": [f"{i:032x}" for i in range(len(urls))], "url": urls})
        out = worker(rows)
    finally:
        worker.close()
    assert out.column("status").to_pylist() == ["success"] * len(urls)
    assert http_server.hits["/slow.jpg"] == len(urls)
    print(f"max concurrent requests observed: {http_server.max_delaying} (cap 2, {len(urls)} rows)")
    assert http_server.max_delaying == 2  # the cap reached, never passed


def test_a_hold_takes_every_key_or_none() -> None:
    slots = HostSlots(1)
    with slots.hold(["name:a.example", "addr:127.0.0.1"]):
        assert slots.in_use("addr:127.0.0.1") == 1 and slots.in_use("http://a.example/x") == 1
        # Another name of the same address waits for the address slot, and takes neither meanwhile.
        t0 = time.monotonic()
        try:
            with slots.hold(["name:b.example", "addr:127.0.0.1"], deadline=t0 + 0.05):
                raise AssertionError("the address slot was free twice")
        except TimeoutError:
            pass
        assert slots.in_use("name:b.example") == 0
    assert HostSlots.address_key("::ffff:127.0.0.1") == HostSlots.address_key("127.0.0.1")
    assert slots.in_use("addr:127.0.0.1") == 0
