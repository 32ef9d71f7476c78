"""The ``tiny`` filtering track end to end on a 3-host harness cluster, everything on S3, against one node.

A head without task CPUs and two worker hosts (2 CPUs each) share nothing but the harness's S3; the track
goes in with ``ray job submit`` from outside: the build serves its generated pool from the driver on the
head and puts the metadata, eval sets and ground truth in ``<output>/pool/``, the BPE the build trains in
``<output>/tokenizer/`` serves every model, scoring writes its parts from the scoring actors. Its
``report.md`` must equal the single-node run's (tests/fixtures/tiny_track.py) to every printed digit; only
the run directory's name and the timings section may differ.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.cluster.helpers import store_of, submit_ok
from tests.fixtures.netns_cluster import HostSpec, netns_cluster
from tests.fixtures.tiny_track import tiny_track  # noqa: F401

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def comparable(report: str, run_dir: str) -> str:
    """The report without what says where and how long: the run directory, the timings section."""
    head = report.split("\n## Timings")[0]
    return head.replace(f"Run directory `{run_dir}`", "Run directory `RUN`")


def test_tiny_track_on_three_hosts_reports_what_one_node_reports(tiny_track, tmp_path_factory) -> None:
    assert tiny_track.code == 0
    single = comparable((tiny_track.out / "report.md").read_text(), str(tiny_track.out))
    hosts = [HostSpec("host1", 2), HostSpec("host2", 2)]
    with netns_cluster(tmp_path_factory.mktemp("track-cluster"), hosts) as cluster:
        out = cluster.s3.url("track")
        t0 = time.perf_counter()
        logs = submit_ok(cluster, ["python", "-m", "jobs.track", "--preset", "tiny", "--set", f"output={out}"],
                         "tiny-track", timeout=900)  # fmt: skip
        wall = time.perf_counter() - t0
        report = store_of(cluster).read_bytes(f"{out}/report.md").decode()
    assert "[track] build …" in logs and f"served at http://{cluster.head.ip}:" in logs
    assert comparable(report, out) == single
    numbers = re.findall(r"\d+\.\d{3,4}", single)
    print(f"\ntiny track: {wall:.0f} s on 3 hosts against {tiny_track.wall_s:.0f} s on one node; "
          f"{len(numbers)} printed figures equal")  # fmt: skip
