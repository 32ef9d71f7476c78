"""Evaluation runner: validates a checkpoint and a task list, encodes every eval set with Ray Data batch
inference, then scores the gathered embeddings with the pure metrics of ``training/eval/metrics.py``.

Two Ray Data pipelines serve all tasks at once (one actor pool each, so a model is loaded
``2 · num_actors`` times per run, not per task): images (``from_items`` of shards → ``flat_map`` reading
rows → ``map_batches(EmbedBatch, compute=ActorPoolStrategy(size=num_actors), num_gpus=num_gpus)``) and
texts (prompts and captions). Eval sets are small, so embeddings are gathered into the driver.
Deterministic and ProLIP checkpoints share the code: without log-variances scores are cosines.

Writes ``eval_results.jsonl`` (one line per task run), ``aggregates.json`` (DataComp aggregates, plus
the ones omitted with their missing tasks), ``analyses.json`` and ``plots/*.png`` under ``out_dir``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import storage
from training.encode import Encoder
from training.eval import sets as eval_sets
from training.eval.metrics import (
    aggregates,
    classification_metrics,
    gaussian_mean,
    retrieval_metrics,
    score_matrix,
)
from training.eval.sets import EvalSetError, Task


@dataclass(frozen=True)
class EvalConfig:
    """What ``python -m jobs.evaluate`` resolves (preset → YAML → --set → flags)."""

    checkpoint: str = ""
    tasks: str = "demo"  # a task-list name (training/eval/tasks/NAME.yaml) or a YAML file
    eval_root: str = ""  # root of the task list's relative paths
    out: str = ""
    s3_endpoint: str = ""
    num_actors: int = 1
    num_gpus: float = 0.0  # per actor; 0 on CPU-only clusters (a GPU request there waits forever)
    batch_size: int = 256
    analyses: bool = True
    max_samples: int | None = None  # per task, for quick checks
    seed: int = 0


EVAL_PRESETS = {
    "demo": EvalConfig(batch_size=128),
    "datacomp-small": EvalConfig(tasks="datacomp", num_actors=1, batch_size=256),
    "prolip-b16": EvalConfig(tasks="datacomp", num_actors=4, num_gpus=1.0, batch_size=512),
}


@dataclass
class EvalReport:
    results: list[dict]
    aggregates: dict[str, float]
    analyses: dict
    plots: list[str]
    out_dir: str
    missing_aggregates: dict[str, list[str]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


@dataclass
class TaskData:
    """Gathered embeddings of one task, rows in set order (undecodable images removed)."""

    task: Task
    image_mu: np.ndarray
    image_logvar: np.ndarray | None
    labels: np.ndarray
    groups: np.ndarray
    captions: list[list[str]]
    n_undecodable: int
    classnames: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)
    text_mu: np.ndarray | None = None  # prompts (C·T, D, class-major) or captions (M, D, image-major)
    text_logvar: np.ndarray | None = None


class EmbedBatch:
    """Ray Data stage holding one ``Encoder``: rows with ``sub < 0`` are images (``image`` bytes), the
    others texts (``text``). Adds ``mu``, ``ok`` and, for probabilistic checkpoints, ``logvar``."""

    def __init__(self, checkpoint: str, s3_endpoint: str, device: str, batch_size: int, env: dict) -> None:
        storage.adopt_env(env)
        self.encoder = Encoder(checkpoint, s3_endpoint, device=device, batch_size=batch_size, threads=1)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: v for k, v in batch.items() if k != "image"}  # texts stay: the analyses read captions
        is_image = batch["sub"] < 0
        n, dim = len(is_image), self.encoder.embed_dim
        mu = np.full((n, dim), np.nan, np.float32)
        logvar = np.full((n, dim), np.nan, np.float32)
        ok = np.ones(n, bool)
        if is_image.any():
            m, lv, ok[is_image] = self.encoder.images([bytes(b) for b in batch["image"][is_image]])
            mu[is_image] = m
            if lv is not None:
                logvar[is_image] = lv
        if (~is_image).any():
            m, lv = self.encoder.texts([str(t) for t in batch["text"][~is_image]])
            mu[~is_image] = m
            if lv is not None:
                logvar[~is_image] = lv
        out["mu"], out["ok"] = mu, ok
        if self.encoder.probabilistic:
            out["logvar"] = logvar
        return out


def _read_item(
    item: dict[str, Any], kinds: dict, limit: int | None, s3_endpoint: str, env: dict
) -> list[dict]:
    """A shard → one image row per sample plus one text row per caption (``sub`` = caption index);
    a prompt item → one text row per prompt (``shard`` = −1)."""
    storage.adopt_env(env)
    base = {"task": item["task"], "shard": item["shard"], "image": b"", "text": "", "label": -1, "group": -1}
    if not item["path"]:
        return [{**base, "pos": j, "sub": 0, "text": p} for j, p in enumerate(item["prompts"].split("\n"))]
    kind, group_column = kinds[int(item["task"])]
    rows = []
    for r in eval_sets.iter_rows(item["path"], kind, s3_endpoint, limit=limit, group_column=group_column):
        rows.append(
            {
                **base,
                "pos": r["pos"],
                "sub": -1,
                "image": r["image"],
                "label": r["label"],
                "group": r["group"],
            }
        )
        for j, cap in enumerate(eval_sets.split_captions(r["captions"])):
            rows.append({**base, "pos": r["pos"], "sub": j, "text": cap})
    return rows


def _stage_kwargs(
    checkpoint: str, s3_endpoint: str, num_actors: int, num_gpus: float, batch_size: int
) -> dict:
    import ray

    return dict(
        fn_constructor_kwargs={
            "checkpoint": checkpoint,
            "s3_endpoint": s3_endpoint,
            "device": "cuda" if num_gpus > 0 else "cpu",
            "batch_size": batch_size,
            "env": storage.forwarded_env(),
        },
        compute=ray.data.ActorPoolStrategy(size=max(1, int(num_actors))),
        num_gpus=num_gpus,
        batch_size=batch_size,
        batch_format="numpy",
    )


def encode_all(
    tasks: list[Task], shards: list[list[str]], prompts: list[list[str]], max_samples: int | None, **kw: Any
) -> dict[str, np.ndarray]:
    """Images, captions and prompts of every task in one Ray Data pipeline (one actor pool); returns
    the gathered columns sorted by (task, shard, pos, sub)."""
    import ray

    items = [
        {"task": t, "shard": s, "path": p, "prompts": ""}
        for t, paths in enumerate(shards)
        for s, p in enumerate(paths)
    ]
    items += [
        {"task": t, "shard": -1, "path": "", "prompts": "\n".join(p)} for t, p in enumerate(prompts) if p
    ]
    kinds = {i: (t.kind, t.group_column) for i, t in enumerate(tasks)}
    reader = functools.partial(
        _read_item, kinds=kinds, limit=max_samples, s3_endpoint=kw["s3_endpoint"], env=storage.forwarded_env()
    )
    ds = ray.data.from_items(items, override_num_blocks=len(items)).flat_map(reader)
    batches = list(
        ds.map_batches(EmbedBatch, **_stage_kwargs(**kw)).iter_batches(batch_size=None, batch_format="numpy")
    )
    cols = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    order = np.lexsort((cols["sub"], cols["pos"], cols["shard"], cols["task"]))
    return {k: v[order] for k, v in cols.items()}


def task_data(
    task: Task, i: int, cols: dict[str, np.ndarray], max_samples: int | None, s3_endpoint: str
) -> TaskData:
    """One task's rows out of the gathered columns: images in set order, their captions, its prompts."""
    logvar = cols.get("logvar")
    mine = cols["task"] == i
    img = np.flatnonzero(mine & (cols["sub"] < 0))[:max_samples]
    ok = cols["ok"][img].astype(bool)
    keep = img[ok]
    d = TaskData(
        task=task,
        image_mu=cols["mu"][keep],
        image_logvar=None if logvar is None else logvar[keep],
        labels=cols["label"][keep].astype(np.int64),
        groups=cols["group"][keep].astype(np.int64),
        captions=[],
        n_undecodable=int((~ok).sum()),
    )
    if len(keep) == 0:
        raise EvalSetError(f"eval set {task.name}: no decodable image in {task.path}")
    if task.kind == "zeroshot_classification":
        d.classnames, d.templates = (
            eval_sets.classnames(task, s3_endpoint),
            eval_sets.templates(task, s3_endpoint),
        )
        txt = np.flatnonzero(mine & (cols["shard"] < 0))
    else:
        # captions of kept images, grouped image by image (rows are sorted by shard, pos, sub)
        slot = {(int(cols["shard"][k]), int(cols["pos"][k])): n for n, k in enumerate(keep)}
        txt = np.flatnonzero(mine & (cols["sub"] >= 0) & (cols["shard"] >= 0))
        owner = np.array(
            [slot.get((int(cols["shard"][k]), int(cols["pos"][k])), -1) for k in txt], dtype=np.int64
        )
        txt = txt[owner >= 0]
        counts = np.bincount(owner[owner >= 0], minlength=len(keep))
        if (counts == 0).any():
            raise EvalSetError(f"eval set {task.name}: a sample in {task.path} has no caption")
        d.captions = [[] for _ in keep]
        for n, k in zip(owner[owner >= 0], txt, strict=True):
            d.captions[n].append(str(cols["text"][k]))
    d.text_mu = cols["mu"][txt]
    d.text_logvar = None if logvar is None else logvar[txt]
    return d


def task_metrics(d: TaskData) -> dict[str, float]:
    """Metrics of one task from its gathered embeddings."""
    if d.task.kind == "zeroshot_classification":
        c, t = len(d.classnames), len(d.templates)
        mu = d.text_mu.reshape(c, t, -1)
        logvar = None if d.text_logvar is None else d.text_logvar.reshape(c, t, -1)
        class_mu, class_logvar = gaussian_mean(mu, logvar, axis=1)
        scores = score_matrix(d.image_mu, d.image_logvar, class_mu, class_logvar)
        extra = {}
        if d.task.group_column is not None:
            extra = dict(
                groups=d.groups,
                group_metric=d.task.group_metric,
                group_metric_name=d.task.main_metric,
                group_exclude=d.task.group_exclude,
            )
        return classification_metrics(scores, d.labels, **extra)
    caption_image = np.repeat(np.arange(len(d.captions)), [len(c) for c in d.captions])
    if d.task.kind == "retrieval":
        return retrieval_metrics(
            score_matrix(d.image_mu, d.image_logvar, d.text_mu, d.text_logvar), caption_image
        )
    # hierarchy: retrieval among the most specific captions (the last line of each sample)
    last = np.cumsum([len(c) for c in d.captions]) - 1
    lv = None if d.text_logvar is None else d.text_logvar[last]
    out = retrieval_metrics(
        score_matrix(d.image_mu, d.image_logvar, d.text_mu[last], lv), np.arange(len(last))
    )
    return out


def _validate(tasks: list[Task], s3_endpoint: str) -> tuple[list[Task], list[list[str]], list[str]]:
    kept, shards, skipped = [], [], []
    for t in tasks:
        if t.optional and not storage.exists(storage.join(t.path, "test"), s3_endpoint):
            skipped.append(t.name)
            continue
        shards.append(eval_sets.validate_task(t, s3_endpoint))
        kept.append(t)
    return kept, shards, skipped


def _write_outputs(report: EvalReport, s3_endpoint: str, plot_files: list[str]) -> None:
    lines = "".join(
        json.dumps(r, sort_keys=True, default=storage.json_default) + "\n" for r in report.results
    )
    storage.write_bytes(lines.encode(), storage.join(report.out_dir, "eval_results.jsonl"), s3_endpoint)
    aggs = {"aggregates": report.aggregates, "missing": report.missing_aggregates, "skipped": report.skipped}
    storage.write_json(aggs, storage.join(report.out_dir, "aggregates.json"), s3_endpoint)
    storage.write_json(report.analyses, storage.join(report.out_dir, "analyses.json"), s3_endpoint)
    if storage.is_s3(report.out_dir):
        report.plots = []
        for f in plot_files:
            dest = storage.join(report.out_dir, "plots", os.path.basename(f))
            with open(f, "rb") as fh:
                storage.write_bytes(fh.read(), dest, s3_endpoint)
            report.plots.append(dest)


def evaluate(
    checkpoint: str,
    tasks: list[Task] | str,
    out_dir: str,
    *,
    s3_endpoint: str = "",
    num_actors: int = 1,
    num_gpus: float = 0.0,
    batch_size: int = 256,
    analyses: bool = True,
    max_samples: int | None = None,
    seed: int = 0,
    init: Callable[[], None] | None = None,
) -> EvalReport:
    """Evaluate ``checkpoint`` on ``tasks`` (a list or a task-list name/file); see the module docstring.

    The checkpoint is loaded once in the driver and every task's layout is checked before any Ray work:
    ``CheckpointError`` / ``EvalSetError`` name the offending file. ``init`` (e.g. ``jobs.common.init_ray``)
    runs after those checks, so a bad input fails before a cluster is started or joined.
    """
    from training.eval.analyses import run_analyses

    encoder = Encoder(checkpoint, s3_endpoint)  # validates the checkpoint; also serves the analyses
    task_list = eval_sets.load_tasks(tasks) if isinstance(tasks, str) else list(tasks)
    kept, shards, skipped = _validate(task_list, s3_endpoint)
    if not kept:
        raise EvalSetError("no eval set found: " + ", ".join(t.path for t in task_list))
    if init is not None:
        init()
    kw = dict(s3_endpoint=s3_endpoint, num_actors=num_actors, num_gpus=num_gpus, batch_size=batch_size)
    prompts = [
        [
            tp.replace("{c}", c)
            for c in eval_sets.classnames(t, s3_endpoint)
            for tp in eval_sets.templates(t, s3_endpoint)
        ]
        if t.kind == "zeroshot_classification"
        else []
        for t in kept
    ]
    cols = encode_all(kept, shards, prompts, max_samples, checkpoint=checkpoint, **kw)
    data = [task_data(t, i, cols, max_samples, s3_endpoint) for i, t in enumerate(kept)]
    results = []
    for d in data:
        metrics = task_metrics(d)
        metrics["n_undecodable"] = d.n_undecodable
        value = metrics.get(d.task.main_metric)
        results.append(
            {
                "task": d.task.name,
                "dataset": d.task.display or d.task.name,
                "kind": d.task.kind,
                "main_metric": d.task.main_metric,
                "value": None if value is None or not np.isfinite(value) else float(value),
                "metrics": metrics,
                "group": d.task.group,
                "path": d.task.path,
            }
        )
    aggs, missing = aggregates(results, task_list)
    plot_dir = storage.join(out_dir, "plots") if not storage.is_s3(out_dir) else tempfile.mkdtemp()
    found, plot_files = {}, []
    if analyses:
        found, plot_files = run_analyses(data, encoder, plot_dir, seed=seed, s3_endpoint=s3_endpoint)
        for r, d in zip(results, data, strict=True):  # hierarchy ordering belongs to its task's line too
            if d.task.kind == "hierarchy" and isinstance(found.get("hierarchy_order"), dict):
                r["metrics"]["ordered_fraction"] = found["hierarchy_order"]["ordered_fraction"]
    if not storage.is_s3(out_dir):
        storage.makedirs(out_dir)
    report = EvalReport(results, aggs, found, plot_files, out_dir, missing, skipped)
    _write_outputs(report, s3_endpoint, plot_files)
    return report
