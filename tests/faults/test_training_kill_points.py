"""The training half of the random-kill suite: a Ray Train run on SeaweedFS S3 killed (SIGKILL,
pipeline/common/faults.py) at three points drawn at random (seeded, printed): mid-epoch after a step,
while rank 0 writes a checkpoint, and half-way through a checkpoint's S3 upload; the n-th process of the
run dies at the n-th point (``PROLIP_KILL_ORDERED``), so every kill happens whatever the timing.

Which checkpoints Ray Train has registered when a kill lands depends on timing (its controller collects
reports every 2 s), so the test asserts what must hold for every timing: the run finishes at the last
step with one contiguous step history and the samples of every step seen once, every restart began at a
checkpoint step, every registered checkpoint is whole and a cut one never registered, no checkpoint
directory was written twice, each restore downloaded one copy per node (two workers, one node), and a
picture that does not decode is counted once over four epochs.

The run directory is then copied to local storage, its latest checkpoint truncated, and ``jobs.train``
resumed there to step 60: the corrupt checkpoint is deregistered and set aside before training (one line
on the console and in the manifest), no directory is written twice, and the run ends at step 60 with the
samples of steps 1..60 seen. On main before this, a run (checkpoint every 10, keep 2) whose registered
``checkpoint_00000040`` had a truncated ``weights.pt`` fell back to step 30, wrote ``checkpoint_00000040``
again into the corrupt one's directory and died at step 60 with Ray Train's ``Path not found``. The local
save and upload cut by a kill, and a kill during a restore's download: tests/faults/test_checkpoint_files.py.
"""

from __future__ import annotations

import json
import os
import random
from functools import reduce
from pathlib import Path

import pytest

from jobs import train as train_job
from pipeline.common import faults
from pipeline.common.config import deep_update, merge, nested
from pipeline.common.storage import Storage
from pipeline.shards.writer import write_shard
from tests.fixtures.train_shards import demo_samples, write_demo_shards
from training.config import TRAIN_PRESETS
from training.train.run_checkpoints import SNAPSHOT_FILE, listing_problem, stale_local_saves
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
    """Dotted keys (``"run.name"``) as the nested mapping ``merge`` takes."""
    return reduce(deep_update, (nested(k, v) for k, v in sets.items()), {})


def _extra(run: Path, name: str) -> dict:
    return json.loads((run / name / "extra.json").read_text())


def draw_kills(seed: int) -> list[str]:
    """Three kill points in process order: after step t of the first process (t in 15..19, past the first
    checkpoint), at the second save of the next, at the u-th upload of the third (u in 9..16: inside its
    second checkpoint's files, 8 a checkpoint)."""
    rng = random.Random(seed)
    return [
        f"train.step@{rng.randint(15, 19)}",
        "checkpoint.save@2",
        f"checkpoint.upload@{rng.randint(9, 16)}",
    ]


def test_kills_at_a_step_a_save_and_an_s3_upload_then_a_corrupt_latest_resumed(ray_local, s3_server, tmp_path,
                                                                               monkeypatch, capfd) -> None:  # fmt: skip
    shards = _shards(tmp_path / "shards")
    trace, state = tmp_path / "trace.txt", tmp_path / "fired.txt"
    seed = int(os.environ.get("PROLIP_KILL_SEED", "0"))
    kills = draw_kills(seed)
    print(f"seed {seed}: kills {kills}")
    monkeypatch.setenv(faults.ARM, ",".join(kills))
    monkeypatch.setenv(faults.ORDERED, "1")
    monkeypatch.setenv(faults.STATE, str(state))
    monkeypatch.setenv(faults.TRACE, str(trace))
    sets = {**SETS, "samples_seen": 40 * B, "data.shards": shards, "run.max_failures": 3,
            "run.storage_path": s3_server.url("train"), "run.s3_endpoint": s3_server.endpoint,
            "run.name": "kills"}  # fmt: skip
    out = train(merge(TRAIN_PRESETS["demo"], _nested(sets)))
    client, bucket = s3_server.client(), s3_server.bucket
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="train/kills/")["Contents"])

    def read(key: str) -> dict:
        return json.loads(client.get_object(Bucket=bucket, Key=f"train/kills/{key}")["Body"].read())

    # Every kill happened, in order (both ranks may die at the same step: one restart).
    assert list(dict.fromkeys(state.read_text().split())) == kills
    final = out.checkpoint_path.rsplit("/", 1)[-1]
    extra = read(f"{final}/extra.json")
    # The cut upload may have been step 40's, so the final one may be checkpoint_00000040.1.
    assert final.startswith("checkpoint_00000040") and extra["history"] == [[1, 40]], (
        final,
        extra["history"],
    )
    assert extra["samples_seen"] == 40 * B
    attempts = extra["attempts"]  # the first step of each process in the final checkpoint's lineage
    assert attempts[0] == 0 and attempts == sorted(attempts) and all(a % EVERY == 0 for a in attempts), (
        attempts
    )
    assert len(attempts) <= 4 and attempts[-1] < 40

    dirs = sorted(
        {k.split("/")[2] for k in keys if k.count("/") >= 3 and k.split("/")[2].startswith("checkpoint_")}
    )
    fs, run_path = Storage.from_env(s3_server.endpoint).resolve(s3_server.url("train", "kills"))
    problems = {d: listing_problem(fs, f"{run_path}/{d}") for d in dirs}
    registered = [r["checkpoint_dir_name"] for r in read(SNAPSHOT_FILE)["checkpoint_results"]]
    assert registered[-1] == final and all(problems[d] is None for d in registered), (registered, problems)
    # The upload the kill cut (and one a step kill may have cut on rank 0): no checksums.json, never read.
    cut = [d for d, p in problems.items() if p is not None]
    assert cut and all("no checksums.json" in problems[d] for d in cut), problems
    # Each whole directory holds one save: its extra.json names its own step (none was written twice).
    for d in dirs:
        if problems[d] is None:
            assert read(f"{d}/extra.json")["step"] == int(d.split("_")[1].split(".")[0]), d

    points = trace.read_text().split()
    restores, fetches = points.count("checkpoint.restored"), points.count("checkpoint.fetch")
    assert restores % 2 == 0 and fetches == restores // 2, (restores, fetches)  # one download per node
    print(f"kills {kills}: lineage restarts {attempts}, checkpoints {dirs} (registered {registered}, cut {cut}), "
          f"restores {restores // 2} with {fetches} downloads (2 workers, 1 node); "
          f"bad images counted: {out.ingest['bad_images']} over 4 epochs")  # fmt: skip
    assert out.ingest["bad_images"] == 1
    before_final = read(f"{registered[-2]}/extra.json")
    assert before_final["step"] == 30, registered
    # The local saves the kills cut were removed by later saves on this host (none is left to fill /tmp).
    assert not stale_local_saves(), stale_local_saves()

    # --- the same run copied to local storage, its latest checkpoint truncated, resumed to 60 by the job
    run = tmp_path / "train" / "kills"
    for key in keys:
        if key.endswith("/"):  # a directory marker object, no file
            continue
        dest = run / key.split("/", 2)[2]
        dest.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(dest))
    weights = run / final / "weights.pt"
    cut_size = weights.stat().st_size // 3
    weights.write_bytes(weights.read_bytes()[:cut_size])
    for k in (faults.ARM, faults.STATE, faults.TRACE, faults.ORDERED):
        monkeypatch.delenv(k)
    argv = ["--preset", "demo", "--set", f"samples_seen={60 * B}", "--set", f"data.shards={shards}",
            "--set", f"run.storage_path={tmp_path / 'train'}", "--set", "run.name=kills"]  # fmt: skip
    for k, v in SETS.items():
        argv += ["--set", f"{k}={v}"]
    capfd.readouterr()
    assert train_job.main(argv) == 0
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "is corrupt" in line]
    assert len(said) == 1 and final in said[0] and "deregistered" in said[0], err[-2000:]
    assert len(list(run.glob(f"corrupt-{final}-*"))) == 1 and not (run / final / "weights.pt").exists()
    registered = [
        r["checkpoint_dir_name"] for r in json.loads((run / SNAPSHOT_FILE).read_text())["checkpoint_results"]
    ]
    assert registered == ["checkpoint_00000050", "checkpoint_00000060"], registered
    manifest = json.loads((run / "manifest.json").read_text())
    assert [w for w in manifest["jobs"]["train"]["checkpoint_warnings"] if "is corrupt" in w] == said_lines(
        said
    )
    resumed = _extra(run, "checkpoint_00000060")
    assert resumed["history"] == [[1, 60]] and resumed["samples_seen"] == 60 * B
    assert resumed["attempts"] == [*before_final["attempts"], 30]  # resumed from 30, not from the corrupt 40
    # The retrained step 40 went to a directory of its own: the set-aside one still holds the cut weights.
    (aside,) = run.glob(f"corrupt-{final}-*")
    assert (aside / "weights.pt").stat().st_size == cut_size


def said_lines(said: list[str]) -> list[str]:
    return [line.split("] ", 1)[1] for line in said]


@pytest.fixture(autouse=True)
def _no_kill_env_leaks(monkeypatch):
    yield
    for k in (faults.ARM, faults.STATE, faults.TRACE, faults.ORDERED):
        os.environ.pop(k, None)
