"""The first GPU check as docs/cluster.md says to run it, on a cluster of namespace hosts: a head with no GPU,
a data host, and a host whose Ray offers one GPU (a stand-in resource, no device behind it). The documented
``ray job submit --entrypoint-num-gpus 1 ... -- bash tests/gpu_check.sh`` puts the entrypoint on the GPU
host, where the check's CPU fallback (``--cpu``, no CUDA here) runs and passes; without the flag, the same
submission runs on the head, which is why the flag is in the command."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.cluster.helpers import DATA, TRAIN, ip_of_node
from tests.fixtures.netns_cluster import HostSpec, netns_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def documented_command() -> tuple[list[str], list[str]]:
    """(``ray job submit`` options, entrypoint) of the GPU check's command in docs/cluster.md."""
    text = (ROOT / "docs" / "cluster.md").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("ray job submit")]
    lines = [ln for ln in lines if "--entrypoint-num-gpus" in ln and "gpu_check.sh" in ln]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert words[:3] == ["ray", "job", "submit"], words
    split = words.index("--")
    options, entrypoint = words[3:split], words[split + 1 :]
    kept = []  # the harness gives its own address, working dir (this checkout) and runtime env file
    i = 0
    while i < len(options):
        if options[i] in ("--working-dir", "--runtime-env", "--address"):
            i += 2
            continue
        kept.append(options[i])
        i += 1
    return kept, entrypoint


def test_the_documented_gpu_check_runs_on_the_gpu_host(tmp_path) -> None:
    options, entrypoint = documented_command()
    assert options == ["--entrypoint-num-gpus", "1"] and entrypoint == ["bash", "tests/gpu_check.sh"]
    hosts = [HostSpec("data1", 1, DATA), HostSpec("gpu1", 1, TRAIN, gpus=1)]
    with netns_cluster(tmp_path, hosts) as cluster:
        done = cluster.submit([*entrypoint, "--cpu"], "gpu-check", options=options, timeout=300)
        info, logs = cluster.job("gpu-check"), cluster.job_logs("gpu-check")
        assert done.returncode == 0 and info["status"] == "SUCCEEDED", logs[-3000:] + done.stderr[-2000:]
        where = ip_of_node(cluster)
        assert where[info["driver_node_id"]] == "gpu1"
        assert "all checks passed" in logs
        report = json.loads(re.search(r"^gpu_check report: (\{.*\})$", logs, re.M).group(1))
        assert report["host"] == cluster.hosts["gpu1"].ns and report["failed"] == []
        assert [s["preset"] for s in report["steps"]] == ["datacomp-small", "prolip-b16"]
        # The same submission without the flag: its entrypoint runs on the head, which has no GPU.
        cluster.submit(["python", "-c", "import socket; print('on', socket.gethostname())"], "no-flag")
        assert where[cluster.job("no-flag")["driver_node_id"]] == "head"
        assert f"on {cluster.hosts['head'].ns}" in cluster.job_logs("no-flag")
