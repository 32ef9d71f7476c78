"""The build's driver holds O(files + parts + buckets), never O(rows): its peak does not grow with the pool.

Two pools of DataComp-like rows (~130-byte URLs, ~70-byte captions), 10,000 and 60,000 rows; one row in
200 downloads a picture from a real HTTP server, the others point at a private address and are refused
without a connection, so the download is quick and every row still passes every stage. Each build's
driver runs in its own process inside a memory cgroup (tests/fixtures/cgroup.py) and joins the suite's
local Ray, so its Ray workers and actors run outside the cgroup: the cgroup's peak is the driver's own.
A driver that held the pool's columns (1.8 KB a row across its stages) would grow by ~90 MB from one pool
to the other; the bound is 24 MiB.
"""
# ruff: noqa: F811

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import schema as S
from pipeline.common.config import merge, to_dict
from pipeline.config import BUILD_PRESETS
from tests.fixtures import cgroup
from tests.fixtures.blocked_pool import picture, write_pool
from tests.fixtures.http_server import Route, http_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SIZES = (10_000, 60_000)
GROWTH_BOUND = 24 << 20
LIMIT = 1536 << 20  # a driver that grew with the pool would still fit: the growth is what is asserted

pytestmark = [pytest.mark.ray, pytest.mark.slow]

_DRIVER = """
import json, sys
import ray
from pipeline.build import build
from pipeline.common.config import load
from pipeline.config import BuildConfig

ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
res = build(load(BuildConfig, json.loads(sys.argv[2])), log=lambda m: None)
print(json.dumps({"rows": res.n_input, "status": res.status_counts, "shards": len(res.shards)}))
"""


def _driver_peak(ray_address: str, cfg, tmp: Path) -> tuple[int, dict]:
    with cgroup.MemoryCgroup(LIMIT) as group:
        done = subprocess.run(
            [sys.executable, "-c", _DRIVER, ray_address, json.dumps(to_dict(cfg))],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, preexec_fn=group.enter,
        )  # fmt: skip
        assert done.returncode == 0 and group.oom_kills == 0, done.stderr[-3000:]
        return group.peak, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cgroup.unavailable() is not None, reason=str(cgroup.unavailable()))
def test_the_build_driver_does_not_grow_with_the_pool(ray_local, http_server, tmp_path) -> None:
    http_server.route("/a.jpg", Route(body=picture()))
    base = http_server.url("").rstrip("/")
    peaks = {}
    for n in SIZES:
        cfg = merge(BUILD_PRESETS["demo"], {
            "metadata": write_pool(tmp_path / f"meta-{n}", n, base), "output": str(tmp_path / f"out-{n}"),
            "part_size": 2_000, "samples_per_shard": 1_000, "bucket_rows": 25_000,
            "filters": {"names": ["no_filter", "english", "clip_score"]},
            "download": {"verify_sha256": False},
        })  # fmt: skip
        peaks[n], res = _driver_peak(ray_local.address_info["gcs_address"], cfg, tmp_path)
        assert res["rows"] == n and res["status"][S.STATUS_BLOCKED_ADDRESS] == n - n // 200
        assert res["status"][S.STATUS_SUCCESS] == 1  # one picture under many URLs: exact duplicates
    growth = peaks[SIZES[1]] - peaks[SIZES[0]]
    print(f"driver peak: {', '.join(f'{n} rows {p / 2**20:.0f} MiB' for n, p in peaks.items())}; "
          f"growth {growth / 2**20:.1f} MiB for {SIZES[1] - SIZES[0]} rows")  # fmt: skip
    assert growth < GROWTH_BOUND
