"""Faults as a cluster has them, on one harness cluster (tests/fixtures/netns_cluster.py): hosts killed with
every process they run, the head killed, a host cut off the network. Every path is on S3.
Elastic training (a Train host lost with ``scaling.min_workers`` below ``num_workers``) has no test
here yet: on this harness such a run had not finished 5 minutes after the host was lost.

A host is cut off until the head declares it dead, so that test takes one path whatever the timing.

Hosts: a head without task CPUs, two data hosts (2 CPUs each), two train hosts (1 CPU each). The builds run
the demo preset without metadata (the driver serves the pool) in parts of 40 rows on four actors, so a
fault lands between committed parts. Each build ends with every uid in the status the pool's ground
truth gives (the same as a clean build: tests/cluster/test_cluster_jobs.py) and each success once in the
shards. Each test leaves the cluster whole again for the next.
"""

from __future__ import annotations

import json
import time

import pytest

from pipeline.schema import STATUS_SUCCESS
from tests.cluster.helpers import (
    DATA,
    TRAIN,
    actors_by_host,
    build_args,
    checkpoint_extra,
    committed_parts,
    expected_statuses,
    job_ray_id,
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
POOL, PART = 600, 40
HOSTS = [
    HostSpec("data1", 2, DATA),
    HostSpec("data2", 2, DATA),
    HostSpec("train1", 1, TRAIN),
    HostSpec("train2", 1, TRAIN),
]
STEPS, BATCH, EVERY = 18, 32, 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with netns_cluster(tmp_path_factory.mktemp("faults"), HOSTS) as c:
        yield c


@pytest.fixture(scope="module")
def train_shards(cluster, tmp_path_factory):
    return upload_demo_shards(cluster, tmp_path_factory.mktemp("shards"), "train-shards", 4, 40)


def slow_build(output: str, **extra) -> list[str]:
    values = {"download.threads_per_actor": 2, **extra}
    return build_args(output, POOL, part_size=PART, download_actors=4, **values)


def whole_again(cluster, specs=HOSTS) -> None:
    """Every host of ``specs`` running and registered (a killed or dropped host started afresh)."""
    for spec in specs:
        if not cluster.hosts[spec.name].alive:
            cluster.add_host(spec)
    wanted = {cluster.hosts[s.name].ip for s in specs} | {cluster.head.ip}
    wait_for("the hosts to register", lambda: wanted <= _alive_ips(cluster), timeout=120)


def _alive_ips(cluster) -> set[str]:
    return {n["node_ip"] for n in cluster.nodes() if n["state"] == "ALIVE"}


def _two_parts(store, out: str) -> list[str] | None:
    parts = committed_parts(store, out)
    return parts if len(parts) >= 2 else None


def check_build(cluster, output: str) -> dict[str, int]:
    """Every uid in its ground-truth status, each success once in the shards; the counts."""
    store = store_of(cluster)
    got, want = statuses(store, output), expected_statuses(store, output)
    assert len(got) == POOL and set(got) == set(want)
    wrong = {u: (got[u], s) for u, s in want.items() if got[u] != s}
    assert not wrong, f"{len(wrong)} uids in another status: {list(wrong.items())[:5]}"
    success = {u for u, s in got.items() if s == STATUS_SUCCESS}
    assert shard_uids(store, output) == dict.fromkeys(success, 1)
    return {"rows": len(got), "success": len(success)}


def test_a_worker_host_killed_mid_download_the_same_job_finishes(cluster) -> None:
    out, store = cluster.s3.url("killed-host"), store_of(cluster)
    cluster.submit(slow_build(out), "killed-host", wait=False)
    running = lambda: cluster.job("killed-host")["status"] in ("FAILED", "STOPPED")  # noqa: E731
    before = len(wait_for("two committed parts", lambda: _two_parts(store, out), failed=running))
    placed = actors_by_host(cluster, "DownloadPart", job_ray_id(cluster, "killed-host"))
    victim = max(("data1", "data2"), key=lambda h: placed.get(h, 0))
    assert placed.get(victim), placed
    cluster.kill_host(victim)
    info = cluster.wait_job("killed-host")
    logs = cluster.job_logs("killed-host")
    assert info["status"] == "SUCCEEDED", logs[-4000:]  # no re-submit
    lost = logs.count("a download actor was lost")
    assert lost >= 1 and "0 already done" in logs
    counts = check_build(cluster, out)
    print(f"\nkilled {victim} after {before} committed parts; {lost} actor(s) lost; {counts}")
    whole_again(cluster)


def test_a_host_cut_off_until_declared_dead_the_same_job_finishes(cluster) -> None:
    """The host's link goes down with its processes alive; it comes back once the head has declared it
    dead (an event, not a fixed time: Ray's health checks take 15-50 s), so every run takes the same path:
    its actors' calls fail, their parts run again on the other host, and the same job finishes. The cut
    host's actors may still write files when it comes back: under their own tokens, which no marker
    names."""
    out, store = cluster.s3.url("cut-host"), store_of(cluster)
    cluster.submit(slow_build(out, **{"download.late_retries": 1}), "cut-host", wait=False)
    failed = lambda: cluster.job("cut-host")["status"] in ("FAILED", "STOPPED")  # noqa: E731
    wait_for("two committed parts", lambda: _two_parts(store, out), failed=failed)
    placed = actors_by_host(cluster, "DownloadPart", job_ray_id(cluster, "cut-host"))
    victim = max(("data1", "data2"), key=lambda h: placed.get(h, 0))
    assert placed.get(victim), placed
    cluster.cut(victim)
    started = time.monotonic()
    wait_for(f"the head to declare {victim} dead", lambda: cluster.hosts[victim].ip not in _alive_ips(cluster),
             timeout=180, every=1.0)  # fmt: skip
    cut_for = time.monotonic() - started
    cluster.restore(victim)
    info = cluster.wait_job("cut-host")
    logs = cluster.job_logs("cut-host")
    assert info["status"] == "SUCCEEDED", logs[-4000:]  # no re-submit
    lost = logs.count("a download actor was lost")
    assert lost >= 1 and "0 already done" in logs
    counts = check_build(cluster, out)
    print(f"\ncut {victim} for {cut_for:.0f} s (until declared dead): {lost} actor(s) lost; {counts}")
    cluster.kill_host(victim)  # declared dead, its raylet is on its way out: start it afresh
    whole_again(cluster)


def test_the_head_killed_mid_build_a_resubmit_on_a_new_head_resumes(cluster) -> None:
    out, store = cluster.s3.url("killed-head"), store_of(cluster)
    cluster.submit(slow_build(out), "killed-head", wait=False)
    failed = lambda: cluster.job("killed-head")["status"] in ("FAILED", "STOPPED")  # noqa: E731
    done = len(wait_for("two committed parts", lambda: _two_parts(store, out), failed=failed))
    cluster.stop_hosts()  # the head, and with it the cluster: its workers lose their GCS
    cluster.start_head()
    whole_again(cluster)
    logs = submit_ok(cluster, slow_build(out), "killed-head-resubmit")
    resumed = next(line for line in logs.splitlines() if line.startswith("download:"))
    n_done = int(resumed.split(", ")[1].split()[0])
    assert n_done >= done, resumed
    counts = check_build(cluster, out)
    print(f"\nhead killed after {done} committed parts; the new head's run: {resumed!r}; {counts}")


def _committed_checkpoints(store, storage: str, name: str) -> list[str]:
    path = f"{storage}/{name}/checkpoint_manager_snapshot.json"
    if not store.exists(path):
        return []
    return sorted(r["checkpoint_dir_name"] for r in json.loads(store.read_bytes(path))["checkpoint_results"])


def _train(cluster, shards: str, name: str, **extra) -> list[str]:
    values = {
        "global_batch_size": BATCH, "samples_seen": STEPS * BATCH, "run.checkpoint_every": EVERY,
        "run.log_every": EVERY, "run.max_failures": 2, "scaling.num_workers": 2,
        "scaling.cpus_per_worker": 1.0, "scaling.torch_threads": 1, "data.shuffle_seed": 0, **extra,
    }  # fmt: skip
    return train_args(shards, cluster.s3.url("train"), name, **values)


def test_a_train_host_killed_the_run_restores_from_s3_on_a_replacement_host(cluster, train_shards) -> None:
    store, storage, name = store_of(cluster), cluster.s3.url("train"), "replaced"
    cluster.submit(_train(cluster, train_shards, name), "train-replaced", wait=False)
    failed = lambda: cluster.job("train-replaced")["status"] in ("FAILED", "STOPPED")  # noqa: E731
    wait_for("a committed checkpoint", lambda: _committed_checkpoints(store, storage, name), failed=failed)
    cluster.kill_host("train2")
    cluster.add_host(HostSpec("train3", 1, TRAIN))  # the replacement the autoscaler would bring
    info = cluster.wait_job("train-replaced")
    assert info["status"] == "SUCCEEDED", cluster.job_logs("train-replaced")[-4000:]
    extra = checkpoint_extra(store, storage, name)
    assert extra["step"] == STEPS and extra["history"] == [[1, STEPS]]  # contiguous: no step lost or repeated
    assert extra["samples_seen"] == STEPS * BATCH
    assert len(extra["attempts"]) == 2 and extra["attempts"][0] == 0 and extra["attempts"][1] % EVERY == 0
    assert extra["attempts"][1] >= EVERY
    workers = actors_by_host(cluster, "RayTrainWorker", job_ray_id(cluster, "train-replaced"))
    assert workers == {"train1": 2, "train2": 1, "train3": 1}, workers
    print(
        f"\ntrain host killed: resumed at step {extra['attempts'][1]}, history {extra['history']}, workers {dict(workers)}"
    )
    cluster.kill_host("train3")
    whole_again(cluster)
