"""Ray's lines that say nothing to our users leave a job's output; every other line stays, in order.

A fresh process installs the filter as a job does (``jobs.common.quiet_ray``, which ``init_ray`` calls)
and then writes each kind of line the way its source does: Python logging to ``sys.stderr``, the C++ core
worker straight to file descriptor 2, a child process (the raylet's log monitor) to the inherited
descriptor 1, and Ray Train's ``RayDeprecationWarning`` after Ray's import. No Ray starts: the filter is the part under test, the lines are the
ones a local Ray 2.60 printed in ``make demo`` (docs/jobs.md, "What a job prints").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import os, subprocess, sys, warnings
import ray  # its import installs its own filter for RayDeprecationWarning, as in a job
from ray.util.annotations import RayDeprecationWarning
from jobs.common import quiet_ray
quiet_ray()
print("ours: step 1", flush=True)
print("2026-12-01 16:59:19,093\tWARNING authentication_token_setup.py:85 -- Token authentication is "
      "enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.", file=sys.stderr, flush=True)
os.write(2, b"[2026-12-01 17:00:33,152 E 25570 25570] core_worker.cc:2465: Actor with class name: "
            b"'MapWorker(MapBatches(_LangTag))' has constructor arguments in the object store and "
            b"max_restarts > 0. If the arguments go out of scope the restart will fail.\n")
print("ours: a real error line", file=sys.stderr, flush=True)
subprocess.run(["sh", "-c", "echo '(raylet) WARNING: 8 PYTHON worker processes have been started on node: "
                "abc with address: 127.0.0.1'; echo 'ours: from a child'"])
warnings.warn("`ExecutionOptions.exclude_resources` is deprecated and will be removed", RayDeprecationWarning)
print("2026 WARNING __init__.py:28 -- Progress bars disabled. To enable, set ...", file=sys.stderr)
print("ours: the end, unterminated", end="")
"""


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_ray_noise_is_filtered_and_every_other_line_kept():
    out = _run({})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ours: step 1\nours: from a child\nours: the end, unterminated"
    assert out.stderr == "ours: a real error line\n"


def test_prolip_ray_noise_1_keeps_everything():
    out = _run({"PROLIP_RAY_NOISE": "1"})
    assert "PYTHON worker processes have been started" in out.stdout
    for words in (
        "Token authentication is enabled",
        "has constructor arguments in the object store",
        "Progress bars disabled",
    ):
        assert words in out.stderr, words
    assert "exclude_resources" not in out.stderr  # Ray Train's own deprecation warning stays silenced
