"""Failure 2: a changed pool with the same uids silently reused the old parts.

The same uids in the same order with new captions (or URLs to other pictures) re-run into the same
output finished with "N parts, N already done": the shards kept every old caption and picture while the
filters read the new captions. The fingerprint now covers what the parts bake in (URLs, captions,
sha256, face boxes, one digest per row), so such a pool is refused in one line, or, with
``refresh_changed=true``, exactly its changed rows are downloaded again and the result equals a clean
build of the new pool. A loopback URL's port is left out (the demo pool served again on another port).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pipeline import schema as S
from pipeline.build import build
from pipeline.common.config import merge
from pipeline.config import BUILD_PRESETS
from pipeline.source.run_state import FingerprintMismatch
from tests.faults.tiny_pool import serve, write_files, write_metadata
from tests.fixtures.build_runs import check_invariants, snapshot

N = 40


def _cfg(meta: str, out: Path, **extra):
    return merge(BUILD_PRESETS["demo"], {
        "metadata": meta, "output": str(out), "download_actors": 0, "part_size": 10, "samples_per_shard": 16,
        "filters": {"names": ["no_filter", "random"]}, "dedupe": {"near_duplicates": True},
        "download": {"timeout_s": 10.0, "retries": 0, "threads_per_actor": 4}, **extra,
    })  # fmt: skip


def _run(cfg) -> list[str]:
    lines: list[str] = []
    build(cfg, log=lines.append)
    return lines


def _captions(snap: dict) -> dict[str, str]:
    return {uid: m["txt"].decode() for uid, m in snap["members"].items()}


@pytest.fixture
def pool(tmp_path):
    rows = write_files(tmp_path, n=N, seed=7)
    with serve(tmp_path) as base:
        yield tmp_path, rows, base


def test_new_captions_are_refused_or_refreshed_never_mixed(pool) -> None:
    root, rows, base = pool
    out = root / "out"
    _run(_cfg(write_metadata(root, rows, base, "v1"), out))
    old = snapshot(out)

    changed = [dict(r, **{S.TEXT: f"{r[S.TEXT]}, captioned again"}) if i % 3 == 0 else r
               for i, r in enumerate(rows)]  # fmt: skip
    meta2 = write_metadata(root, changed, base, "v2")
    with pytest.raises(FingerprintMismatch) as refused:
        _run(_cfg(meta2, out))
    msg = str(refused.value)
    assert "\n" not in msg and "refresh_changed=true" in msg and str(out) in msg
    assert snapshot(out)["tars"] == old["tars"]  # refused before anything was touched

    lines = _run(_cfg(meta2, out, refresh_changed=True))
    live_changed = sum(
        1 for i in range(0, N, 3) if i not in (5, 7, 15)
    )  # rows decided before download stay out
    again = re.search(r"(\d+) rows of (\d+) parts downloaded again", "\n".join(lines))
    assert again and int(again.group(1)) == live_changed, lines
    _run(_cfg(meta2, root / "clean"))
    refreshed, clean = snapshot(out), snapshot(root / "clean")
    check_invariants(refreshed, N)
    assert refreshed["status"] == clean["status"] and refreshed["members"] == clean["members"]
    assert refreshed["tars"] == clean["tars"] and refreshed["subsets"] == clean["subsets"]
    new_caps = _captions(refreshed)
    assert sum(c.endswith("captioned again") for c in new_caps.values()) > 5
    print(f"rows compared: {len(refreshed['status'])} statuses, {len(new_caps)} shard samples; "
          f"{int(again.group(1))} rows downloaded again")  # fmt: skip
    # Once refreshed, the same pool resumes without a word; refresh_changed finds nothing to do.
    assert "downloaded again" not in "\n".join(_run(_cfg(meta2, out, refresh_changed=True)))


def test_urls_to_other_pictures_are_refreshed_and_a_new_port_is_the_same_pool(pool) -> None:
    root, rows, base = pool
    out = root / "out"
    _run(_cfg(write_metadata(root, rows, base, "v1"), out))
    swapped = [dict(r) for r in rows]
    for i, j in ((20, 21), (30, 31)):  # two rows now point at each other's picture, with its sha256
        for key in (S.URL, S.SHA256):
            swapped[i][key], swapped[j][key] = rows[j][key], rows[i][key]
    meta2 = write_metadata(root, swapped, base, "v2")
    lines = _run(_cfg(meta2, out, refresh_changed=True))
    assert "4 rows of 2 parts downloaded again" in "\n".join(lines), lines
    _run(_cfg(meta2, root / "clean"))
    assert snapshot(out)["members"] == snapshot(root / "clean")["members"]

    with serve(root) as other_port:  # the same pool on another free port: a plain resume
        assert other_port != base
        lines = _run(_cfg(write_metadata(root, swapped, other_port, "v3"), out))
    assert any(re.search(r"download: \d+ parts .*?, (\d+) already done", line) for line in lines), lines
    assert not any("again" in line for line in lines)


def test_a_pool_served_again_by_another_host_is_the_same_pool() -> None:
    """The demo pool a new cluster head serves elsewhere keeps its content; another picture does not."""
    import pyarrow as pa

    from pipeline.source.content import content_digests, served_hosts

    def digest(url: str, allow: list[str]) -> int:
        table = pa.table({S.URL: [url], S.TEXT: ["a caption"], S.SHA256: [None]})
        return int(content_digests(table, served_hosts(allow))[0])

    first = digest("http://198.18.0.10:4000/img/1.jpg", ["127.0.0.1", "198.18.0.10:4000"])
    assert first == digest("http://198.18.0.11:5000/img/1.jpg", ["127.0.0.1", "198.18.0.11:5000"])
    assert first != digest("http://198.18.0.11:5000/img/2.jpg", ["127.0.0.1", "198.18.0.11:5000"])
    assert first != digest("http://198.18.0.11:5000/img/1.jpg", ["127.0.0.1"])  # not served by this run


def test_a_pool_served_again_by_another_host_keeps_each_repeated_uids_row() -> None:
    """Which row of a repeated uid goes on (the smallest row key) does not change when a new head serves
    the pool elsewhere: 40 uids of two rows each, whose choice flips for about half of them when the
    served host is part of the key."""
    import pyarrow as pa

    from pipeline.source.content import served_hosts
    from pipeline.source.row_checks import ROW_KEY, canonical_rows, prepare_batch

    def chosen(host: str) -> list[str]:
        n = 40
        urls = [f"http://{host}/img/{i}-{v}.jpg" for i in range(n) for v in "ab"]
        batch = pa.table({S.UID: [f"{i:032x}" for i in range(n) for _ in "ab"], S.URL: urls,
                          S.TEXT: [f"caption {i}" for i in range(n) for _ in "ab"]})  # fmt: skip
        prepared = prepare_batch(batch, 100, served_hosts(["127.0.0.1", host]))
        keep = canonical_rows(prepared.column(S.UID), prepared.column(ROW_KEY), np.ones(2 * n, bool))
        return [u.rsplit("/", 1)[1] for u, k in zip(urls, keep, strict=True) if k]

    first = chosen("198.18.0.10:4000")
    assert len(first) == 40 and first == chosen("198.18.0.11:5000")
