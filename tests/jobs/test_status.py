"""``python -m jobs.status`` on run directories in S3 (the real SeaweedFS server), laid out by the
library's own writers: a build's committed parts, a training's checkpoints, a track's recorded steps.

A finished and a killed build and track, run for real, are in tests/pipeline/test_build_kill.py and
tests/jobs/test_track.py."""

from __future__ import annotations

import pyarrow as pa

from jobs.status import main, status_lines
from pipeline.common import storage
from pipeline.common.storage import Storage
from pipeline.config import BUILD_PRESETS
from pipeline.source import run_state as R


def test_half_finished_build_training_and_track_on_s3(s3_server, capsys):
    store = Storage.from_env(s3_server.endpoint)
    run = s3_server.url("status-run")
    paths = R.run_dirs(run)
    uids = [f"{i:032x}" for i in range(10)]
    store.write_json(R.fingerprint(BUILD_PRESETS["demo"], uids), paths["fingerprint"])
    for part, statuses in ((0, ["success", "success", "timeout"]), (2, ["success", "http_404"])):
        token = f"t{part}"
        rows = pa.table({"uid": uids[: len(statuses)], "status": statuses})
        store.write_parquet(rows, R.part_file(paths["parts"], part, token, "parquet"))
        store.write_bytes(b"", R.part_file(paths["parts"], part, token, "tar"))
        R.commit(paths["parts"], part, token, store)
    store.write_bytes(b"", R.part_file(paths["parts"], 1, "t1", "tar"))  # a part whose marker never came
    build = status_lines(run, store)
    assert build == [
        "build: a run in progress or interrupted; pool of 10 rows",
        "  2 download parts committed (0, 2), 5 rows in them by status: success 3, http_404 1, timeout 1",
        "  not done: the parts not committed, then dedupe, shards and subsets (re-run the same command)",
    ]
    train = storage.join(run, "train", "scorer")
    for step, loss in ((8, 4.7), (16, 4.61234)):
        metrics = {"step": step, "samples_seen": 32 * step, "loss/total": loss}
        store.write_json(metrics, storage.join(train, f"checkpoint_{step:08d}", "metrics.json"))
    state = {
        "config": {},
        "plan": ["build", "scorer", "score"],
        "build": {"n_input": 10},
        "timings": {"build": 12.4},
    }
    store.write_json(state, storage.join(run, "track_state.json"))
    assert main([run, "--s3-endpoint", s3_server.endpoint]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "track: 1 of 3 steps finished",
        "  done  build (12 s)",
        "  to do scorer",
        "  to do score",
        "  scorer: running or interrupted (no manifest.json yet); 2 checkpoint(s), the last at step 16 "
        "(512 samples seen, loss 4.6123)",
        f"    {train}/checkpoint_00000016",
        "report: not written yet",
    ]
    # a track's training has no manifest of its own: the track's state says whether the step finished
    assert status_lines(train, store)[0] == (
        f"training: running or interrupted (step scorer of the track {run}); 2 checkpoint(s), the last at "
        "step 16 (512 samples seen, loss 4.6123)"
    )
    store.write_json(
        {**state, "scorer": {"checkpoint": f"{train}/checkpoint_00000016"}},
        storage.join(run, "track_state.json"),
    )
    assert status_lines(train + "/", store)[0].startswith(
        f"training: finished (step scorer of the track {run});"
    )
