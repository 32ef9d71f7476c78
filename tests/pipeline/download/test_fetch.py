"""fetch() and DownloadWorker against a real HTTP server on 127.0.0.1 (tests/fixtures/http_server.py)."""
# ruff: noqa: F811
# (pytest fixtures imported from tests/fixtures/http_server.py are re-bound as test arguments)

from __future__ import annotations

import hashlib
import io
import socket

import numpy as np
import pandas  # noqa: F401  (pyarrow imports it lazily on its first conversion: pay that at collection)
import pyarrow as pa
import pytest
from PIL import Image

from pipeline.config import DownloadConfig
from pipeline.download.fetch import fetch, is_opted_out
from pipeline.download.netguard import UrlGuard
from pipeline.download.worker import OUTPUT_SCHEMA, DownloadWorker
from tests.fixtures.http_server import Route, canary_listener, http_server, https_server, was_contacted  # noqa: F401

GUARD = UrlGuard(["127.0.0.1"])


def _jpeg(w: int = 64, h: int = 48, color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:] = color
    arr[: h // 2, : w // 2] = (20, 200, 20)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=92)
    return buf.getvalue()


JPEG = _jpeg()


def _fetch(url: str, **kw):
    args = dict(timeout_s=0.3, retries=2, max_bytes=1 << 20, guard=GUARD, user_agent="test-agent/1",
                honor_robots=True)  # fmt: skip
    args.update(kw)
    return fetch(url, **args)


def test_success_returns_bytes_and_sends_user_agent(http_server) -> None:
    res = _fetch(http_server.route("/a.jpg", Route(body=JPEG)))
    assert (res.status, res.data, res.http_status) == ("success", JPEG, 200)
    assert http_server.user_agents == ["test-agent/1"]


def test_404_is_final_not_retried(http_server) -> None:
    res = _fetch(http_server.url("/missing.jpg"))
    assert res.status == "failed_to_download:http_404" and res.http_status == 404
    assert http_server.hits["/missing.jpg"] == 1


def test_500_then_200_succeeds_on_retry(http_server) -> None:
    res = _fetch(http_server.route("/flaky.jpg", Route(body=JPEG, fail_first=1)))
    assert res.status == "success" and res.data == JPEG
    assert http_server.hits["/flaky.jpg"] == 2


def test_always_500_uses_every_retry(http_server) -> None:
    res = _fetch(http_server.route("/down.jpg", Route(body=JPEG, fail_first=99)), retries=2)
    assert res.status == "failed_to_download:http_500"
    assert http_server.hits["/down.jpg"] == 3


def test_slow_server_times_out(http_server) -> None:
    # The server would answer after 60 s; the client (0.3 s timeout) must have given up long before.
    url = http_server.route("/slow.jpg", Route(body=JPEG, delay_s=60.0))
    res = _fetch(url, retries=0)
    assert res.status == "failed_to_download:timeout"
    assert http_server.hits["/slow.jpg"] == 1 and http_server.answered["/slow.jpg"] == 0


def test_trickling_body_cannot_stretch_the_deadline(http_server) -> None:
    # One byte every 50 ms never trips a per-recv timeout of 0.3 s; the attempt deadline must, so the
    # client gives up while the server is still trickling (the whole body would take 60 s).
    url = http_server.route("/trickle.jpg", Route(body=JPEG[:1200], trickle_s=0.05))
    res = _fetch(url, retries=0)
    assert res.status == "failed_to_download:timeout"
    assert http_server.hits["/trickle.jpg"] == 1 and http_server.answered["/trickle.jpg"] == 0


def test_truncated_body(http_server) -> None:
    url = http_server.route("/short.jpg", Route(body=JPEG[:500], declared_length=len(JPEG)))
    res = _fetch(url, retries=1)
    assert res.status == "failed_to_download:truncated" and res.data is None
    assert http_server.hits["/short.jpg"] == 2  # a dropped connection is worth one more try


def test_oversize_refused_from_content_length_and_while_reading(http_server) -> None:
    declared = http_server.route("/big.jpg", Route(body=JPEG, declared_length=10_000_000))
    res = _fetch(declared, max_bytes=100_000)
    assert res.status == "failed_to_download:too_large"
    assert http_server.hits["/big.jpg"] == 1
    body = b"\xff\xd8\xff" + b"x" * 5000
    undeclared = http_server.route("/chunkless.jpg", Route(body=body, send_length=False))
    assert _fetch(undeclared, max_bytes=1000).status == "failed_to_download:too_large"
    assert _fetch(undeclared, max_bytes=len(body)).data == body  # exactly max_bytes is fine


def test_redirect_to_allowed_path_is_followed(http_server) -> None:
    http_server.route("/final.jpg", Route(body=JPEG))
    http_server.route("/hop2", Route(status=302, headers={"Location": "/final.jpg"}))  # relative
    url = http_server.route("/hop1", Route(status=301, headers={"Location": http_server.url("/hop2")}))
    res = _fetch(url)
    assert res.status == "success" and res.data == JPEG
    assert [http_server.hits[p] for p in ("/hop1", "/hop2", "/final.jpg")] == [1, 1, 1]


def test_redirect_to_blocked_address_refused_without_connecting(http_server, canary_listener) -> None:
    canary_url, canary = canary_listener
    url = http_server.route(
        "/evil", Route(status=307, headers={"Location": canary_url + "/latest/meta-data"})
    )
    res = _fetch(url)
    assert res.status == "blocked_address"
    assert http_server.hits["/evil"] == 1  # final: not retried
    assert not was_contacted(canary)
    assert _fetch(http_server.route("/ftp", Route(status=302, headers={"Location": "ftp://x/y"}))).status == (
        "invalid_url"
    )


def test_redirect_loop_stops_after_five_hops(http_server) -> None:
    url = http_server.route("/loop", Route(status=302, headers={"Location": "/loop"}))
    res = _fetch(url)
    assert res.status == "failed_to_download:http_302"
    assert http_server.hits["/loop"] == 6


@pytest.mark.parametrize(
    ("header", "opted_out"),
    [("noai", True), ("noimageai", True), ("noindex, nofollow", True), ("NoImageIndex", True),
     ("none", False), ("nofollow", False), ("googlebot: noai", False), ("unavailable_after: 2030-01-01", False)],
)  # fmt: skip
def test_x_robots_tag_opt_out(http_server, header: str, opted_out: bool) -> None:
    url = http_server.route("/r.jpg", Route(body=JPEG, headers={"X-Robots-Tag": header}))
    assert _fetch(url).status == ("opted_out" if opted_out else "success")
    assert _fetch(url, honor_robots=False).status == "success"


def test_is_opted_out_matches_img2dataset_token_rule() -> None:
    assert is_opted_out(["mybot: noai"], user_agent_token="mybot")
    assert not is_opted_out(["otherbot: noai"], user_agent_token="mybot")
    assert is_opted_out(["nofollow", "noai"])


def test_connects_to_the_address_the_guard_checked(http_server) -> None:
    # "images.test" exists only in the guard's resolver: success proves fetch never re-resolves the name
    # (a rebinding DNS server gets no second chance), while Host still names the URL's host.
    def resolver(host, port, **kw):
        assert host == "images.test"
        return socket.getaddrinfo("127.0.0.1", port, **kw)

    guard = UrlGuard(["127.0.0.1"], resolver=resolver)
    url = http_server.route("/a.jpg", Route(body=JPEG)).replace("127.0.0.1", "images.test")
    assert _fetch(url, guard=guard).status == "success"
    assert http_server.host_headers == [f"images.test:{http_server.port}"]


def test_invalid_blocked_and_refused_urls() -> None:
    assert _fetch("ftp://127.0.0.1/a.jpg").status == "invalid_url"
    assert _fetch("http://127.0.0.2:9/a.jpg").status == "blocked_address"
    assert UrlGuard([]).check("http://127.0.0.1:9/") == "blocked_address"
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _fetch(f"http://127.0.0.1:{port}/a.jpg", retries=1).status == "failed_to_download:connection_error"


def test_https_to_a_plain_http_server_is_a_connection_error(http_server) -> None:
    url = http_server.route("/a.jpg", Route(body=JPEG)).replace("http://", "https://")
    assert _fetch(url, retries=0).status == "failed_to_download:connection_error"


# --- DownloadWorker ---------------------------------------------------------------------------------------


def _cfg(**kw) -> DownloadConfig:
    base = dict(timeout_s=0.5, retries=1, threads_per_actor=4, allow_hosts=["127.0.0.1"])
    base.update(kw)
    return DownloadConfig(**base)


def test_worker_one_row_per_input_in_order(http_server) -> None:
    big = _jpeg(700, 450)
    ok = http_server.route("/ok.jpg", Route(body=big))
    other = http_server.route("/other.jpg", Route(body=JPEG))
    html = http_server.route("/page.html", Route(body=b"<html>hi</html>", content_type="text/html"))
    rows = pa.table(
        {
            "uid": [f"{i:032x}" for i in range(8)],
            "url": [ok, other, http_server.url("/nope.jpg"), html, other, "http://10.0.0.1/x.jpg", "not a url",
                    ok],
            "text": ["t"] * 8,
            "sha256": [hashlib.sha256(big).hexdigest(), "0" * 64, None, None, None, None, None,
                       hashlib.sha256(big).hexdigest().upper()],
            "face_bboxes": [[[0.1, 0.1, 0.3, 0.4]], None, None, None, [], None, None, None],
        }
    )  # fmt: skip
    worker = DownloadWorker(_cfg())
    try:
        out = worker(rows)
    finally:
        worker.close()
    assert out.schema.equals(OUTPUT_SCHEMA)
    d = out.to_pydict()
    assert d["uid"] == rows.column("uid").to_pylist()
    assert d["status"] == [
        "success", "hash_mismatch", "failed_to_download:http_404", "failed_to_resize:not_an_image",
        "success", "blocked_address", "invalid_url", "success",
    ]  # fmt: skip
    sizes = [d[k][0] for k in ("width", "height", "original_width", "original_height")]
    assert sizes == [512, 329, 700, 450]
    assert d["image_sha256"][0] == hashlib.sha256(big).hexdigest()
    assert d["image_sha256"][1] == hashlib.sha256(JPEG).hexdigest() and d["jpg"][1] is None
    assert d["image_sha256"][2] is None and d["phash"][2] is None
    assert isinstance(d["phash"][0], int) and d["jpg"][0][:3] == b"\xff\xd8\xff"
    assert d["jpg"][0] != d["jpg"][7]  # row 0 had a face box, row 7 the same image without one


def test_worker_accepts_dicts_skips_sha_check_when_disabled_and_never_raises(http_server) -> None:
    url = http_server.route("/a.jpg", Route(body=JPEG))
    worker = DownloadWorker(_cfg(verify_sha256=False))
    try:
        out = worker({"uid": np.array(["a" * 32, "b" * 32, "c" * 32]), "url": [url, None, 42],
                      "sha256": ["0" * 64, None, None]})  # fmt: skip
    finally:
        worker.close()
    assert out.column("status").to_pylist() == ["success", "invalid_url", "invalid_url"]


def test_worker_decodes_at_the_configured_jpeg_dct_margin(http_server) -> None:
    """``jpeg_dct_margin`` reaches the decode: a 1100×800 photo is decoded at 1/2 scale with margin 1
    (550 ≥ 512) and at full size with the default 3; margins 0 and 3 then store the same bytes."""
    rng = np.random.default_rng(3)
    arr = np.clip(rng.normal(128, 40, (800, 1100, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    url = http_server.route("/photo.jpg", Route(body=buf.getvalue()))
    stored = {}
    for margin in (0.0, 1.0, 3.0):
        worker = DownloadWorker(_cfg(jpeg_dct_margin=margin))
        try:
            out = worker(pa.table({"uid": ["a" * 32], "url": [url]})).to_pydict()
        finally:
            worker.close()
        assert out["status"] == ["success"] and (out["width"][0], out["height"][0]) == (512, 372)
        stored[margin] = out["jpg"][0]
    assert stored[0.0] == stored[3.0] != stored[1.0]


def test_https_with_pinned_address_sni_and_verification(https_server, monkeypatch) -> None:
    from pipeline.download import fetch as download

    url = https_server.route("/a.jpg", Route(body=JPEG))
    assert _fetch(url).status == "failed_to_download:connection_error"  # untrusted self-signed cert
    monkeypatch.setattr(download, "_TLS", download.tls_context(cadata=https_server.cadata))
    res = _fetch(url)
    assert (res.status, res.data) == ("success", JPEG)
    # Trusted certificate but for another name: refused during the handshake.
    hits = https_server.hits["/a.jpg"]
    guard = UrlGuard(["localhost"], resolver=lambda h, p, **kw: socket.getaddrinfo("127.0.0.1", p, **kw))
    assert _fetch(https_server.url("/a.jpg", host="localhost"), guard=guard).status == (
        "failed_to_download:connection_error"
    )
    assert https_server.hits["/a.jpg"] == hits
