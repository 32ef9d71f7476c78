"""What an evaluation says while it runs: what it resumes and runs, each task's figure as it is scored,
and the run and model its plots belong to (``training/eval/run.py``)."""

from __future__ import annotations

import os
from typing import Any

from training.eval.results import main_value
from training.eval.sets import Task


def task_line(i: int, n: int, task: Task, line: dict[str, Any]) -> str:
    """``[eval] task 2/4 shapes: acc1 0.2810`` (4 digits, as the job's table prints them)."""
    value = main_value(line)
    shown = "undefined" if value is None else f"{value:.4f}"
    return f"[eval] task {i}/{n} {task.name}: {task.main_metric} {shown}"


def plan_line(out_dir: str, tasks: list[Task], done: dict, kept: list[Task], skipped: list[str]) -> str:
    """What this evaluation resumes, runs and skips, in one line."""
    parts = [f"[eval] {len(tasks)} task(s) → {out_dir}: {len(kept)} to run"]
    if done:
        parts.append(f"{len(done)} resumed from its eval_results.jsonl ({', '.join(sorted(done))})")
    if skipped:
        parts.append(f"{len(skipped)} without an eval set under the root ({', '.join(skipped)})")
    return "; ".join(parts)


def plot_subject(out_dir: str, checkpoint: str, encoder: Any) -> str:
    """The run and model a plot belongs to, e.g. ``scorer · train/scorer/checkpoint_00000016 · 32 px
    conv image tower, 128-d Gaussian embeddings``."""
    c = encoder.config
    kind = "Gaussian" if c.probabilistic else "deterministic"
    where = "/".join(checkpoint.rstrip("/").split("/")[-3:])
    return f"{os.path.basename(out_dir.rstrip('/'))} · {where} · {c.image_size} px {c.vision_stem} image tower, {c.embed_dim}-d {kind} embeddings"
