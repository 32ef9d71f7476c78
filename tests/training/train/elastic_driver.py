"""Driver of tests/training/train/test_elastic.py, in its own process: a local three-node Ray cluster (a
head for the ingest, two one-CPU nodes labelled for Train workers), an elastic demo run over (1, 2)
workers with a global batch of 9 (5 + 4 rows at two workers), and one train node killed — its raylet and
every process on it — as soon as a checkpoint has been committed. Ray Train then restarts from that
checkpoint with the one node left. Prints the run's return value and what it saw as one JSON line.

Usage: python elastic_driver.py SHARDS STORAGE
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

TOTAL, EVERY, BATCH = 60, 10, 9


def committed(storage: Path) -> list[str]:
    snapshot = storage / "elastic" / "checkpoint_manager_snapshot.json"
    try:
        results = json.loads(snapshot.read_text())["checkpoint_results"]
    except (OSError, ValueError, KeyError):
        return []
    return sorted(r["checkpoint_dir_name"] for r in results)


def main(shards: str, storage: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from jobs.common import loopback_only
    from pipeline.common.config import merge
    from training.config import TRAIN_PRESETS
    from training.train.trainer import train

    loopback_only(ray)
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 150 * 1024**2}
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={**node, "num_cpus": 2, "labels": {"prolip-role": "data"}, "include_dashboard": False},
    )
    train_nodes = [cluster.add_node(**node, num_cpus=1, labels={"prolip-role": "train"}) for _ in range(2)]
    cfg = merge(
        TRAIN_PRESETS["demo"],
        {
            "model": "demo-32px", "global_batch_size": BATCH, "samples_seen": TOTAL * BATCH,
            "tokenizer_vocab": 512, "optim": {"warmup_steps": 5},
            "data": {"shards": shards, "decode_batch_size": 16, "shuffle_window": 32, "shuffle_seed": 0,
                     "label_selector": {"prolip-role": "data"}, "decode_cpus": 0.5},
            "scaling": {"num_workers": 2, "min_workers": 1, "cpus_per_worker": 1,
                        "label_selector": {"prolip-role": "train"}},
            "run": {"storage_path": storage, "name": "elastic", "checkpoint_every": EVERY, "log_every": 5,
                    "max_failures": 2, "keep_checkpoints": 3, "tensorboard": False},
        },
    )  # fmt: skip
    killed: dict[str, object] = {}

    def kill_one_train_node() -> None:
        while not committed(Path(storage)):
            time.sleep(0.2)
        killed["after"] = committed(Path(storage))[-1]
        cluster.remove_node(train_nodes[1], allow_graceful=False)

    threading.Thread(target=kill_one_train_node, daemon=True).start()
    try:
        result = train(cfg)
        out = {"return_value": result.return_value, "killed_after": killed.get("after")}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("ELASTIC " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
