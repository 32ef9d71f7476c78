"""Autoscaling by node labels: autoscaler v2 on Ray's fake multi-node provider (cluster/fake_cluster.yaml).

The head runs in one host of the namespace harness (tests/fixtures/netns_cluster.py), so its GCS, its
autoscaler and the raylets the autoscaler launches there have a network of their own; the job comes in from
outside through the head's job API, its shards and checkpoints on the harness's S3. Two node types: data
(2 CPUs, ``prolip-role=data``, one kept from the start) and train (1 CPU + ``fake_gpu``,
``prolip-role=train``, from 0). A two-worker training with the project's label selectors makes the
autoscaler launch train nodes and nothing else; the Train workers run only there, the ingest's decode tasks
only on the data node; once the job is done the idle train nodes are released.
"""

from __future__ import annotations

from collections import Counter

import pytest
import yaml

from tests.cluster.helpers import job_ray_id, store_of, submit_ok, train_args, upload_demo_shards, wait_for
from tests.fixtures.netns_cluster import ROOT, HostSpec, netns_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
FAKE_HEAD_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"


def _node_types(cluster) -> dict[str, str]:
    """node id → its label (data / train / head) for every node the cluster has had."""
    return {n["node_id"]: n["labels"].get("prolip-role", "head") for n in cluster.nodes()}


def _alive(cluster, role: str) -> int:
    return sum(1 for n in cluster.nodes() if n["state"] == "ALIVE" and n["labels"].get("prolip-role") == role)


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    config = yaml.safe_load((ROOT / "cluster" / "fake_cluster.yaml").read_text())
    config["provider"]["gcs_address"] = "127.0.0.1:6379"
    env = {
        "RAY_FAKE_CLUSTER": "1", "RAY_enable_autoscaler_v2": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_ID, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_ID,
        # The launched raylets live on the head's host: one address for all of them, its loopback.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PLR_FILE": "/tmp/autoscaling.yaml", "PLR_FILE_TEXT": yaml.safe_dump(config),
    }  # fmt: skip
    with netns_cluster(tmp_path_factory.mktemp("autoscaled"), [], start_head=False) as cluster:
        cluster.start_head(
            HostSpec("head", cpus=0), extra_args=["--autoscaling-config=/tmp/autoscaling.yaml"],
            extra_env=env, node_ip="127.0.0.1",
        )  # fmt: skip
        wait_for("the data node kept from the start", lambda: _alive(cluster, "data") == 1, timeout=120)
        yield cluster


def test_training_scales_up_the_train_type_only_and_idle_nodes_are_released(autoscaled, tmp_path) -> None:
    cluster = autoscaled
    assert _alive(cluster, "train") == 0  # min_workers 0: nothing before there is demand
    shards = upload_demo_shards(cluster, tmp_path, "autoscaled-shards", 2, 32)
    args = train_args(
        shards, cluster.s3.url("train"), "autoscaled", **{
            "global_batch_size": 32, "samples_seen": 4 * 32, "run.checkpoint_every": 4, "run.log_every": 4,
            "scaling.num_workers": 2, "scaling.cpus_per_worker": 1.0, "scaling.torch_threads": 1,
        },
    )  # fmt: skip
    submit_ok(cluster, args, "autoscaled")
    types = _node_types(cluster)
    launched = Counter(role for role in types.values() if role != "head")
    assert launched == {"data": 1, "train": 2}, (
        launched
    )  # the two train nodes the workers asked for, no data node

    job = job_ray_id(cluster, "autoscaled")
    actors = cluster.api("/api/v0/actors?limit=10000&detail=true")["data"]["result"]["result"]
    workers = [
        types[a["node_id"]] for a in actors if a["class_name"] == "RayTrainWorker" and a["job_id"] == job
    ]
    assert workers == ["train", "train"], workers
    tasks = cluster.api("/api/v0/tasks?limit=10000&detail=true")["data"]["result"]["result"]
    ingest = [
        (t["name"], types.get(t["node_id"]))
        for t in tasks
        if t.get("job_id") == job
        and t["node_id"]
        and (t["name"] or "").startswith(("ReadShard", "MapBatches(", "MapWorker("))
    ]
    assert ingest and {role for _, role in ingest} == {"data"}, ingest
    assert any("decode" in name for name, _ in ingest), ingest
    wait_for(
        "the idle train nodes to be released", lambda: _alive(cluster, "train") == 0, timeout=120, every=1
    )
    assert _alive(cluster, "data") == 1  # the data type's min_workers stays
    assert store_of(cluster).exists(cluster.s3.url("train", "autoscaled", "manifest.json"))
