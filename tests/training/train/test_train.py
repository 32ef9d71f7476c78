"""Training end to end on Ray Train, plus the loop's pure helpers.

The end-to-end test is one scenario, to pay Ray Train's start-up (≈20–30 s) as few times as possible:
a ``python -m jobs.train --preset demo`` driver (attached to the test's Ray) trains 40 steps of the tiny
model on 2 CPU workers with checkpoints every 10 steps on SeaweedFS ``s3://``; rank 1 raises at step 15
and FailureConfig(max_failures=1) restarts the group from checkpoint 10; once checkpoint 20 exists the
driver is SIGKILLed (its whole process group); a second driver with the same storage_path and name
resumes and finishes; a fresh process loads the final checkpoint with weights_only=True.

"No step repeated or skipped" is checked on the COMMITTED step sequence: each checkpoint carries the
run-length ranges of the optimizer steps that led to it (training/train/loop.py ``history``). Steps run after
the last checkpoint by an attempt that then died are lost and run again — expected — and do not appear;
the final history must be exactly [[1, 40]]. ``attempts`` lists the step each (re)start resumed from; the
driver is killed once Ray Train has *committed* checkpoint 20 (its snapshot file lists it — an uploaded
but unregistered checkpoint is rightly not resumed from), and the resume must start at the latest
committed checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.fixtures.train_shards import write_demo_shards
from training.train.step import extend_history, lr_lambda

ROOT = Path(__file__).resolve().parents[3]
TOTAL, EVERY, FAIL_AT = 40, 10, 15
METRIC_KEYS = {
    "loss/total", "loss/ppcl", "loss/inc_vt", "loss/inc_masked_v", "loss/inc_masked_t", "loss/vib_v",
    "loss/vib_t", "logit_scale", "logit_bias", "sigma2_image", "sigma2_text", "samples_per_s",
    "data_wait_fraction", "lr", "step", "epoch", "samples_seen",
}  # fmt: skip


def test_history_ranges_expose_repeats_and_gaps() -> None:
    h: list[list[int]] = []
    for s in (1, 2, 3, 4):
        extend_history(h, s)
    assert h == [[1, 4]]
    extend_history(h, 4)  # a repeat
    extend_history(h, 6)  # a gap
    assert h == [[1, 4], [4, 4], [6, 6]]


def test_train_workers_custom_resources_are_checked() -> None:
    """``scaling.resources``: custom Ray resources only, each above 0, named by key in one line."""
    from pipeline.common.config import ConfigError, merge
    from training.config import TRAIN_PRESETS

    cfg = merge(TRAIN_PRESETS["demo"], {"scaling": {"resources": {"train_slot": "1"}}})
    assert cfg.scaling.resources == {"train_slot": 1.0}
    with pytest.raises(ConfigError, match=r"scaling\.resources takes custom resources only .* \['GPU'\]"):
        merge(TRAIN_PRESETS["demo"], {"scaling": {"resources": {"GPU": "1"}}})
    with pytest.raises(ConfigError, match=r"scaling\.resources\.train_slot: input should be greater than 0"):
        merge(TRAIN_PRESETS["demo"], {"scaling": {"resources": {"train_slot": "0"}}})


def test_lr_warmup_then_cosine() -> None:
    f = lr_lambda(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def _driver(shards: str, name: str, s3, ray_address: str) -> subprocess.Popen:
    sets = {
        "global_batch_size": 32, "samples_seen": TOTAL * 32, "tokenizer_vocab": 512,
        "optim.warmup_steps": 5, "data.shuffle_window": 64, "data.decode_batch_size": 32,
        "run.storage_path": s3.url("train"), "run.name": name, "run.s3_endpoint": s3.endpoint,
        "run.checkpoint_every": EVERY, "run.log_every": 5, "run.keep_checkpoints": 2,
        "run.max_failures": 1, "run.fail_at_step": FAIL_AT, "run.fail_rank": 1,
    }  # fmt: skip
    args = [sys.executable, "-m", "jobs.train", "--preset", "demo", "--shards", shards]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    env = {**os.environ, **s3.env, "RAY_ADDRESS": ray_address, "PYTHONPATH": str(ROOT)}
    log = open(Path(shards).parent / f"driver-{time.time():.0f}.log", "wb")
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _checkpoints(s3, name: str) -> list[str]:
    listing = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=f"train/{name}/checkpoint_")
    return sorted(
        {o["Key"].split("/")[2] for o in listing.get("Contents", []) if o["Key"].endswith("extra.json")}
    )


def _committed(s3, name: str) -> list[str]:
    """Checkpoints Ray Train has registered (its snapshot file), not merely uploaded."""
    key = f"train/{name}/checkpoint_manager_snapshot.json"
    try:
        body = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    except Exception:  # not written yet
        return []
    return sorted(r["checkpoint_dir_name"] for r in json.loads(body)["checkpoint_results"])


def _wait(proc: subprocess.Popen, until, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if proc.poll() is not None:
            raise AssertionError(f"driver exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.slow
def test_demo_run_survives_worker_failure_and_driver_kill_on_s3(ray_local, s3_server, tmp_path) -> None:
    s3 = s3_server
    shards = tmp_path / "shards"
    write_demo_shards(shards, n_shards=8, per_shard=160)  # 1280 samples: one epoch covers 40 steps of 32
    name = f"kill-{uuid.uuid4().hex[:8]}"
    address = ray_local.address_info["address"]

    first = _driver(str(shards), name, s3, address)
    try:
        _wait(first, lambda: "checkpoint_00000020" in _committed(s3, name), 300, "checkpoint 20 committed")
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and anything it started in its session
        first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    time.sleep(2.0)  # the driver's actors die with it; anything they committed meanwhile counts
    resume_from = int(_committed(s3, name)[-1].split("_")[1])

    second = _driver(str(shards), name, s3, address)
    assert second.wait(timeout=300) == 0, shards.parent / "driver.log"

    final = _checkpoints(s3, name)[-1]
    assert final == f"checkpoint_{TOTAL:08d}"
    extra = json.loads(
        s3.client().get_object(Bucket=s3.bucket, Key=f"train/{name}/{final}/extra.json")["Body"].read()
    )
    # Committed steps: exactly 1..TOTAL, once each.
    assert extra["history"] == [[1, TOTAL]]
    # Fresh start, restart after rank 1 raised at step 15 (from checkpoint 10), resume after the kill.
    assert extra["attempts"][:2] == [0, EVERY]
    assert len(extra["attempts"]) == 3 and extra["attempts"][2] == resume_from >= 2 * EVERY
    metrics = extra["metrics"]
    assert [m["step"] for m in metrics] == list(range(5, TOTAL + 1, 5))
    for m in metrics:
        assert METRIC_KEYS <= set(m), METRIC_KEYS - set(m)
    assert metrics[-1]["loss/total"] < metrics[0]["loss/total"]
    assert 0 < metrics[-1]["sigma2_image"] < 1e-3 and 0 < metrics[-1]["sigma2_text"] < 1e-3
    assert 0 <= metrics[-1]["data_wait_fraction"] <= 1 and metrics[-1]["samples_per_s"] > 0

    # A fresh process downloads the final checkpoint and loads it without unpickling anything.
    code = f"""
import json, os, tempfile, torch
from pipeline.common import storage
from pipeline.common.storage import Storage
from training.model.checkpoint import load_checkpoint
src = "{s3.url("train", name, final)}"
with tempfile.TemporaryDirectory() as d:
    for f in ("weights.pt", "model_config.json", "extra.json", "tokenizer.json", "special_tokens.json",
              "train_state.pt"):
        open(os.path.join(d, f), "wb").write(Storage.from_env().read_bytes(storage.join(src, f)))
    model, cfg, tok = load_checkpoint(d)
    state = torch.load(os.path.join(d, "train_state.pt"), weights_only=True)
    print(json.dumps({{"params": sum(p.numel() for p in model.parameters()), "vocab": tok.vocab_size,
                      "opt_step": int(state["scheduler"]["last_epoch"])}}))
"""
    env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["params"] > 1_000_000 and loaded["vocab"] <= 512 and loaded["opt_step"] == TOTAL
    assert s3.client().head_object(Bucket=s3.bucket, Key=f"train/{name}/manifest.json")


def test_tensorboard_writer_writes_event_files(tmp_path) -> None:
    from training.train.loop import _tensorboard

    writer = _tensorboard(str(tmp_path))
    if writer is None:
        pytest.skip("neither torch.utils.tensorboard nor tensorboardX imports")
    writer.add_scalar("loss/total", 1.0, 1)
    writer.close()
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


@pytest.mark.ray
def test_cached_epochs_on_two_workers_commit_every_step(ray_local, tmp_path) -> None:
    """``data.cache_decoded``: epoch 0 from Ray Data (remainder kept), later epochs from each worker's rows;
    with salient masked captions (training/train/salient_masking.py) under DDP."""
    from pipeline.common.config import merge
    from training.config import TRAIN_PRESETS
    from training.train.trainer import train

    write_demo_shards(tmp_path / "shards", n_shards=2, per_shard=40, size=48)
    cfg = merge(
        TRAIN_PRESETS["demo"],
        {
            "model": "demo-32px", "global_batch_size": 32, "samples_seen": 8 * 32, "tokenizer_vocab": 512,
            "data": {"shards": str(tmp_path / "shards"), "augment": False, "cache_decoded": True,
                     "shuffle_seed": 0, "decode_batch_size": 16, "shuffle_window": 32,
                     # Two DDP workers: each step's salient captions come from the unwrapped model.
                     "text_mask_mode": "salient"},
            "optim": {"warmup_steps": 2},
            "run": {"storage_path": str(tmp_path / "train"), "name": "cached", "checkpoint_every": 8,
                    "log_every": 2},
        },
    )  # fmt: skip
    rv = train(cfg).return_value
    # 80 rows over 2 workers: 40 each = 2 steps of 16 per epoch (8 left over), so 8 steps take 4 epochs.
    assert rv["history"] == [[1, 8]] and rv["world_size"] == 2
    assert rv["cached_rows"] == 40 and rv["epoch"] == 4
    assert all(math.isfinite(m["loss/total"]) for m in rv["metrics"])


@pytest.mark.ray
def test_seeded_run_repeats_exactly(ray_local, tmp_path) -> None:
    """One seed, one worker, two runs: the same loss at every step (Ray Data's output order preserved)."""
    from pipeline.common.config import merge
    from training.config import TRAIN_PRESETS
    from training.train.trainer import train

    write_demo_shards(tmp_path / "shards", n_shards=4, per_shard=20, size=48)
    losses = []
    for run in ("first", "second"):
        cfg = merge(
            TRAIN_PRESETS["demo"],
            {
                "model": "demo-32px", "global_batch_size": 16, "samples_seen": 10 * 16, "tokenizer_vocab": 512,
                "data": {"shards": str(tmp_path / "shards"), "augment": False, "shuffle_seed": 3,
                         "decode_batch_size": 4, "shuffle_window": 8, "decode_tasks": 2,
                         "text_mask_mode": "salient"},  # the model's choice of words repeats too
                "scaling": {"num_workers": 1},
                "optim": {"warmup_steps": 2},
                "run": {"storage_path": str(tmp_path / "train"), "name": run, "checkpoint_every": 10,
                        "log_every": 1},
            },
        )  # fmt: skip
        losses.append([m["loss/total"] for m in train(cfg).return_value["metrics"]])
    assert len(losses[0]) == 10 and all(math.isfinite(v) for v in losses[0])
    assert losses[0] == losses[1]


@pytest.mark.ray
@pytest.mark.slow
def test_ctrl_c_aborts_with_one_line_and_the_run_resumes(ray_local, tmp_path) -> None:
    """SIGINT to a training driver: exit status 130 and one line saying how to resume (Ray Train alone
    leaves with a bare status 1); the same command then resumes from the last committed checkpoint."""
    shards, train_dir = tmp_path / "shards", tmp_path / "train"
    write_demo_shards(shards, n_shards=4, per_shard=160)
    sets = {
        "model": "demo-32px", "global_batch_size": 32, "samples_seen": TOTAL * 32, "tokenizer_vocab": 512,
        "optim.warmup_steps": 5, "data.shuffle_window": 64, "data.decode_batch_size": 32,
        "run.storage_path": str(train_dir), "run.name": "ctrl-c", "run.checkpoint_every": EVERY,
        "run.log_every": 5, "scaling.num_workers": 1,
    }  # fmt: skip
    args = [sys.executable, "-m", "jobs.train", "--preset", "demo", "--shards", str(shards)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    env = {**os.environ, "RAY_ADDRESS": ray_local.address_info["address"], "PYTHONPATH": str(ROOT)}
    snapshot = train_dir / "ctrl-c" / "checkpoint_manager_snapshot.json"

    def run(log: str) -> subprocess.Popen:
        out = open(tmp_path / log, "wb")
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    first = run("first.log")
    try:
        _wait(first, snapshot.exists, 300, "a committed checkpoint")
        first.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the driver
        assert first.wait(timeout=120) == 130
    finally:
        if first.poll() is None:
            first.kill()
    lines = (tmp_path / "first.log").read_text().splitlines()
    said = [ln for ln in lines if "interrupted" in ln]
    assert said == [
        "[train ctrl-c] interrupted: run aborted; the same command resumes from its last checkpoint"
    ]
    committed = json.loads(snapshot.read_text())["checkpoint_results"]
    resume_from = int(committed[-1]["checkpoint_dir_name"].split("_")[1])
    assert EVERY <= resume_from < TOTAL

    second = run("second.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-2000:]
    extra = json.loads((train_dir / "ctrl-c" / f"checkpoint_{TOTAL:08d}" / "extra.json").read_text())
    assert extra["history"] == [[1, TOTAL]] and extra["attempts"] == [0, resume_from]
