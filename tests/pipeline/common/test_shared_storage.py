"""The rule that refuses a local path a multi-host cluster's tasks cannot open (pure, on node lists)."""

from __future__ import annotations

from pipeline.common.shared_storage import local_path_problem


def node(ip: str, cpus: float = 2, alive: bool = True) -> dict:
    return {"Alive": alive, "NodeManagerAddress": ip, "Resources": {"CPU": cpus} if cpus else {}}


def test_one_host_takes_local_paths() -> None:
    paths = {"output": "runs/demo", "metadata": ""}
    assert local_path_problem(paths, [node("127.0.0.1")], "127.0.0.1") == ""
    # several raylets of one machine (ray.cluster_utils.Cluster, the fake autoscaler) share its disk
    assert local_path_problem(paths, [node("127.0.0.1", 0), node("127.0.0.1")], "127.0.0.1") == ""
    # a dead node at another address no longer runs anything
    assert local_path_problem(paths, [node("127.0.0.1"), node("10.0.0.5", alive=False)], "127.0.0.1") == ""


def test_other_hosts_refuse_the_first_local_path_naming_its_key() -> None:
    nodes = [node("198.18.7.10", 0), node("198.18.7.11"), node("198.18.7.12")]
    paths = {"output": "s3://b/run", "run.storage_path": "/data/train", "data.shards": "shards"}
    line = local_path_problem(paths, nodes, "198.18.7.10")
    assert line.startswith("run.storage_path: /data/train is a path on the driver's machine")
    assert "2 other host(s) (198.18.7.11, 198.18.7.12)" in line and "s3://" in line and "\n" not in line
    assert local_path_problem({"output": "s3://b/run", "metadata": ""}, nodes, "198.18.7.10") == ""


def test_a_head_without_cpus_refuses_local_paths_before_any_worker_joins() -> None:
    line = local_path_problem({"output": "runs/x"}, [node("10.0.0.1", 0)], "10.0.0.1")
    assert line.startswith("output: runs/x") and "no node here runs tasks" in line
