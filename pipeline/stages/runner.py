"""Run one stage of the build as Ray tasks, one per key (a metadata file, a bucket, a part group, a window
of shards), each resumable on its own.

A task writes its outputs, then a marker ``<stage>/done/<key>.json`` holding the small summary it returns
(counts, digests: never rows). The driver lists a stage's markers once (one LIST, not a GET per task) and
runs only the keys without one, so a driver killed in any stage resumes that stage on the next run, and
a task lost with its host is run again by Ray (``max_retries``) on another: outputs are written whole or
not at all (``Storage.open_output``), and a task's outputs depend only on its inputs. When every task of a
stage is done the driver writes ``<stage>/stage.json`` with all the summaries, which later runs read
instead of the markers. Tasks run on the nodes the build's ``data_label_selector`` names; with
``inline`` (the build's ``download_actors=0``: tiny pools, the kill suite) they run one after another in
the driver's own process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipeline.common import faults, storage
from pipeline.common.errors import StorageError
from pipeline.common.storage import Storage

TASK_RETRIES = 3  # a task lost with its host or process runs again this many times
_PROGRESS_S = 10.0  # the longest a running stage stays silent


@dataclass(frozen=True)
class Placement:
    """Where a stage's tasks run: CPUs per task, node labels, or in the driver's process."""

    cpus: float = 1.0
    label_selector: dict[str, str] = field(default_factory=dict)
    inline: bool = False


def _marker(root: str, name: str, key: int) -> str:
    return storage.join(root, name, "done", f"{key:06d}.json")


def _run_task(fn: Callable[[Any, int], dict], job: Any, key: int, marker: str, store: Storage) -> dict:
    faults.point("stage.task")
    summary = fn(job, key)
    store.write_json(summary, marker)
    return summary


def _done(root: str, name: str, store: Storage) -> dict[int, dict]:
    """key → summary of every finished task of the stage (the stage file, else its markers)."""
    whole = storage.join(root, name, "stage.json")
    if store.exists(whole):
        return {int(k): v for k, v in store.read_json(whole).items()}
    paths = store.list_files(storage.join(root, name, "done"), suffix=".json")
    with ThreadPoolExecutor(16) as pool:
        docs = list(pool.map(store.read_json, paths))
    return {int(p.rsplit("/", 1)[-1][: -len(".json")]): d for p, d in zip(paths, docs, strict=True)}


def run_stage(
    root: str,
    name: str,
    fn: Callable[[Any, int], dict],
    keys: Sequence[int],
    job: Any,
    store: Storage,
    log: Callable[[str], None],
    placement: Placement = Placement(),
) -> dict[int, dict]:
    """``fn(job, key)`` for every key of ``keys`` not done in an earlier run; key → its summary.

    ``fn`` is a module-level function (it travels to the workers by reference) that writes its outputs
    through ``job``'s storage and returns a small JSON-able summary."""
    done = {k: v for k, v in _done(root, name, store).items() if k in set(keys)}
    todo = [k for k in keys if k not in done]
    if todo:
        if done:
            log(f"  {name}: {len(done)} of {len(keys)} tasks done in an earlier run")
        runner = _inline if placement.inline else _on_ray
        done.update(runner(root, name, fn, todo, job, store, log, placement))
    store.write_json({str(k): done[k] for k in sorted(done)}, storage.join(root, name, "stage.json"))
    return done


def _inline(root, name, fn, todo, job, store, log, placement) -> dict[int, dict]:
    return {k: _run_task(fn, job, k, _marker(root, name, k), store) for k in todo}


def _on_ray(root, name, fn, todo, job, store, log, placement: Placement) -> dict[int, dict]:
    import ray

    options: dict = {
        "num_cpus": placement.cpus,
        "max_retries": TASK_RETRIES,
        "retry_exceptions": [StorageError],
    }
    if placement.label_selector:
        options["label_selector"] = {str(k): str(v) for k, v in placement.label_selector.items()}
    remote = ray.remote(_run_task).options(**options)
    job_ref = ray.put(job)
    running = {remote.remote(fn, job_ref, k, _marker(root, name, k), store): k for k in todo}
    out: dict[int, dict] = {}
    last = time.monotonic()
    while running:
        ready, _ = ray.wait(list(running), num_returns=len(running), timeout=_PROGRESS_S, fetch_local=False)
        for ref in ready:
            out[running.pop(ref)] = ray.get(ref)
        if time.monotonic() - last >= _PROGRESS_S or not running:
            log(f"  {name}: {len(out)}/{len(todo)} tasks done")
            last = time.monotonic()
    return out
