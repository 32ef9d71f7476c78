"""The jobs on real Ray clusters on 127.0.0.1: ``ray job submit``, autoscaling, placement by node labels.

1. A head started with ``ray start --head --block`` (tests/fixtures/ray_head.py): ``ray job submit
   --working-dir .`` of the demo build and of a tiny training run; exit code, job status, outputs.
2. Autoscaling with Ray's fake multi-node provider and our cluster/fake_cluster.yaml: a head with no task
   CPUs and one worker type (min 0) — the tiny training job makes the autoscaler launch a worker node,
   succeeds, and the node is released after the idle timeout.
3. Placement: a ``ray.cluster_utils.Cluster`` with a ``prolip-role=data`` and a ``prolip-role=train``
   node; the build and the training run with label selectors, and Ray's state API shows where each task
   and actor ran. It runs in a fresh interpreter (``_placement_scenario``) so its driver never meets the
   session's shared local Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config import BUILD_PRESETS
from pipeline.schema import is_valid_uid, u8pairs_to_uids
from tests.fixtures.ray_head import BIN, ROOT, base_env, free_ports, ray_head, start_head, stop_head  # noqa: F401
from tests.fixtures.train_shards import write_demo_shards

TINY_STEPS, TINY_BATCH = 8, 32


def tiny_train_args(shards: Path, storage: Path, name: str, extra: tuple[str, ...] = ()) -> list[str]:
    sets = {
        "samples_seen": TINY_STEPS * TINY_BATCH, "global_batch_size": TINY_BATCH, "tokenizer_vocab": 512,
        "optim.warmup_steps": 2, "data.shuffle_window": 64, "data.decode_batch_size": 32,
        "run.storage_path": str(storage), "run.name": name, "run.checkpoint_every": 4,
        "run.log_every": 4, "run.tensorboard": "false",
    }  # fmt: skip
    args = ["python", "-m", "jobs.train", "--preset", "demo", "--shards", str(shards)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    for s in extra:
        args += ["--set", s]
    return args


def build_args(output: Path, n: int, extra: tuple[str, ...] = ()) -> list[str]:
    args = ["python", "-m", "jobs.build_dataset", "--preset", "demo"]
    for s in (f"demo_n={n}", f"output={output}", *extra):
        args += ["--set", s]
    return args


def job_status(head, submission_id: str) -> str:
    """The job's status from the job REST API (what ``ray job status`` prints)."""
    req = urllib.request.Request(f"{head.dashboard_url}/api/jobs/{submission_id}")
    req.add_header("Authorization", "Bearer " + head.env["RAY_AUTH_TOKEN"])
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["status"]


def check_train_outputs(storage: Path, name: str) -> None:
    run = storage / name
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["jobs"]["train"]["counts"]["steps"] == TINY_STEPS
    assert (run / f"checkpoint_{TINY_STEPS:08d}").is_dir()


def state_api(url: str, what: str, token: str | None) -> list[dict]:
    req = urllib.request.Request(f"{url}/api/v0/{what}?limit=10000&detail=true")
    if token:
        req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = json.loads(resp.read())
    return body["data"]["result"]["result"]


# --- 1. ray job submit on a plain head ----------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_submit_demo_build_and_tiny_training(ray_head, tmp_path) -> None:
    out = tmp_path / "build"
    res = ray_head.submit(build_args(out, 100), extra=["--submission-id", "build-demo"], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert job_status(ray_head, "build-demo") == "SUCCEEDED"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["jobs"]["build_dataset"]["counts"]["input_rows"] == 100
    status = pq.read_table(out / "metadata" / "status.parquet")
    assert status.num_rows == 100 and "success" in set(status.column("status").to_pylist())
    # One subset per filter of the demo preset, each a DataComp u8,u8 array; the default scope is DataComp's
    # (every valid metadata uid that passes), so no_filter lists the whole pool, the undownloaded rows too.
    expected = sorted(f"{name}.npy" for name in BUILD_PRESETS["demo"].filters.names)
    assert sorted(p.name for p in (out / "subsets").glob("*.npy")) == expected
    assert BUILD_PRESETS["demo"].filters.subset_scope == "metadata"
    no_filter = np.load(out / "subsets" / "no_filter.npy")
    pool = {u for u in status.column("uid").to_pylist() if is_valid_uid(u)}
    assert no_filter.dtype == np.dtype("u8,u8") and set(u8pairs_to_uids(no_filter)) == pool
    assert len(pool) > sum(s == "success" for s in status.column("status").to_pylist())
    assert list((out / "shards").glob("*.tar"))

    shards = tmp_path / "shards"
    write_demo_shards(shards, 2, 64)
    storage = tmp_path / "train"
    args = tiny_train_args(shards, storage, "submitted")
    res = ray_head.submit(args, extra=["--submission-id", "train-tiny"], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert job_status(ray_head, "train-tiny") == "SUCCEEDED"
    check_train_outputs(storage, "submitted")


# --- 2. autoscaling on the fake multi-node provider ---------------------------------------------------


def _workers(head) -> list[dict]:
    nodes = state_api(head.dashboard_url, "nodes", head.env["RAY_AUTH_TOKEN"])
    return [n for n in nodes if not n.get("is_head_node")]


@pytest.mark.ray
@pytest.mark.slow
def test_fake_cluster_scales_up_for_training_and_releases_idle_nodes(tmp_path) -> None:
    config = yaml.safe_load((ROOT / "cluster" / "fake_cluster.yaml").read_text())
    (gcs_port,) = free_ports(1)
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"
    config_path = tmp_path / "fake_cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # Autoscaler v1: the v2 monitor merges the config with provider defaults that the wheel lacks for
    # this provider (fake_multi_node/example.yaml), so it cannot start here.
    env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_enable_autoscaler_v2": "0"}
    head = start_head(
        num_cpus=0, extra_env=env, gcs_port=gcs_port, extra_args=[f"--autoscaling-config={config_path}"]
    )
    try:
        assert _workers(head) == []  # min_workers 0: nothing before there is demand
        shards = tmp_path / "shards"
        write_demo_shards(shards, 2, 64)
        storage = tmp_path / "train"
        res = head.submit(
            tiny_train_args(shards, storage, "autoscaled"), extra=["--submission-id", "autoscaled"]
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert job_status(head, "autoscaled") == "SUCCEEDED"
        check_train_outputs(storage, "autoscaled")
        # The head has no task CPUs, so every training task ran on nodes the autoscaler launched.
        launched = _workers(head)
        assert launched, "the autoscaler launched no worker node"
        assert all(n["labels"].get("prolip-role") == "data" for n in launched)
        deadline = time.monotonic() + 90
        while any(n["state"] == "ALIVE" for n in _workers(head)):
            assert time.monotonic() < deadline, f"idle nodes not released: {_workers(head)}"
            time.sleep(1.0)
    finally:
        stop_head(head)


# --- 3. placement by node labels ----------------------------------------------------------------------


def _placement_scenario(work: str) -> None:
    """In a fresh interpreter: a Cluster with labelled nodes, the build and a training run, then where
    their tasks and actors ran (``placement.json``)."""
    import ray
    from ray.cluster_utils import Cluster

    from jobs import build_dataset, train

    work_dir = Path(work)
    dash, gcs, agent = free_ports(3)
    ray_dir = tempfile.mkdtemp(prefix="prolip-ray-")  # short: unix socket paths must stay < 108 bytes
    common = dict(node_ip_address="127.0.0.1", object_store_memory=150 * 1024**2)
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=0, labels={"prolip-role": "head"}, include_dashboard=True, dashboard_host="127.0.0.1",
            dashboard_port=dash, gcs_server_port=gcs, dashboard_agent_listen_port=agent,
            temp_dir=ray_dir, **common,
        ),
    )  # fmt: skip
    try:
        data = cluster.add_node(num_cpus=2, labels={"prolip-role": "data"}, **common)
        trainer = cluster.add_node(num_cpus=1, labels={"prolip-role": "train"}, **common)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        sel = "prolip-role=data"
        argv = build_args(work_dir / "build", 120, (f"data_label_selector.{sel}",))[3:]
        assert build_dataset.main(argv) == 0
        shards = work_dir / "shards"
        write_demo_shards(shards, 2, 64)
        extra = (f"data.label_selector.{sel}", "scaling.label_selector.prolip-role=train")
        assert train.main(tiny_train_args(shards, work_dir / "train", "placed", extra)[3:]) == 0
        url = f"http://127.0.0.1:{dash}"
        token = os.environ.get("RAY_AUTH_TOKEN")
        time.sleep(2.0)  # task events reach the GCS in batches
        report = {
            "nodes": {"data": data.node_id, "train": trainer.node_id, "head": cluster.head_node.node_id},
            "tasks": [
                {k: t.get(k) for k in ("name", "func_or_class_name", "type", "node_id", "state")}
                for t in state_api(url, "tasks", token)
            ],
            "actors": [
                {k: a.get(k) for k in ("class_name", "name", "node_id", "state")}
                for a in state_api(url, "actors", token)
            ],
        }
        (work_dir / "placement.json").write_text(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
def test_build_and_train_stages_land_on_labelled_nodes(tmp_path) -> None:
    (tmp_path / "ray").mkdir()  # RAY_TMPDIR keeps the Cluster's address file out of the shared /tmp/ray
    env = {**base_env(), "RAY_TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = f"from tests.cluster.test_cluster_submit import _placement_scenario; _placement_scenario({str(tmp_path)!r})"
    log = tmp_path / "placement.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert rc == 0, log.read_text()[-4000:]
    report = json.loads((tmp_path / "placement.json").read_text())
    node_name = {v: k for k, v in report["nodes"].items()}

    # The data plane's work in this driver: every normal task, every task of a Ray Data map actor pool —
    # reads, maps, the language-ID actor, of the build and of the training ingest — and the calls of the
    # build's download actors (plain Ray actors, pipeline/download/phase.py).
    # Left out: Ray 2.60's hash-shuffle map and reduce tasks (its shuffle operators pass no label
    # selector) and its parquet footer-reader actors (scheduled SPREAD); Ray's, not ours to place.
    data_tasks = [
        (t["name"], node_name.get(t["node_id"], t["node_id"]))
        for t in report["tasks"]
        if t["node_id"]
        and (t["type"] == "NORMAL_TASK" or (t["name"] or "").startswith(("MapWorker(", "DownloadPart.")))
        and not (t["name"] or "").startswith("HashShuffle")
    ]
    wrong = [t for t in data_tasks if t[1] != "data"]
    assert not wrong, wrong
    ran = {name.split("(")[0].split("->")[0] for name, _ in data_tasks}
    # The build reads its metadata in the driver (pyarrow): its Ray Data work is the two actor pools.
    for stage in ("MapWorker", "ReadShard", "MapBatches"):
        assert stage in ran, (stage, sorted(ran))
    for udf in ("DownloadPart", "_LangTag", "decode_augment"):
        assert any(udf in n for n, _ in data_tasks), (udf, sorted(ran))
    downloaders = [a for a in report["actors"] if a["class_name"] == "DownloadPart"]
    assert downloaders and {node_name.get(a["node_id"]) for a in downloaders} == {"data"}, downloaders
    workers = [a for a in report["actors"] if a["class_name"] == "RayTrainWorker"]
    assert len(workers) == 2 and {node_name.get(a["node_id"]) for a in workers} == {"train"}
