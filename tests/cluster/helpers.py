"""What the tests on the namespace cluster (tests/fixtures/netns_cluster.py) share: job command lines,
S3 access from the test's own namespace, where Ray placed things, waiting on the run state in S3."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.common.placement import DATA_ROLE, LABEL_KEY, TRAIN_ROLE
from pipeline.common.storage import Storage
from tests.fixtures.netns_cluster import NetnsCluster
from tests.fixtures.train_shards import write_demo_shards

DATA = {LABEL_KEY: DATA_ROLE}
TRAIN = {LABEL_KEY: TRAIN_ROLE}


def store_of(cluster: NetnsCluster) -> Storage:
    s3 = cluster.s3
    return Storage(endpoint=s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key)


def sets(args: list[str], values: dict) -> list[str]:
    for k, v in values.items():
        args += ["--set", f"{k}={v}"]
    return args


def build_args(output: str, n: int, **extra) -> list[str]:
    """The demo preset with no metadata: the driver generates and serves the pool (pipeline/demo/source.py)."""
    values = {"output": output, "demo_n": n, "data_label_selector.prolip-role": DATA_ROLE, **extra}
    return sets(["python", "-m", "jobs.build_dataset", "--preset", "demo"], values)


def train_args(shards: str, storage_path: str, name: str, **extra) -> list[str]:
    values = {
        "data.shards": shards, "run.storage_path": storage_path, "run.name": name,
        "data.label_selector.prolip-role": DATA_ROLE, "scaling.label_selector.prolip-role": TRAIN_ROLE,
        "tokenizer_vocab": 512, "optim.warmup_steps": 2, "data.shuffle_window": 64,
        "data.decode_batch_size": 16, "data.augment": "false", "run.tensorboard": "false",
        **extra,
    }  # fmt: skip
    return sets(["python", "-m", "jobs.train", "--preset", "demo"], values)


def upload_demo_shards(cluster: NetnsCluster, work: Path, prefix: str, n_shards: int, per_shard: int) -> str:
    """Small training shards (tests/fixtures/train_shards.py) written here and uploaded to the cluster's S3."""
    store = store_of(cluster)
    for path in write_demo_shards(work / prefix, n_shards, per_shard, size=48):
        store.write_bytes(Path(path).read_bytes(), cluster.s3.url(prefix, Path(path).name))
    return cluster.s3.url(prefix)


def submit_ok(cluster: NetnsCluster, args: list[str], submission_id: str, timeout: float = 400) -> str:
    """Submit, wait, assert the job succeeded; its driver's log."""
    res = cluster.submit(args, submission_id, timeout=timeout)
    logs = cluster.job_logs(submission_id)
    assert res.returncode == 0 and cluster.job(submission_id)["status"] == "SUCCEEDED", (
        logs[-4000:] + res.stderr[-2000:]
    )
    return logs


def statuses(store: Storage, output: str) -> dict[str, str]:
    t = store.read_parquet(f"{output}/metadata/status.parquet")  # a directory: one file per uid bucket
    uids, status = t.column("uid").to_pylist(), t.column("status").to_pylist()
    assert len(set(uids)) == len(uids), "a uid with two statuses"
    return dict(zip(uids, status, strict=True))


def expected_statuses(store: Storage, output: str) -> dict[str, str]:
    """The demo pool's ground truth (its generator replays the build's rules), uploaded with the pool."""
    with store.open_input(f"{output}/pool/truth.parquet") as fh:
        t = pq.read_table(fh, columns=["uid", "expected_status"])
    return dict(zip(t.column("uid").to_pylist(), t.column("expected_status").to_pylist(), strict=True))


def shard_uids(store: Storage, output: str) -> Counter:
    from pipeline.shards.reader import iter_shard

    return Counter(
        s["json"]["uid"]
        for p in store.list_files(f"{output}/shards", suffix=".tar")
        for s in iter_shard(p, store)
    )


def committed_parts(store: Storage, output: str) -> list[str]:
    return [p for p in store.list_files(f"{output}/work/parts") if p.endswith(".done")]


def wait_for(what: str, until, timeout: float = 300, every: float = 0.3, failed=lambda: False):
    """``until()``'s first truthy value, polled; ``failed()`` truthy (a reason, or True) gives up at once."""
    deadline = time.monotonic() + timeout
    while not (value := until()):
        why = failed()
        assert not why, f"gave up waiting for {what}" + ("" if why is True else f": {why}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return value


def ip_of_node(cluster: NetnsCluster) -> dict[str, str]:
    """Node id → the host name of its address."""
    by_ip = {h.ip: name for name, h in cluster.hosts.items()}
    return {n["node_id"]: by_ip.get(n["node_ip"], n["node_ip"]) for n in cluster.nodes()}


def actors_by_host(cluster: NetnsCluster, class_name: str, job_id: str | None = None) -> Counter:
    """How many actors of ``class_name`` (of one job, if given) each host ran."""
    rows = cluster.api("/api/v0/actors?limit=10000&detail=true")["data"]["result"]["result"]
    host = ip_of_node(cluster)
    return Counter(
        host.get(a["node_id"], a["node_id"])
        for a in rows
        if a["class_name"] == class_name and (job_id is None or a.get("job_id") == job_id)
    )


def job_ray_id(cluster: NetnsCluster, submission_id: str) -> str:
    return cluster.job(submission_id)["job_id"]


def checkpoint_extra(store: Storage, storage_path: str, name: str) -> dict:
    """``extra.json`` of the run's latest checkpoint (step, history, attempts, logged metrics)."""
    ckpts = sorted(
        {p.rsplit("/", 2)[-2] for p in store.list_files(f"{storage_path}/{name}/checkpoint_*/extra.json")}
    )
    assert ckpts, f"no checkpoint under {storage_path}/{name}"
    return json.loads(store.read_bytes(f"{storage_path}/{name}/{ckpts[-1]}/extra.json"))


def listeners(namespace: str) -> list[dict]:
    """Every listening TCP socket of a host: its address, port and the command line of its process."""
    return _parse_ss(["ip", "netns", "exec", namespace, "ss", "-H", "-ltnp"])


def listeners_here() -> list[dict]:
    """The same in the machine's own network namespace (where the harness's S3 runs)."""
    return _parse_ss(["ss", "-H", "-ltnp"])


def is_ray_process(cmd: str) -> bool:
    """Ray's binaries and Python services (GCS, raylet, agents, dashboard modules, workers), by command line."""
    return "/site-packages/ray/" in cmd or cmd.startswith(("ray::", "ray-dashboard-", "ray_"))


def _parse_ss(cmd_line: list[str]) -> list[dict]:
    import subprocess

    out = subprocess.run(cmd_line, capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        fields = line.split()
        addr, port = fields[3].rsplit(":", 1)
        pids = [int(p.split("=")[1]) for p in line.split(",") if p.startswith("pid=")]
        try:
            raw = Path(f"/proc/{pids[0]}/cmdline").read_bytes() if pids else b""
        except OSError:
            raw = b""
        rows.append(
            {"address": addr.strip("[]"), "port": int(port), "cmd": raw.replace(b"\0", b" ").decode().strip()}
        )
    return rows
