"""The random-kill suite of the build: 24 kill points (SIGKILL at a random occurrence of each point) across
a build from nothing, a ``retry_failed`` pass and a ``refresh_changed`` pass, each followed by a re-run
that must equal a clean build. The cases run in tests/faults/kill_harness.py, in a fresh interpreter
that forks one child per run; this test reads its report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_build_killed_at_any_point_resumes_into_a_clean_build(tmp_path) -> None:
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "tests.faults.kill_harness", str(report), str(tmp_path), "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=420, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report.read_text())
    assert report["reference"] == []  # the clean builds equal the whole-pool rules in one process
    cases = report["cases"]
    assert len(cases) >= 20 and {c["kind"] for c in cases} == {"fresh", "retry", "refresh"}
    failed = [f"{c['kind']} {c['point']}@{c['nth']}: {c['problems']}" for c in cases if c["problems"]]
    assert not failed, "\n".join(failed)
    assert all(c["first"] == "killed" and c["second"] == "finished" for c in cases)
    kinds = sorted({c["point"] for c in cases})
    print(f"{len(cases)} kill points ({', '.join(kinds)}): each resumed into the clean build")
