"""SIGKILL mid-download, re-run: the result equals a clean build uid for uid, status for status, shards
included, and the killed run leaves no process behind.

The job runs as ``python -m jobs.build_dataset`` in its own process group with its own local Ray; the
test kills the whole group and, at the same moment, stops the pool's server (the outage that came with
the driver's death in the demo, where the job served the pool itself): any download actor still running
now fails, and none of its work may count. The server comes back on the same port for the re-run, so the
URLs, hence the shards' json members, are the same as the clean build's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.status import status_lines
from pipeline.build import build
from pipeline.common.config import merge, parse_set
from pipeline.common.storage import LOCAL
from pipeline.config import BUILD_PRESETS
from pipeline.demo.eval_sets import EvalSizes
from pipeline.demo.pool import generate_pool, write_metadata
from pipeline.demo.server import serve_pool
from tests.fixtures.build_runs import check_invariants, snapshot

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SETS = {
    "part_size": 12,
    "samples_per_shard": 40,
    "num_cpus": 2,
    "download_actors": 1,
    "download.threads_per_actor": 2,  # slow enough that the kill lands mid-download
    "download.timeout_s": 5.0,
    "filters.names": "[no_filter, random]",
}


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid → (ppid, pgid, state) of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        out[int(d)] = (int(rest[1]), int(rest[2]), rest[0])
    return out


def _family(root: int) -> set[int]:
    """``root``, its descendants and everything in its process group."""
    procs = _procs()
    family = {root} | {p for p, (_, pgid, _) in procs.items() if pgid == root}
    grew = True
    while grew:
        new = {p for p, (ppid, _, _) in procs.items() if ppid in family} - family
        family |= new
        grew = bool(new)
    return family


def _alive(pids: set[int]) -> set[int]:
    procs = _procs()
    return {p for p in pids if p in procs and procs[p][2] != "Z"}


@pytest.mark.parametrize("ray_mode", ["own", "shared"])
def test_sigkill_mid_download_then_rerun_equals_clean_build(ray_local, tmp_path, ray_mode):
    """``own``: the job starts its local Ray, which dies with its process group. ``shared``: the job is a
    driver on the session's Ray, whose actors may outlive it and finish parts against the dead server."""
    pool = tmp_path / "pool"
    generate_pool(pool, n=150, seed=5, eval_sizes=EvalSizes(per_class=1, retrieval=2, hierarchy=2))
    server = serve_pool(pool, slow_s=8.0)
    port = server.port
    meta = write_metadata(pool, server.base_url)
    out = tmp_path / "killed"
    sets = {**SETS, "metadata": meta, "output": str(out)}
    args = [sys.executable, "-m", "jobs.build_dataset", "--preset", "demo"]
    args += [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    if ray_mode == "shared":
        env["RAY_ADDRESS"] = ray_local.address_info["address"]
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    parts = out / "work" / "parts"
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list(parts.glob("*.done")) and proc.poll() is None:
            family |= _family(proc.pid)
            time.sleep(0.2)
        family |= _family(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        server.stop()  # the outage that comes with the kill
        proc.wait()
    done_at_kill = len(list(parts.glob("*.done")))
    assert done_at_kill >= 1 and not (out / "metadata" / "status.parquet").exists(), "killed too late"
    half = status_lines(str(out), LOCAL)  # python -m jobs.status on the killed run
    assert half[0] == "build: a run in progress or interrupted; pool of 150 rows", half
    assert half[1].startswith(f"  {done_at_kill} download parts committed"), half
    if ray_mode == "own":
        assert len(family) > 3, family  # the driver and its local Ray's processes
    deadline = time.monotonic() + 30
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _alive(family)
    for pid in left:  # ours to clean up if the assertion below fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed run still alive: {sorted(left)}"

    with serve_pool(pool, port=port, slow_s=8.0):
        rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        skipped = re.search(r"download: (\d+) parts .*?, (\d+) already done", rerun.stdout)
        assert skipped and done_at_kill <= int(skipped.group(2)) < int(skipped.group(1)), rerun.stdout[-2000:]
        clean = {**SETS, "metadata": meta, "output": str(tmp_path / "clean")}
        clean_cfg = merge(BUILD_PRESETS["demo"], parse_set([f"{k}={v}" for k, v in clean.items()]))
        build(clean_cfg, log=lambda m: None)
    resumed, clean = snapshot(out), snapshot(tmp_path / "clean")
    check_invariants(resumed, 150)
    assert status_lines(str(out), LOCAL)[0].startswith("build: finished; 150 rows by status: ")
    assert resumed["status"] == clean["status"]
    assert resumed["members"] == clean["members"]  # member names and bytes per uid
    assert resumed["tars"] == clean["tars"] and resumed["subsets"] == clean["subsets"]
    if ray_mode == "own":  # on the shared Ray an orphaned actor may still write a file no marker names
        leftovers = [p.name for p in parts.iterdir() if p.suffix in (".tar", ".parquet")]
        assert len(leftovers) == 2 * len(list(parts.glob("*.done")))  # no uncommitted part files remain
