"""Every job on a cluster of hosts that share nothing but S3, submitted from outside with ``ray job submit``.

One harness cluster for the module (tests/fixtures/netns_cluster.py): a head without task CPUs, a data
host (``prolip-role=data``, 2 CPUs) and two train hosts (``prolip-role=train``, 1 CPU each), each its own
network, mount and PID namespace with a private ``/tmp``; SeaweedFS on the bridge is the only shared store.
Every path is ``s3://``, every job goes in through the head's job API from the machine's own namespace:

- the demo build without metadata: the driver serves the pool on the head's address and puts its inputs
  on S3; every uid ends in the status the pool's ground truth says, each success once in the shards, the
  download actors only on the data host;
- a local output on this cluster: refused at the job's start with one line;
- training with two Train workers on the two train hosts equals one worker to 1e-5, step by step;
- filter (scoring actors writing their parts to S3), embed, reshard and evaluate with eval sets on S3;
- the ``tiny`` track end to end, whose report equals the single-node run's (tests/fixtures/tiny_track.py)
  to every printed digit: the build serves its generated pool from the driver on the head and puts the
  metadata, eval sets and ground truth in ``<output>/pool/``, the BPE the build trains serves every model,
  scoring writes its parts from the scoring actors.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.schema import STATUS_SUCCESS, u8pairs_to_uids
from pipeline.shards.reader import iter_shard
from pipeline.subsets.uid_files import read_subset
from tests.cluster.helpers import (
    DATA,
    TRAIN,
    actors_by_host,
    build_args,
    checkpoint_extra,
    expected_statuses,
    is_ray_process,
    job_ray_id,
    listeners,
    listeners_here,
    shard_uids,
    statuses,
    store_of,
    submit_ok,
    train_args,
    upload_demo_shards,
    wait_for,
)
from tests.fixtures.netns_cluster import HostSpec, netns_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
POOL = 300
PARITY_STEPS, PARITY_BATCH = 5, 32
RAY_WORKER_PORTS = (10002, 19999)  # Ray's default --min-worker-port/--max-worker-port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    hosts = [HostSpec("data1", 2, DATA), HostSpec("train1", 1, TRAIN), HostSpec("train2", 1, TRAIN)]
    with netns_cluster(tmp_path_factory.mktemp("cluster"), hosts) as c:
        yield c


@pytest.fixture(scope="module")
def built(cluster):
    """The demo build; while its pool is being served, what every host listens on."""
    out = cluster.s3.url("build")
    cluster.submit(build_args(out, POOL), "build", wait=False)

    def ended() -> str:  # the job's status and its log's tail, once it is neither pending nor running
        info = cluster.job("build")
        return (
            "" if info["status"] in ("RUNNING", "PENDING") else f"{info}\n{cluster.job_logs('build')[-4000:]}"
        )

    serving = wait_for("the pool's server", lambda: re.search(r"served at http://([\d.]+):(\d+)", cluster.job_logs("build")),
                       failed=ended)  # fmt: skip
    sockets = {name: listeners(h.ns) for name, h in cluster.hosts.items()}
    sockets["s3"] = [r for r in listeners_here() if f"-ip={cluster.bridge_ip}" in r["cmd"]]
    info = cluster.wait_job("build")
    logs = cluster.job_logs("build")
    assert info["status"] == "SUCCEEDED", logs[-4000:]
    return out, logs, (serving.group(1), int(serving.group(2))), sockets


@pytest.fixture(scope="module")
def parity(cluster, tmp_path_factory):
    """The same seeded run with two Train workers (one per train host) and with one. The data set is one
    global batch, so every step of both runs sees the same samples (the order inside a batch does not
    change a contrastive loss); no masked variants, whose choice depends on each worker's share."""
    shards = upload_demo_shards(
        cluster, tmp_path_factory.mktemp("parity"), "parity-shards", 2, PARITY_BATCH // 2
    )
    storage = cluster.s3.url("train")
    common = {
        "global_batch_size": PARITY_BATCH, "samples_seen": PARITY_STEPS * PARITY_BATCH, "seed": 3,
        "data.shuffle_seed": 3, "data.mask_fraction": 0.0, "run.log_every": 1,
        "run.checkpoint_every": PARITY_STEPS, "scaling.cpus_per_worker": 1.0, "scaling.torch_threads": 1,
    }  # fmt: skip
    runs = {}
    for name, workers in (("two-hosts", 2), ("one-worker", 1)):
        args = train_args(shards, storage, name, **common, **{"scaling.num_workers": workers})
        submit_ok(cluster, args, f"train-{name}")
        runs[name] = checkpoint_extra(store_of(cluster), storage, name)
        runs[name]["workers"] = actors_by_host(
            cluster, "RayTrainWorker", job_ray_id(cluster, f"train-{name}")
        )
    return storage, runs


def test_demo_build_on_s3_served_from_the_driver_every_row_one_status(cluster, built) -> None:
    out, logs, _, _ = built
    store = store_of(cluster)
    assert f"served at http://{cluster.head.ip}:" in logs  # the head's address, which the hosts reach
    got, want = statuses(store, out), expected_statuses(store, out)
    assert len(got) == POOL and set(got) == set(want)
    wrong = {u: (got[u], s) for u, s in want.items() if got[u] != s}
    assert not wrong, f"{len(wrong)} uids in another status than the pool's truth: {list(wrong.items())[:5]}"
    success = {u for u, s in got.items() if s == STATUS_SUCCESS}
    assert shard_uids(store, out) == dict.fromkeys(success, 1)  # every success once, nothing else
    placed = actors_by_host(cluster, "DownloadPart", job_ray_id(cluster, "build"))
    assert placed and set(placed) == {"data1"}, placed


def test_what_listens_on_each_host(cluster, built) -> None:
    """Ours binds the address it was given; Ray's own sockets bind every interface (docs/cluster.md)."""
    _, _, (pool_ip, pool_port), sockets = built
    head = {(r["address"], r["port"]) for r in sockets["head"]}
    assert pool_ip == cluster.head.ip and (pool_ip, pool_port) in head  # the demo pool's server
    assert not [r for r in sockets["head"] if r["port"] == pool_port and r["address"] != pool_ip]
    assert (cluster.head.ip, 8265) in head and ("0.0.0.0", 8265) not in head  # the dashboard and job API
    # SeaweedFS (the harness's store, not ours) binds the bridge address, plus its master, filer and S3
    # ports again on this namespace's loopback, which no host can reach; never every interface.
    assert sockets["s3"] and {r["address"] for r in sockets["s3"]} <= {cluster.bridge_ip, "127.0.0.1"}
    assert cluster.bridge_ip in {r["address"] for r in sockets["s3"]}
    wildcard = {name: sorted({r["cmd"].split()[0].rsplit("/", 1)[-1] for r in rows if r["address"] in ("0.0.0.0", "*", "::")})
                for name, rows in sockets.items()}  # fmt: skip
    print(f"\nlisteners on every interface, by host: {wildcard}")
    # A job's driver is a Ray core worker too: its gRPC server takes a port of Ray's worker range on every
    # interface; the one socket our code opens there (the pool's server) is checked above.
    driver = " ".join(build_args(built[0], POOL))
    for name, rows in sockets.items():
        for r in rows:
            if r["address"] in ("0.0.0.0", "*", "::"):
                ray_worker_port = (
                    r["cmd"] == driver and RAY_WORKER_PORTS[0] <= r["port"] <= RAY_WORKER_PORTS[1]
                )
                assert is_ray_process(r["cmd"]) or ray_worker_port, (name, r)


def test_a_local_output_on_this_cluster_is_refused_with_one_line(cluster) -> None:
    res = cluster.submit(build_args("runs/on-the-driver", POOL), "refused")
    assert res.returncode != 0 and cluster.job("refused")["status"] == "FAILED"
    logs = cluster.job_logs("refused")
    ours = [line for line in logs.splitlines() if line.startswith("config error:")]
    assert ours == [
        "config error: output: runs/on-the-driver is a path on the driver's machine, but this cluster runs "
        f"tasks on 3 other host(s) ({', '.join(sorted(h.ip for n, h in cluster.hosts.items() if n != 'head'))}); "
        "give an s3:// path (docs/cluster.md)"
    ]
    assert "Traceback" not in logs and "demo pool:" not in logs  # stopped before any work


def test_two_train_workers_on_two_hosts_give_the_one_worker_result(parity) -> None:
    _, runs = parity
    two, one = runs["two-hosts"], runs["one-worker"]
    assert two["workers"] == {"train1": 1, "train2": 1}, two["workers"]  # one worker per train host
    assert set(one["workers"]) <= {"train1", "train2"} and sum(one["workers"].values()) == 1
    for r in (two, one):
        assert r["step"] == PARITY_STEPS and r["history"] == [[1, PARITY_STEPS]]
        assert r["samples_seen"] == PARITY_STEPS * PARITY_BATCH
    losses = {k: np.array([m["loss/total"] for m in r["metrics"]]) for k, r in runs.items()}
    assert len(losses["two-hosts"]) == PARITY_STEPS and np.isfinite(losses["two-hosts"]).all()
    diff = np.abs(losses["two-hosts"] - losses["one-worker"])
    assert diff.max() <= 1e-5, (losses, diff)
    assert losses["one-worker"][-1] < losses["one-worker"][0]  # it trains


def test_filter_embed_reshard_and_evaluate_on_s3(cluster, built, parity) -> None:
    out = built[0]
    store = store_of(cluster)
    storage, _ = parity
    ckpt = f"{storage}/two-hosts/checkpoint_{PARITY_STEPS:08d}"
    shards = f"{out}/shards"
    n_success = sum(s == STATUS_SUCCESS for s in statuses(store, out).values())

    filt = cluster.s3.url("filter")
    submit_ok(cluster, ["python", "-m", "jobs.filter", "--preset", "demo", "--checkpoint", ckpt, "--shards", shards,
                        "--out", filt, "--set", "filters=[csd_best:fraction=0.5]", "--set", "reshard=false"], "filter")  # fmt: skip
    index = json.loads(store.read_bytes(f"{filt}/scores/scores.parquet/_scores.json"))
    assert index["rows"] == n_success and index["files"]  # parts written by the scoring actors
    with store.open_input(f"{filt}/subsets/csd_best.npy") as fh:
        picked = u8pairs_to_uids(read_subset(fh, "csd_best.npy"))
    # round(fraction·n) with halves up (pipeline/filters/scores.py)
    assert len(picked) == int(n_success * 0.5 + 0.5)

    emb = cluster.s3.url("embed", "embeddings.parquet")
    submit_ok(
        cluster,
        ["python", "-m", "jobs.embed", "--checkpoint", ckpt, "--shards", shards, "--out", emb],
        "embed",
    )
    with store.open_input(emb) as fh:
        assert pq.read_metadata(fh).num_rows == n_success

    resharded = cluster.s3.url("reshard")
    submit_ok(cluster, ["python", "-m", "jobs.reshard", "--shards", shards, "--subset", f"{filt}/subsets/csd_best.npy",
                        "--out", resharded, "--samples-per-shard", "50"], "reshard")  # fmt: skip
    uids = [
        s["json"]["uid"] for p in store.list_files(resharded, suffix=".tar") for s in iter_shard(p, store)
    ]
    assert sorted(uids) == sorted(picked)

    ev = cluster.s3.url("eval")
    logs = submit_ok(cluster, ["python", "-m", "jobs.evaluate", "--checkpoint", ckpt, "--tasks", "demo",
                               "--eval-root", f"{out}/pool/eval", "--out", ev, "--max-samples", "32",
                               "--no-analyses"], "evaluate")  # fmt: skip
    lines = [json.loads(line) for line in store.read_bytes(f"{ev}/eval_results.jsonl").decode().splitlines()]
    assert {r["dataset"] for r in lines} >= {"colours", "shapes", "retrieval", "hierarchy"}, logs[-2000:]


def comparable_report(text: str, run_dir: str) -> str:
    """``report.md`` without what says where and how long: the run directory and the timings section."""
    return text.split("\n## Timings")[0].replace(f"Run directory `{run_dir}`", "Run directory `RUN`")


def comparable_results(text: str, run_dir: str) -> dict:
    """``track_results.json`` without its timings and machine figures, its paths relative to the run."""
    results = json.loads(text.replace(run_dir, "RUN"))
    return {k: v for k, v in results.items() if k not in ("timings", "machine")}


def printed_results(printed: str) -> list[str]:
    """What the track prints after its report's path: the verdicts and the table. Lines Ray forwards from
    its actors (``(TrainController pid=…) …``) reach the job's log when they arrive, which may be after the
    report: they are not the track's."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("report: "))
    forwarded = re.compile(r"^(\x1b\[[0-9;]*m)?\([\w.:-]+ pid=\d+")
    return [line for line in lines[start + 1 :] if line.strip() and not forwarded.match(line)]


def test_the_tiny_track_on_three_hosts_reports_what_one_node_reports(cluster, tiny_track) -> None:
    assert tiny_track.code == 0
    out, store = cluster.s3.url("track"), store_of(cluster)
    t0 = time.perf_counter()
    logs = submit_ok(cluster, ["python", "-m", "jobs.track", "--preset", "tiny", "--set", f"output={out}"],
                     "tiny-track", timeout=900)  # fmt: skip
    wall = time.perf_counter() - t0
    assert "[track] build …" in logs and f"served at http://{cluster.head.ip}:" in logs
    one = tiny_track.out
    report = store.read_bytes(f"{out}/report.md").decode()
    assert comparable_report(report, out) == comparable_report((one / "report.md").read_text(), str(one))
    results = store.read_bytes(f"{out}/track_results.json").decode()
    single = (one / "track_results.json").read_text()
    assert comparable_results(results, out) == comparable_results(single, str(one))
    assert printed_results(logs) == printed_results(tiny_track.printed)
    figures = len(re.findall(r"\d+\.\d+", comparable_report(report, out)))
    print(f"\ntiny track: {wall:.0f} s on 3 hosts (submit to end) against {tiny_track.wall_s:.0f} s on one "
          f"node (killed after its build and resumed); {figures} printed figures equal")  # fmt: skip
