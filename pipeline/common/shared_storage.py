"""Paths a job's tasks open must be ones every host can open: checked once, when the job starts.

A local path is a path on the driver's machine. On one machine (a laptop, a private local Ray, several
raylets of one host) every task sees it; on a cluster of several hosts a task on another host finds
nothing there, or worse, its own empty directory, and fails minutes later inside a Ray worker. So a job
names the paths its tasks will open (``output``, ``run.storage_path``, ``data.shards``, an eval root...)
and ``require_shared_storage`` refuses a local one with one line naming the key, when:

- an alive node of the cluster has another address than the driver's (another host), or
- no alive node has a CPU (the head runs no tasks, e.g. ``--num-cpus=0``: the work waits for nodes the
  autoscaler will add, and they are other hosts).

``s3://`` paths and empty values always pass. The rule is a pure function of the node list
(``local_path_problem``); ``require_shared_storage`` reads that list from the running Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.common.config import ConfigError
from pipeline.common.storage import is_s3


def local_path_problem(paths: Mapping[str, str], nodes: Sequence[Mapping[str, Any]], driver_ip: str) -> str:
    """One line naming the first local path that the cluster's hosts cannot share ("" when none).

    ``nodes``: ``ray.nodes()`` rows (``Alive``, ``NodeManagerAddress``, ``Resources``)."""
    local = [(k, p) for k, p in paths.items() if p and not is_s3(p)]
    if not local:
        return ""
    alive = [n for n in nodes if n.get("Alive")]
    others = sorted({str(n.get("NodeManagerAddress")) for n in alive} - {driver_ip})
    no_cpu = not any(float(n.get("Resources", {}).get("CPU", 0)) > 0 for n in alive)
    if not others and not no_cpu:
        return ""
    key, path = local[0]
    where = (
        f"this cluster runs tasks on {len(others)} other host(s) ({', '.join(others[:3])}"
        f"{', …' if len(others) > 3 else ''})"
        if others
        else "no node here runs tasks (the head has no CPUs: the work goes to hosts still to come)"
    )
    return (
        f"{key}: {path} is a path on the driver's machine, but {where}; give an s3:// path (docs/cluster.md)"
    )


def require_shared_storage(paths: Mapping[str, str]) -> None:
    """Raise ``ConfigError`` (one line) when a path in ``paths`` (config key → path) is local and the
    running Ray cluster spans hosts that cannot see it. Needs Ray initialised."""
    import ray

    problem = local_path_problem(paths, ray.nodes(), ray.util.get_node_ip_address())
    if problem:
        raise ConfigError(problem)
