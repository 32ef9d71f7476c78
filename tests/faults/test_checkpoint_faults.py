"""Failure 1 and the training kills: checkpoints that cannot collide, kills during a save and an upload.

On main, a run (checkpoint every 10, keep 2) whose registered ``checkpoint_00000040`` had a truncated
``weights.pt`` fell back to step 30, wrote ``checkpoint_00000040`` again into the corrupt one's directory
and died at step 60 with Ray Train's ``Path not found``; the fallback warning never reached the console.
Here one Ray Train run on local storage is killed (SIGKILL of a worker, pipeline/common/faults.py) while
rank 0 writes checkpoint 20 and again half-way through the upload of checkpoint 30, restarts each time
from the last registered checkpoint, and finishes with every step committed once; each restore
downloads one copy per node (two workers here); a bad picture is counted once over four epochs. The run
directory is then copied to SeaweedFS S3, its latest checkpoint truncated, and ``jobs.train`` resumed
there to step 60, killed once more mid-upload: the corrupt checkpoint is deregistered and set aside
before training (one line on the console and in the manifest), no directory is written twice, and the
run ends at step 60 with the samples of steps 1..60 seen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jobs import train as train_job
from pipeline.common import faults
from pipeline.common.config import merge
from pipeline.shards.writer import write_shard
from tests.fixtures.s3_server import s3_server  # noqa: F401
from tests.fixtures.train_shards import demo_samples, write_demo_shards
from training.config import TRAIN_PRESETS
from training.train.trainer import train

pytestmark = [pytest.mark.ray, pytest.mark.slow]
B, EVERY = 32, 10
SETS = {
    "model": "demo-32px", "global_batch_size": B, "tokenizer_vocab": 512, "optim.warmup_steps": 2,
    "data.shuffle_window": 64, "data.decode_batch_size": 32, "data.augment": False,
    "run.checkpoint_every": EVERY, "run.log_every": EVERY, "run.keep_checkpoints": 2,
    "scaling.num_workers": 2, "scaling.cpus_per_worker": 0.5, "data.decode_cpus": 0.5,
}  # fmt: skip


def _shards(root: Path) -> str:
    """320 samples (10 steps of 32 per epoch), one of them a picture that does not decode."""
    write_demo_shards(root, n_shards=3, per_shard=96, size=48)
    rest = demo_samples(32, size=48, seed=1)
    rest[5]["jpg"] = b"\xff\xd8 not a picture"
    write_shard(str(root / "00000003.tar"), rest)
    return str(root)


def _nested(sets: dict) -> dict:
    out: dict = {}
    for key, value in sets.items():
        *head, last = key.split(".")
        node = out
        for h in head:
            node = node.setdefault(h, {})
        node[last] = value
    return out


def _extra(run: Path, name: str) -> dict:
    return json.loads((run / name / "extra.json").read_text())


def test_kills_during_save_and_upload_then_a_corrupt_latest_on_s3(ray_local, s3_server, tmp_path, monkeypatch,
                                                                 capfd) -> None:  # fmt: skip
    shards = _shards(tmp_path / "shards")
    trace, state = tmp_path / "trace.txt", tmp_path / "fired.txt"
    monkeypatch.setenv(faults.ARM, "checkpoint.save@2,checkpoint.upload@12")
    monkeypatch.setenv(faults.STATE, str(state))
    monkeypatch.setenv(faults.TRACE, str(trace))
    sets = {**SETS, "samples_seen": 40 * B, "data.shards": shards, "run.max_failures": 2,
            "run.storage_path": str(tmp_path / "train"), "run.name": "kills"}  # fmt: skip
    out = train(merge(TRAIN_PRESETS["demo"], _nested(sets)))
    run = tmp_path / "train" / "kills"
    assert state.read_text().split() == ["checkpoint.save@2", "checkpoint.upload@12"]  # both kills happened
    final = out.checkpoint_path.rsplit("/", 1)[-1]
    extra = _extra(run, final)
    assert final == "checkpoint_00000040" and extra["history"] == [[1, 40]]
    assert extra["attempts"] == [0, 10, 20]  # restarted from the last registered checkpoint each time
    assert extra["samples_seen"] == 40 * B
    # The cut upload left checkpoint_00000030 behind; the retrained step 30 went to a fresh directory.
    assert (run / "checkpoint_00000030").is_dir() and not (
        run / "checkpoint_00000030" / "checksums.json"
    ).exists()
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint_0"))
    assert names == ["checkpoint_00000030", "checkpoint_00000030.1", "checkpoint_00000040"], names
    fetches = trace.read_text().split().count("checkpoint.fetch")
    print(f"restores: 2, downloads: {fetches} (2 workers on one node); "
          f"bad images counted: {out.ingest['bad_images']} over 4 epochs")  # fmt: skip
    assert fetches == 2
    assert out.ingest["bad_images"] == 1

    # --- the same run on S3, its latest checkpoint truncated, resumed to step 60 by the job ------------
    client, bucket = s3_server.client(), s3_server.bucket
    for p in sorted(run.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, f"train/kills/{p.relative_to(run)}")
    key = "train/kills/checkpoint_00000040/weights.pt"
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=body[: len(body) // 3])
    monkeypatch.setenv(faults.ARM, "checkpoint.upload@3")  # the first upload after the resume is cut
    argv = ["--preset", "demo", "--set", f"samples_seen={60 * B}", "--set", f"data.shards={shards}",
            "--set", f"run.storage_path={s3_server.url('train')}", "--set", "run.name=kills",
            "--set", f"run.s3_endpoint={s3_server.endpoint}", "--set", "run.max_failures=1"]  # fmt: skip
    for k, v in SETS.items():
        argv += ["--set", f"{k}={v}"]
    capfd.readouterr()
    assert train_job.main(argv) == 0
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "is corrupt" in line]
    assert len(said) == 1 and "checkpoint_00000040" in said[0] and "deregistered" in said[0], err[-2000:]
    listing = client.list_objects_v2(Bucket=bucket, Prefix="train/kills/")["Contents"]
    dirs = sorted({o["Key"].split("/")[2] for o in listing if o["Key"].count("/") >= 3})
    assert any(d.startswith("corrupt-checkpoint_00000040-") for d in dirs), dirs
    snapshot = json.loads(
        client.get_object(Bucket=bucket, Key="train/kills/checkpoint_manager_snapshot.json")["Body"].read()
    )
    registered = [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]]
    assert registered[-1] == "checkpoint_00000060" and len(registered) == 2
    manifest = json.loads(client.get_object(Bucket=bucket, Key="train/kills/manifest.json")["Body"].read())
    assert [w for w in manifest["extra"]["checkpoint_warnings"] if "is corrupt" in w] == said_lines(said)
    final = json.loads(
        client.get_object(Bucket=bucket, Key="train/kills/checkpoint_00000060/extra.json")["Body"].read()
    )
    assert final["history"] == [[1, 60]] and final["samples_seen"] == 60 * B
    assert final["attempts"][:3] == [0, 10, 20] and final["attempts"][3] == 30  # resumed from 30, not 40


def said_lines(said: list[str]) -> list[str]:
    return [line.split("] ", 1)[1] for line in said]


@pytest.fixture(autouse=True)
def _no_kill_env_leaks(monkeypatch):
    yield
    for k in (faults.ARM, faults.STATE, faults.TRACE):
        os.environ.pop(k, None)
