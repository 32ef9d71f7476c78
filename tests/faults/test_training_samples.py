"""The training kill suite that compares samples (``data.exact_position``): a run on SeaweedFS S3 killed
(SIGKILL, pipeline/common/faults.py) at ten points placed by the code — after a step, mid-step (gradients
reduced, weights not updated), before the local save, mid local save, after it, mid S3 upload, after the
upload before the controller registers it, during a restore's download, after a restore — each followed
by Ray Train's restart from the latest registered checkpoint; and a run killed mid-epoch at two workers
and resumed at one (local storage). Each must end at the uninterrupted run's step with the same
(uid, epoch) multiset trained, step by step: the samples of every step of the final lineage
(``PROLIP_SAMPLES_TRACE``: for each step, the latest attempt that trained it) equal those of that step in
the uninterrupted run.

One uninterrupted run at two workers serves every comparison (a module fixture); the ten-kill run trains
at one worker (a restart starts one process, not two: the test's cost), so it also checks that a step's
samples do not depend on the world size. The model is the 32 px demo model, 120 samples in 3 shards,
7 steps of 16 an epoch (8 left over), 80 steps: twelve epochs (the last cut at step 3).
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from functools import reduce
from pathlib import Path

import pytest

from pipeline.common import faults
from pipeline.common.config import deep_update, merge, nested
from pipeline.common.storage import Storage
from tests.fixtures.train_shards import write_demo_shards
from training.config import TRAIN_PRESETS
from training.train.trainer import train

pytestmark = [pytest.mark.ray, pytest.mark.slow]
B, EVERY, STEPS, PER_EPOCH = 16, 2, 80, 7
SETS = {
    "model": "demo-32px", "global_batch_size": B, "tokenizer_vocab": 512, "optim.warmup_steps": 2,
    "samples_seen": STEPS * B, "data.exact_position": True, "data.shuffle_seed": 7, "data.shuffle_window": 24,
    "data.augment": False, "run.checkpoint_every": EVERY, "run.log_every": EVERY, "run.keep_checkpoints": 3,
    "scaling.num_workers": 2, "scaling.cpus_per_worker": 0.5,
}  # fmt: skip
# Ten kill points, each firing once, at its n-th occurrence in one process: late, so that the process's
# earlier checkpoints had time to register (a restart then resumes inside an epoch), early enough that all
# fire within 80 steps.
KILLS = (
    "train.step@9",
    "train.mid_step@10",
    "checkpoint.before_save@5",
    "checkpoint.save@5",
    "checkpoint.saved@5",
    "checkpoint.upload@36",  # a checkpoint is 8 files: inside the fifth upload
    "checkpoint.uploaded@5",
    "checkpoint.fetch@1",
    "checkpoint.restored@1",
    "train.step@11",
)
KILL_ENV = (faults.ARM, faults.STATE, faults.ORDERED, faults.SAMPLES)


def _nested(sets: dict) -> dict:
    """Dotted keys (``"run.name"``) as the nested mapping ``merge`` takes."""
    return reduce(deep_update, (nested(k, v) for k, v in sets.items()), {})


def trained(trace: Path) -> dict[int, Counter]:
    """Step → the (uid, epoch) multiset of its final lineage: the latest attempt that trained the step."""
    lines: dict[int, dict[int, list[tuple[str, int]]]] = defaultdict(lambda: defaultdict(list))
    for f in trace.glob("*-r*.txt"):
        attempt = int(f.name.split("-")[0])
        for line in f.read_text().splitlines():
            step, epoch, key = line.split()
            lines[int(step)][attempt].append((key, int(epoch)))
    return {step: Counter(by[max(by)]) for step, by in lines.items()}


def resume_steps(trace: Path) -> list[int]:
    """The step each attempt resumed from (the step before the first it trained), in attempt order."""
    first: dict[int, int] = {}
    for f in trace.glob("*-r*.txt"):
        attempt = int(f.name.split("-")[0])
        steps = [int(line.split()[0]) for line in f.read_text().splitlines()]
        if steps:
            first[attempt] = min(first.get(attempt, steps[0]), min(steps))
    return [first[a] - 1 for a in sorted(first)]


def _run(tmp: Path, shards: str, name: str, trace: Path, **sets) -> object:
    trace.mkdir(parents=True, exist_ok=True)
    os.environ[faults.SAMPLES] = str(trace)
    cfg = {**SETS, "data.shards": shards, "run.storage_path": str(tmp / "train"), "run.name": name}
    cfg.update(sets)
    return train(merge(TRAIN_PRESETS["demo"], _nested(cfg)))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("samples_shards")
    write_demo_shards(root, n_shards=3, per_shard=40, size=40)
    return str(root)


@pytest.fixture(scope="module")
def reference(ray_local, shards, tmp_path_factory, _fast_reports) -> Iterator[dict[int, Counter]]:
    """The uninterrupted run's samples, step by step."""
    tmp = tmp_path_factory.mktemp("reference")
    try:
        out = _run(tmp, shards, "reference", tmp / "trace")
    finally:
        os.environ.pop(faults.SAMPLES, None)
    assert out.return_value["final_step"] == STEPS
    steps = trained(tmp / "trace")
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(sum(c.values()) == B for c in steps.values())
    # every epoch trains 7 × 16 of its 120 rows, each at most once; epoch e's steps are 7e+1 … 7e+7
    for e in range(3):
        rows = sum((steps[s] for s in range(PER_EPOCH * e + 1, PER_EPOCH * (e + 1) + 1)), Counter())
        assert len(rows) == PER_EPOCH * B and {ep for _, ep in rows} == {e} and max(rows.values()) == 1
    yield steps


@pytest.fixture(scope="module", autouse=True)
def _fast_reports():
    """Reports (a barrier each) need not wait for the controller's default 2 s poll."""
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    yield
    os.environ.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)


def test_ten_kill_points_each_resume_into_the_uninterrupted_runs_samples(reference, shards, s3_server,
                                                                          tmp_path) -> None:  # fmt: skip
    state = tmp_path / "fired.txt"
    os.environ.update({faults.ARM: ",".join(KILLS), faults.STATE: str(state)})
    s3 = {"run.storage_path": s3_server.url("train"), "run.s3_endpoint": s3_server.endpoint}
    try:
        out = _run(
            tmp_path,
            shards,
            "sample_kills",
            tmp_path / "trace",
            **s3,
            **{"run.max_failures": len(KILLS) + 2, "scaling.num_workers": 1},
        )
    finally:
        for k in KILL_ENV:
            os.environ.pop(k, None)
    fired = state.read_text().split()
    assert set(fired) == set(KILLS), fired  # both ranks may die at one step point: one restart
    extra = json.loads(Storage.from_env(s3_server.endpoint).read_bytes(f"{out.checkpoint_path}/extra.json"))
    assert extra["history"] == [[1, STEPS]] and out.return_value["final_step"] == STEPS
    assert extra["data_position"] == {
        "epoch": 11,
        "epoch_start_step": 77,
        "step_in_epoch": 3,
        "sample_index": 48,
    }
    steps = trained(tmp_path / "trace")
    assert steps == reference  # the (uid, epoch) multiset of every step, hence of the run
    resumed = resume_steps(tmp_path / "trace")[1:]  # every restart, those a later kill cut included
    inside = [s for s in resumed if s % PER_EPOCH]
    print(f"kills {fired}: restarts resumed at steps {resumed} (positions in their epoch "
          f"{[s % PER_EPOCH for s in resumed]}); every step's samples equal the uninterrupted run's")  # fmt: skip
    # Which checkpoint a restart finds depends on when the controller registered it; kills this late in a
    # process found one every time (8 of 8 restarts resumed inside an epoch, at positions 1 to 5).
    assert len(inside) >= 5, resumed


def test_a_run_killed_mid_epoch_resumes_at_another_world_size(reference, shards, tmp_path) -> None:
    state = tmp_path / "fired.txt"
    os.environ.update({faults.ARM: "train.step@9", faults.STATE: str(state)})  # step 9: epoch 1, position 2
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever Ray Train raises for a lost worker
            _run(tmp_path, shards, "resize", tmp_path / "trace", **{"run.max_failures": 0})
    finally:
        os.environ.pop(faults.ARM, None)
    assert state.read_text().split() == ["train.step@9"]
    try:
        out = _run(tmp_path, shards, "resize", tmp_path / "trace", **{"scaling.num_workers": 1})
    finally:
        for k in KILL_ENV:
            os.environ.pop(k, None)
    start = out.return_value["start_step"]  # 8, or 6 when step 8's checkpoint was not yet registered
    assert out.return_value["world_size"] == 1 and start in (6, 8), start
    extra = json.loads(Path(out.checkpoint_path, "extra.json").read_text())
    assert extra["history"] == [[1, STEPS]]
    assert trained(tmp_path / "trace") == reference
