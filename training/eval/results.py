"""``eval_results.jsonl`` in DataComp's schema, read back in either producer's form, and DataComp's
aggregates over it.

One JSON object per line, as DataComp's ``evaluate.py`` writes it::

    {"key": "vtab/caltech101", "dataset": "Caltech-101",
     "metrics": {"acc1": ..., "mean_per_class_recall": ..., "main_metric": 0.81}}

``key`` is DataComp's task key (``vtab/…``, ``wilds/…``, ``retrieval/…``, ``misc/…``, ``fairness/…``),
``dataset`` its display name, and ``metrics.main_metric`` the *value* of the task's main metric (null when
it is undefined). Our own fields ride along at the top level (``task``, ``kind``, ``main_metric_name``,
``group``, ``path``, ``checkpoint``); none of them shares a name with a metric, so DataComp's
``aggregate_scores.py`` (which spreads ``metrics`` into top-level columns) reads our files unchanged.

Aggregates follow DataComp's ``aggregate_scores.py``: rows are matched by display name, ImageNet is the
ImageNet 1k main metric, "ImageNet dist. shifts", "VTAB" and "Retrieval" are plain means over their 6, 13
and 3 display names, and "Average" is the mean over every task with a main metric (38 in DataComp's list;
FairFace and UTKFace carry no main metric and do not count). DataComp stops with an error when a task is
missing; we omit that aggregate and name the missing tasks instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.common import storage
from pipeline.common.storage import Storage
from training.eval.sets import EvalSetError, Task

AGGREGATES = {  # our key -> (DataComp's printed name, Task.group; None = every task of the list)
    "imagenet": ("ImageNet", "imagenet"),
    "imagenet_dist_shift": ("ImageNet dist. shifts", "imagenet_dist_shift"),
    "vtab": ("VTAB", "vtab"),
    "retrieval": ("Retrieval", "retrieval"),
    "average": ("Average", None),
}


def _finite(v: Any) -> Any:
    """JSON has no NaN: a non-finite float becomes null (DataComp writes null for an undefined metric)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (np.floating, np.integer)):
        return _finite(v.item())
    return v


def result_line(task: Task, metrics: Mapping[str, Any], checkpoint: str) -> dict[str, Any]:
    """One task's line: DataComp's ``key`` / ``dataset`` / ``metrics`` (with ``main_metric`` the value)
    and our fields beside them."""
    m = {k: _finite(v) for k, v in metrics.items()}
    m["main_metric"] = m.get(task.main_metric)
    return {
        "key": task.key or task.name,
        "dataset": task.display or task.name,
        "metrics": m,
        "task": task.name,
        "kind": task.kind,
        "main_metric_name": task.main_metric,
        "group": task.group,
        "path": task.path,
        "checkpoint": checkpoint,
    }


def main_value(line: Mapping[str, Any]) -> float | None:
    """The main metric's value of a line (``metrics.main_metric``), None when undefined."""
    v = (line.get("metrics") or {}).get("main_metric")
    return None if v is None or not math.isfinite(float(v)) else float(v)


def read_results(text: str, source: str = "eval_results.jsonl") -> list[dict[str, Any]]:
    """Lines of a results file written by DataComp's ``evaluate.py`` or by us (the earlier form of ours,
    ``{"task", "main_metric": <name>, "value"}``, is converted). A malformed line raises
    ``EvalSetError`` naming the file and line number."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as e:
            raise EvalSetError(f"{source}:{n}: not JSON: {e}") from e
        if not isinstance(line, dict) or not isinstance(line.get("metrics", {}), dict):
            raise EvalSetError(f"{source}:{n}: expected an object with a 'metrics' object")
        if "key" not in line and "task" in line:  # our earlier form
            metrics = {**line.get("metrics", {}), "main_metric": line.get("value")}
            line = {
                **{k: v for k, v in line.items() if k not in ("main_metric", "value")},
                "key": line["task"],
                "dataset": line.get("dataset") or line["task"],
                "metrics": metrics,
                "main_metric_name": line.get("main_metric"),
            }
        if "key" not in line or "dataset" not in line or "metrics" not in line:
            raise EvalSetError(f"{source}:{n}: a results line needs 'key', 'dataset' and 'metrics'")
        out.append(line)
    return out


def matches(task: Task, line: Mapping[str, Any]) -> bool:
    """A line belongs to a task by DataComp key or by display name (DataComp's own rule)."""
    return line.get("key") == (task.key or task.name) or line.get("dataset") == (task.display or task.name)


def line_for(task: Task, lines: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The last line of ``task`` (a later line supersedes an earlier one, as in DataComp)."""
    found = None
    for line in lines:
        if matches(task, line):
            found = line
    return found


def aggregates(
    lines: Sequence[Mapping[str, Any]], tasks: Sequence[Task]
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """DataComp's aggregates of ``lines`` over the task list ``tasks``: an aggregate is computed only when
    every task of its group has a main-metric value; otherwise it is omitted and returned in the second
    value with the missing task names. Groups without any task in the list are not reported."""
    value: dict[str, float | None] = {}
    for t in tasks:
        line = line_for(t, lines)
        value[t.name] = None if line is None else main_value(line)
    out: dict[str, float] = {}
    missing: dict[str, list[str]] = {}
    for agg, (_, group) in AGGREGATES.items():
        names = [t.name for t in tasks if group is None or t.group == group]
        if not names:
            continue
        lacking = [n for n in names if value[n] is None]
        if lacking:
            missing[agg] = lacking
        else:
            out[agg] = float(np.mean([value[n] for n in names]))
    return out, missing


def datacomp_names(aggs: Mapping[str, float]) -> dict[str, float]:
    """Our aggregate keys → the names DataComp's ``aggregate_scores.py`` prints."""
    return {AGGREGATES[k][0]: v for k, v in aggs.items() if k in AGGREGATES}


def previous_results(
    out_dir: str, tasks: list[Task], checkpoint: str, store: Storage
) -> tuple[dict[str, dict], list[dict]]:
    """``out_dir``'s existing results file (ours or DataComp's): task name → its line for the tasks of the
    list that have one, and the lines of other tasks (kept as they are). A line written by us for another
    checkpoint stops the run, as DataComp's evaluate stops on a training config that does not match its
    output directory."""
    path = storage.join(out_dir, "eval_results.jsonl")
    if not store.exists(path):
        return {}, []
    lines = read_results(store.read_bytes(path).decode("utf-8"), path)
    other = {ln["checkpoint"] for ln in lines if ln.get("checkpoint") not in (None, checkpoint)}
    if other:
        raise EvalSetError(
            f"{path} holds results of checkpoint {sorted(other)[0]}, not {checkpoint}: use another --out "
            "or --set resume=false"
        )
    found = {t.name: line_for(t, lines) for t in tasks}
    mine = {name: dict(line) for name, line in found.items() if line is not None}
    return mine, [dict(ln) for ln in lines if not any(matches(t, ln) for t in tasks)]
