"""Elastic training that loses a worker: the run continues at the smaller world with the same schedule.

tests/training/train/elastic_driver.py (its own process: a local multi-node Ray cluster cannot share this
process with the suite's Ray) trains the demo model over (1, 2) workers with a global batch of 9 — rows
5 and 4 at two workers, uneven — and kills one of the two train nodes once a checkpoint is committed. Ray
Train restarts the worker group from that checkpoint with the node that is left. What must hold:

- every optimizer step 1..60 committed exactly once (``history``), the restart from the killed
  checkpoint's step (``attempts``), the last steps at world size 1 and the first at 2;
- the samples seen per step stay the global batch at both sizes, and the LR of every logged step is
  the schedule's (warmup then cosine over the same 60 steps): a resize changes neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.train_shards import write_demo_shards
from training.train.step import lr_lambda

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).with_name("elastic_driver.py")


@pytest.mark.ray
@pytest.mark.slow
def test_losing_a_worker_continues_at_the_smaller_world(tmp_path) -> None:
    from tests.training.train.elastic_driver import BATCH, EVERY, TOTAL

    shards = tmp_path / "shards"
    write_demo_shards(shards, n_shards=4, per_shard=60, size=32)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1"}  # fmt: skip
    log = tmp_path / "driver.log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, str(DRIVER), str(shards), str(tmp_path / "train")], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=540)  # fmt: skip
    assert done.returncode == 0, log.read_text()[-4000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("ELASTIC "))[8:])
    ret, killed = out["return_value"], out["killed_after"]
    killed_step = int(killed.split("_")[1])
    assert EVERY <= killed_step < TOTAL
    assert ret["history"] == [[1, TOTAL]]  # no committed step repeated or skipped
    assert (
        ret["attempts"][0] == 0 and killed_step <= ret["attempts"][-1] < TOTAL and len(ret["attempts"]) >= 2
    )
    assert ret["world_size"] == 1 and ret["final_step"] == TOTAL
    metrics = ret["metrics"]
    assert [m["step"] for m in metrics] == list(range(5, TOTAL + 1, 5))
    assert {m["world_size"] for m in metrics if m["step"] <= killed_step} == {2}
    assert metrics[-1]["world_size"] == 1
    schedule = lr_lambda(TOTAL, 5)
    for m in metrics:
        assert m["samples_seen"] == m["step"] * BATCH
        assert m["lr"] == pytest.approx(5e-4 * schedule(m["step"]), rel=1e-9), m["step"]
        assert m["skipped_steps"] == 0
