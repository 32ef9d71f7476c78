"""``python -m jobs.status RUN_DIR [--s3-endpoint URL]``: what a run directory holds, done and not done.

Reads only the files the jobs leave behind (local or ``s3://``), never starts Ray, and works on a run that
is still going or was killed:

- a **build** (``jobs.build_dataset``'s output): the pool's rows and the committed download parts
  (``work/fingerprint.json``, ``work/parts/part-*.done``) with the rows they hold by status, or, once
  finished, ``metadata/status.parquet``'s rows by status, the shards and the subsets;
- a **training** (``run.storage_path``/``run.name``): the checkpoints, the last one's step, samples seen
  and loss, and whether the job finished (its ``manifest.json``; for a track's ``train/NAME``, the
  track's ``track_state.json``);
- a **track** (``jobs.track``'s output): the steps finished of those planned (``track_state.json``), the
  build's and each unfinished training's progress as above, and the report.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pyarrow.compute as pc
import pyarrow.fs as pafs

from jobs.common import job_main, parse_job_config
from pipeline.common import storage
from pipeline.common.config import config_class
from pipeline.common.errors import InputError, naming
from pipeline.common.storage import Storage
from pipeline.common.storage_config import StorageConfig


@config_class
class StatusConfig:
    run: str = ""  # a build's output, a training's run directory or a track's output (local or s3://)
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment


SUMMARY = """\
What a build, a training or a track run directory holds: the parts committed and the rows by status so
far, the last checkpoint, the track steps finished and those still to run. Reads files only; no Ray."""
EXAMPLE = "python -m jobs.status runs/demo"
_CHECKPOINT = re.compile(r"checkpoint_(\d+)")


def _count(values: Sequence[str] | dict[str, int]) -> str:
    counts = Counter(values) if not isinstance(values, dict) else values
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _parts(parts: list[int]) -> str:
    shown = ", ".join(map(str, parts[:20]))
    return (shown + (", …" if len(parts) > 20 else "")) or "none"


def build_lines(run: str, store: Storage) -> list[str]:
    """The build's progress: finished (status table, shards, subsets) or its committed parts so far."""
    from pipeline.source import run_state as R

    paths = R.run_dirs(run)
    lines: list[str] = []
    if store.exists(paths["status_counts"]):
        counts = store.read_json(paths["status_counts"])
        shards = store.list_files(paths["shards"], suffix=".tar")
        subsets = [p.rsplit("/", 1)[-1][: -len(".npy")] for p in store.list_files(paths["subsets"], ".npy")]
        lines += [
            f"build: finished; {sum(counts.values())} rows by status: {_count(counts)}",
            f"  {len(shards)} shards in {paths['shards']}; subsets: {', '.join(subsets) or 'none'}",
        ]
    if store.exists(paths["fingerprint"]):
        pool = store.read_json(paths["fingerprint"]).get("pool", {})
        done = R.committed(paths["parts"], store)
        counts = Counter()
        for p, t in sorted(done.items()):  # file by file: memory of one part, whatever the pool
            table = store.read_parquet(R.part_file(paths["parts"], p, t, "parquet"), columns=["status"])
            counts.update(
                {c["values"]: c["counts"] for c in pc.value_counts(table.column("status")).to_pylist()}
            )
        head = "build: a run in progress or interrupted" if not lines else "  work/ of a later run"
        lines += [
            f"{head}; pool of {pool.get('rows', '?')} rows",
            f"  {len(done)} download parts committed ({_parts(sorted(done))}), {sum(counts.values())} rows in "
            "them by status: "
            f"{_count(counts)}",
            "  not done: the parts not committed, then dedupe, shards and subsets (re-run the same command)",
        ]
    return lines


def _checkpoints(run: str, store: Storage) -> dict[int, str]:
    """step → metrics.json of each ``checkpoint_<step>/`` directly under ``run`` (not a recursive walk)."""
    fs, path = store.resolve(run)
    if fs.get_file_info(path).type != pafs.FileType.Directory and not storage.is_s3(run):
        return {}
    found = {}
    for info in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        m = _CHECKPOINT.fullmatch(info.base_name)
        metrics = storage.join(run, info.base_name, "metrics.json")
        if m and info.type == pafs.FileType.Directory and store.exists(metrics):
            found[int(m.group(1))] = metrics
    return found


def training_lines(run: str, store: Storage, name: str = "training") -> list[str]:
    """The checkpoints of one training run directory and whether the job finished."""
    found = _checkpoints(run, store)
    if not found:
        return [f"{name}: no checkpoint yet in {run}"]
    step = max(found)
    metrics: dict[str, Any] = store.read_json(found[step])
    loss = metrics.get("loss/total")
    shown = f", loss {loss:.4f}" if isinstance(loss, float) else ""
    finished = store.exists(storage.join(run, "manifest.json"))
    how = "finished" if finished else "running or interrupted (no manifest.json yet)"
    parts = run.rstrip("/").split("/")  # a track's trainings are TRACK/train/NAME, with no manifest
    track = "/".join(parts[:-2]) or "."
    state_file = storage.join(track, "track_state.json")
    if not finished and name == "training" and parts[-2:-1] == ["train"] and store.exists(state_file):
        step_name = "scorer" if parts[-1] == "scorer" else f"train/{parts[-1]}"
        done = step_name in store.read_json(state_file)
        how = f"{'finished' if done else 'running or interrupted'} (step {step_name} of the track {track})"
    return [
        f"{name}: {how}; {len(found)} checkpoint(s), the last at step "
        f"{metrics.get('step', step)} ({metrics.get('samples_seen', '?')} samples seen{shown})",
        f"  {found[step].rsplit('/', 1)[0]}",
    ]


def track_lines(run: str, store: Storage) -> list[str]:
    """The steps a track recorded against those it planned, and the progress of the unfinished ones."""
    state: dict[str, Any] = store.read_json(storage.join(run, "track_state.json"))
    plan = state.get("plan") or []
    done = [k for k in plan if k in state] or [k for k in state if k not in ("timings", "config", "plan")]
    todo = [k for k in plan if k not in state]
    timings = state.get("timings") or {}
    lines = [f"track: {len(done)} of {len(plan) or '?'} steps finished"]
    lines += [f"  done  {k}" + (f" ({timings[k]:.0f} s)" if k in timings else "") for k in done]
    lines += [f"  to do {k}" for k in todo]
    if "build" in todo:
        lines += ["  " + line for line in build_lines(run, store)]
    for step in todo:
        if step.startswith("train/") or step == "scorer":
            name = step.removeprefix("train/")
            lines += ["  " + line for line in training_lines(storage.join(run, "train", name), store, name)]
    report = storage.join(run, "report.md")
    lines.append(f"report: {report}" if store.exists(report) else "report: not written yet")
    return lines


def status_lines(run: str, store: Storage) -> list[str]:
    """What ``run`` is (track, build or training) and its state, as lines to print."""
    with naming(f"run {run}"):
        if store.exists(storage.join(run, "track_state.json")):
            return track_lines(run, store)
        lines = build_lines(run, store)
        if lines:
            return lines
        if _checkpoints(run, store):
            return training_lines(run, store)
        if not store.exists(run):
            raise InputError(f"run {run}: not found")
    raise InputError(
        f"run {run}: not a build, training or track run directory (no track_state.json, "
        "work/fingerprint.json, metadata/status.parquet or checkpoint_*/)"
    )


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, {"default": StatusConfig()}, {"RUN_DIR": "run", "--s3-endpoint": "storage.s3_endpoint"},
        default="default", required=("run",), prog="jobs.status", example=EXAMPLE,
    )  # fmt: skip
    store = cfg.storage.store()
    print("\n".join(status_lines(cfg.run.rstrip("/"), store)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
