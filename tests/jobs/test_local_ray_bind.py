"""A local Ray started the way every job starts it (``jobs.common.init_ray``) listens on 127.0.0.1 only.

The probe runs in a fresh interpreter: it starts Ray, runs a task and a Ray Data pipeline (so workers and
the agents are up), then lists the listening sockets of every process under it (psutil) and stops Ray.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, time, psutil, ray
import ray.data  # imported before init_ray, as a job's modules do
from jobs.common import init_ray
init_ray(num_cpus=1)
ray.get(ray.remote(lambda: 1).remote())
ray.data.range(4).map_batches(lambda b: b).take_all()
time.sleep(2)  # agents finish starting their servers
me = psutil.Process()
found = []
for p in [me, *me.children(recursive=True)]:
    try:
        conns = p.net_connections(kind="inet")
        name = " ".join(p.cmdline()[:2])[-120:]
    except psutil.Error:
        continue
    for c in conns:
        if c.status == psutil.CONN_LISTEN or (not c.raddr and c.type == 2):
            found.append([name, c.laddr.ip, c.laddr.port])
print("LISTEN " + json.dumps(found))
ray.shutdown()
"""


def _loopback(text: str) -> bool:
    ip = ipaddress.ip_address(text)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.ray
@pytest.mark.slow
def test_local_ray_listens_on_loopback_only(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("LISTEN ")), None)
    assert line is not None, out.stderr[-3000:]
    sockets = json.loads(line[len("LISTEN ") :])
    names = {name for name, _, _ in sockets}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    outside = [s for s in sockets if not _loopback(s[1])]
    assert outside == [], outside
