"""Kill points armed with a state file fire once across processes, also when several reach them at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.common import faults

_RANK = """
import os, sys, time
from pathlib import Path
from pipeline.common import faults
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.001)
faults.point("train.step")
faults.point("train.step")
"""


def test_ranks_reaching_an_armed_point_together_lose_exactly_one_process(tmp_path: Path) -> None:
    state, go = tmp_path / "fired.txt", tmp_path / "go"
    env = {**os.environ, faults.ARM: "train.step@2", faults.STATE: str(state)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(go)], env=env) for _ in range(8)]
    time.sleep(1.0)  # every rank imported and waiting
    go.touch()
    codes = sorted(p.wait(timeout=60) for p in ranks)
    assert codes == [-signal.SIGKILL] + [0] * 7
    assert state.read_text().split() == ["train.step@2"]


def test_a_point_not_armed_or_already_fired_lets_the_process_go_on(tmp_path: Path, monkeypatch) -> None:
    state = tmp_path / "fired.txt"
    state.write_text("train.step@1\n")
    monkeypatch.setenv(faults.ARM, "train.step@1")
    monkeypatch.setenv(faults.STATE, str(state))
    monkeypatch.setattr(faults, "_hits", {})
    faults.point("train.step")  # fired by another process: this one lives
    faults.point("other")
    assert state.read_text().split() == ["train.step@1"]
