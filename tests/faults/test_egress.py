"""Failure 7: egress at start. Every job's Ray dashboard process asked ``169.254.169.254`` and looked up
``metadata.google.internal``, although usage stats are off (Ray's usage-stats module probes the cloud
before it reads the setting): against "nothing leaves 127.0.0.1", and on a cloud VM a request to the
instance metadata service.

A real ``jobs.build_dataset`` runs with its own local Ray while every Python process of it (the driver,
Ray's dashboard and agents, its workers) records, through an audit hook installed by a
``sitecustomize`` on their ``PYTHONPATH``, each name it resolves and each address it connects to. No
lookup of a metadata name and no connection to a link-local or metadata address may appear; every
network connection goes to 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.download.netguard import METADATA_ADDRESSES
from tests.faults.tiny_pool import serve, write_files, write_metadata

ROOT = Path(__file__).resolve().parents[2]
METADATA_NAMES = {"metadata.google.internal", "metadata", "instance-data", "metadata.azure.com"}
HOOK = """
import json, os, sys

def _record(event, args):
    if event not in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
        return
    target = args[1] if event == "socket.connect" else args[0]
    if event == "socket.connect" and not isinstance(target, tuple):
        return  # a Unix socket
    line = json.dumps({"pid": os.getpid(), "argv": sys.argv[:2], "event": event, "target": list(target)
                       if isinstance(target, tuple) else target}, default=str)
    with open(os.environ["EGRESS_LOG"], "a") as f:
        f.write(line + "\\n")

if os.environ.get("EGRESS_LOG"):
    sys.addaudithook(_record)
    with open(os.environ["EGRESS_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[:3], "event": "start"}) + "\\n")
"""


def _forbidden(host: str) -> bool:
    if host.rstrip(".").lower() in METADATA_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return ip.is_link_local or ip in METADATA_ADDRESSES


@pytest.mark.ray
@pytest.mark.slow
def test_a_job_and_its_ray_open_no_connection_beyond_loopback(tmp_path) -> None:
    hook_dir, log = tmp_path / "hook", tmp_path / "egress.jsonl"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    rows = write_files(tmp_path / "pool", n=24, seed=2)  # its planted rows reach index 19
    with serve(tmp_path / "pool") as base:
        meta = write_metadata(tmp_path, rows, base)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, as a user's
        env.update(EGRESS_LOG=str(log), PYTHONPATH=f"{hook_dir}:{ROOT}", RAY_USAGE_STATS_ENABLED="0")
        args = [sys.executable, "-m", "jobs.build_dataset", "--preset", "demo", "--set", f"metadata={meta}",
                "--set", f"output={tmp_path / 'out'}", "--set", "download_actors=0", "--set", "part_size=8",
                "--set", "filters.names=[no_filter]", "--set", "num_cpus=1"]  # fmt: skip
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    started = [e for e in events if e["event"] == "start"]
    lookups = [e for e in events if e["event"] != "start" and e["event"] != "socket.connect"]
    connects = [e for e in events if e["event"] == "socket.connect"]
    bad = [e for e in lookups if _forbidden(str(e["target"]))]
    bad += [e for e in connects if _forbidden(str(e["target"][0]))]
    outside = [e for e in connects if not str(e["target"][0]).startswith("127.")]
    dashboards = [e for e in started if any("dashboard/dashboard.py" in a for a in e["argv"])]
    print(f"{len(started)} Python processes, {len(connects)} connections (all to 127.0.0.1: "
          f"{not outside}), {len(lookups)} lookups, metadata: {len(bad)}")  # fmt: skip
    assert len(started) >= 3, started  # the driver and Ray's own Python processes were watched
    assert not bad, bad
    assert not outside, outside
    assert not dashboards, dashboards  # no process left to run the usage-stats probe
