"""A private Ray head on 127.0.0.1, started as ``ray start --head --block`` in its own process group.

``start_head(num_cpus, ...)`` returns a ``Head`` with the job-submission address and the environment a
client (``ray job submit``, a driver) needs; ``stop_head`` ends the whole process group (SIGTERM, then
SIGKILL). Everything binds to 127.0.0.1 on free ports; ``--temp-dir`` is a fresh directory, removed after.

Auth: the head and its clients run with ``RAY_AUTH_MODE=token`` and a fresh random ``RAY_AUTH_TOKEN`` in
the environment, so nothing is read from or written to ``~/.ray`` and another cluster's token is never
used. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes every node and driver that the head spawns (the fake
autoscaler's worker nodes included) pick 127.0.0.1 instead of the machine's outward address.
Fixture ``ray_head``: one head with 2 CPUs per test module.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass
class Head:
    proc: subprocess.Popen
    gcs_address: str  # 127.0.0.1:port
    dashboard_url: str  # http://127.0.0.1:port, the job-submission address
    temp_dir: str
    env: dict[str, str] = field(default_factory=dict)  # for clients: auth, PATH, RAY_ADDRESS
    log: str = ""

    def submit(self, entrypoint: list[str], timeout: float = 300, extra: list[str] | None = None):
        """``ray job submit --working-dir <repo> [extra] -- entrypoint`` from the repository root."""
        cmd = [str(BIN / "ray"), "job", "submit", "--working-dir", str(ROOT), *(extra or []), "--"]
        return subprocess.run(
            cmd + entrypoint, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(24),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        NO_ALBUMENTATIONS_UPDATE="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # `python` in entrypoints = this venv
    )
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def start_head(
    num_cpus: int = 2,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    object_store_bytes: int = 300 * 1024**2,
    gcs_port: int = 0,
    timeout: float = 90,
) -> Head:
    """Start the head and wait until its job API answers."""
    # A short private directory: Ray's unix socket paths under it must stay within 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="prolip-ray-"))
    gcs, dash, client, agent, agent_grpc, rt_env, metrics, nm, om = free_ports(9)
    gcs = gcs_port or gcs
    env = base_env()
    env.update(extra_env or {})
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={gcs}", f"--temp-dir={temp_dir}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rt_env}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
        f"--num-cpus={num_cpus}", f"--object-store-memory={object_store_bytes}",
        *(extra_args or []),
    ]  # fmt: skip
    log = str(temp_dir / "head.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=temp_dir
        )
    url = f"http://127.0.0.1:{dash}"
    head = Head(proc, f"127.0.0.1:{gcs}", url, str(temp_dir), {**env, "RAY_ADDRESS": url}, log)
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(
        url + "/api/version", headers={"Authorization": "Bearer " + env["RAY_AUTH_TOKEN"]}
    )
    while True:
        if proc.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-3000:]
            stop_head(head)
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                if resp.status == 200:
                    return head
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = Path(log).read_text(errors="replace")[-3000:]
            stop_head(head)
            raise TimeoutError(f"head did not answer at {url} within {timeout:.0f}s:\n{tail}")
        time.sleep(0.5)


def stop_head(head: Head, grace_s: float = 20) -> None:
    """SIGTERM the head's process group (``ray start --block`` then stops its services), SIGKILL after."""
    try:
        os.killpg(head.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        head.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.proc.pid, signal.SIGKILL)  # whatever of the group outlived the graceful stop
    except ProcessLookupError:
        pass
    head.proc.wait(timeout=10)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    head = start_head(num_cpus=2)
    yield head
    stop_head(head)
