"""Failure 8: nothing locked a build's output. Two builds into one output agreed with a clean build in three
trials, but the fingerprint's check-then-write and the deletion of uncommitted part files are races by
reading. A build now holds an exclusive lock in the run state (local: ``flock``; S3: a conditional
write, renewed) and a second one is refused in one line; a holder that died frees it (local at once; S3
at once for a dead process of this machine, else after the lease).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.build import build
from pipeline.common.config import merge
from pipeline.common.storage import Storage
from pipeline.config import BUILD_PRESETS
from pipeline.source import output_lock as L
from tests.faults.tiny_pool import serve, write_files, write_metadata
from tests.fixtures.build_runs import check_invariants, snapshot

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from pipeline.common.storage import Storage
from pipeline.source.output_lock import exclusive
with exclusive(sys.argv[1], Storage.from_env()):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(output: str, env: dict | None = None) -> subprocess.Popen:
    """A real process holding the output's lock through the build's own API until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, output], cwd=ROOT, env=env or os.environ.copy(),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _cfg(meta: str, out: str) -> object:
    return merge(BUILD_PRESETS["demo"], {
        "metadata": meta, "output": out, "download_actors": 0, "part_size": 8, "samples_per_shard": 16,
        "filters": {"names": ["no_filter"]}, "download": {"timeout_s": 10.0, "retries": 0},
    })  # fmt: skip


def test_a_second_build_is_refused_while_the_first_holds_the_output(tmp_path) -> None:
    rows = write_files(tmp_path, n=24, seed=11)
    out = str(tmp_path / "out")
    with serve(tmp_path) as base:
        cfg = _cfg(write_metadata(tmp_path, rows, base), out)
        holder = _holder(out)
        try:
            with pytest.raises(L.OutputLocked) as refused:
                build(cfg, log=lambda m: None)
        finally:
            _kill(holder)  # SIGKILL: the kernel drops its flock with the process
        msg = str(refused.value)
        assert "\n" not in msg and f"pid {holder.pid}" in msg and out in msg
        assert not (tmp_path / "out" / "work" / "fingerprint.json").exists()  # refused before the check
        build(cfg, log=lambda m: None)  # the dead holder's lock is gone: no wait, no flag
    check_invariants(snapshot(out), 24)


def _race(output: str) -> tuple[int, int]:
    """Two threads take the lock at the same moment; (wins, refusals)."""
    wins, losses = [], []
    start, done = threading.Barrier(2), threading.Barrier(2)

    def take() -> None:
        start.wait()
        try:
            with L.exclusive(output, Storage.from_env(), log=lambda m: None):
                wins.append(1)
                done.wait()  # both attempts are over before the winner lets go
        except L.OutputLocked:
            losses.append(1)
            done.wait()

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return len(wins), len(losses)


def test_exactly_one_of_two_racing_lockers_wins(tmp_path, s3_server) -> None:
    assert _race(str(tmp_path / "out")) == (1, 1)
    assert _race(s3_server.url("race", "out")) == (1, 1)


def test_s3_lock_refuses_frees_a_dead_local_holder_and_expires_a_silent_one(s3_server, monkeypatch) -> None:
    out = s3_server.url("locked", "out")
    store = Storage.from_env()
    holder = _holder(out, {**os.environ, **s3_server.env})
    try:
        with pytest.raises(L.OutputLocked, match=f"pid {holder.pid} on "):
            with L.exclusive(out, store, log=lambda m: None):
                pass
    finally:
        _kill(holder)
    logs: list[str] = []
    with L.exclusive(out, store, log=logs.append):  # its pid is dead on this host: taken over at once
        pass
    assert any("took over" in line for line in logs)

    # A holder on another machine that stopped renewing: refused within the lease, taken over after it.
    key = "locked/out/work/lock.json"
    client = s3_server.client()
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(L.OutputLocked, match="on elsewhere"):
        with L.exclusive(out, store, log=lambda m: None):
            pass
    monkeypatch.setattr(L, "LEASE_S", -1.0)  # every lock is past its lease now
    logs.clear()
    with L.exclusive(out, store, log=logs.append):
        assert (
            json.loads(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())["pid"]
            == os.getpid()
        )
    assert any("took over" in line for line in logs)
    with pytest.raises(client.exceptions.ClientError):  # released: the object is gone
        client.head_object(Bucket=s3_server.bucket, Key=key)
