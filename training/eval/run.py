"""Evaluation runner: validates a checkpoint and a task list, encodes every eval set with Ray Data batch
inference, then scores the gathered embeddings with the pure metrics of ``training/eval/metrics.py``.

One Ray Data pipeline serves all tasks at once (``training.infer.batch_inference.encode_items``: one actor pool of
the one batch encoder, ``training.infer.encode.Encoder``, so a model is loaded ``num_actors`` times per run,
not per task): one read task per eval shard or prompt list (``read_item``, Ray-free) yields image rows
and text rows (captions, prompts), which the encoder's image or text tower encodes (``has_image`` /
``has_text``). Eval sets are small, so embeddings are gathered into the driver.
Deterministic and ProLIP checkpoints share the code: without log-variances scores are cosines.

Writes ``eval_results.jsonl`` (one line per task, DataComp's schema: ``training/eval/results.py``),
``aggregates.json`` (DataComp aggregates, plus the ones omitted with their missing tasks),
``analyses.json`` and ``plots/*.png`` under ``out_dir``. A results file already in ``out_dir`` (ours or
DataComp's) is resumed: its tasks are not evaluated again.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from training.eval import hf_sets
from training.eval import sets as eval_sets
from training.eval.metrics import (
    association_metrics,
    classification_metrics,
    retrieval_metrics,
    score_matrix,
    zero_shot_scores,
)
from training.eval.progress import plan_line, plot_subject, task_line
from training.eval.results import aggregates, datacomp_names, previous_results, result_line
from training.eval.sets import EvalSetError, Task
from training.infer.encode import Encoder


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


def merge_towers(e: dict[str, Any]) -> dict[str, Any]:
    """``Encoder`` output → one ``mu`` (and ``logvar``) per row: the image tower's on image rows
    (``sub < 0``), the text tower's on caption and prompt rows."""
    is_image = (np.asarray(e["sub"]) < 0)[:, None]
    out = {k: v for k, v in e.items() if not k.startswith(("image_", "text_"))}
    out["mu"] = np.where(is_image, e["image_mu"], e["text_mu"])
    if "image_logvar" in e:
        out["logvar"] = np.where(is_image, e["image_logvar"], e["text_logvar"])
    return out


def read_item(item: dict[str, Any], kinds: dict, limit: int | None, store: Storage) -> list[dict]:
    """A shard → one image row per sample plus one text row per caption (``sub`` = caption index);
    a prompt item → one text row per prompt (``shard`` = −1); an association game → one image row per
    candidate (``sub`` = −1 − j, ``label`` = 1 for an association, ``group`` = its number of candidates)
    and one text row, its cue. Rows in ``Encoder``'s columns."""
    base = {"task": item["task"], "shard": item["shard"], "jpg": b"", "txt": "", "label": -1, "group": -1}
    text = {**base, "has_image": False, "has_text": True}
    if not item["path"]:
        return [{**text, "pos": j, "sub": 0, "txt": p} for j, p in enumerate(item["prompts"].split("\n"))]
    kind, group_column, hf = kinds[int(item["task"])]
    rows = []
    if kind == "association":
        for r in hf_sets.iter_rows(item["path"], kind, store, limit=limit):
            for j, (jpg, hit) in enumerate(zip(r["images"], r["truth"], strict=True)):
                image = {
                    "pos": r["pos"],
                    "sub": -1 - j,
                    "jpg": jpg,
                    "label": int(hit),
                    "group": len(r["images"]),
                }
                rows.append({**base, "has_image": True, "has_text": False, **image})
            rows.append({**text, "pos": r["pos"], "sub": 0, "txt": r["cue"]})
        return rows
    # The Storage itself, not its endpoint: this runs in Ray tasks, which need its credentials.
    source = (
        hf_sets.iter_rows(item["path"], kind, store, limit=limit)
        if hf
        else eval_sets.iter_rows(item["path"], kind, store, limit=limit, group_column=group_column)
    )
    for r in source:
        image = {
            "pos": r["pos"],
            "sub": -1,
            "jpg": r["image"],
            "label": r.get("label", -1),
            "group": r.get("group", -1),
        }
        rows.append({**base, "has_image": True, "has_text": False, **image})
        for j, cap in enumerate(eval_sets.split_captions(r["captions"])):
            rows.append({**text, "pos": r["pos"], "sub": j, "txt": cap})
    return rows


def encode_all(
    tasks: list[Task],
    shards: list[list[str]],
    prompts: list[list[str]],
    max_samples: int | None,
    checkpoint: str,
    store: Storage,
    **pool: Any,
) -> dict[str, np.ndarray]:
    """Images, captions and prompts of every task in one Ray Data pipeline (one actor pool); returns
    the gathered columns sorted by (task, shard, pos, sub)."""
    from training.infer.batch_inference import encode_items, gpu_pool

    pool["num_actors"], pool["num_gpus"] = gpu_pool(pool.get("num_actors"), pool.get("num_gpus"))
    items = [
        {"task": t, "shard": s, "path": p, "prompts": ""}
        for t, paths in enumerate(shards)
        for s, p in enumerate(paths)
    ]
    items += [
        {"task": t, "shard": -1, "path": "", "prompts": "\n".join(p)} for t, p in enumerate(prompts) if p
    ]
    kinds = {i: (t.kind, t.group_column, bool(t.hf_dataset)) for i, t in enumerate(tasks)}
    reader = functools.partial(read_item, kinds=kinds, limit=max_samples, store=store)
    # fp32 towers (no bf16 autocast): eval numbers stay comparable across devices.
    batches = encode_items(items, reader, checkpoint, store, output=merge_towers, amp=False, **pool)
    cols = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    order = np.lexsort((cols["sub"], cols["pos"], cols["shard"], cols["task"]))
    return {k: v[order] for k, v in cols.items()}


def task_data(
    task: Task, i: int, cols: dict[str, np.ndarray], max_samples: int | None, store: Storage = LOCAL
) -> TaskData:
    """One task's rows out of the gathered columns: images in set order, their captions, its prompts."""
    if task.kind == "association":
        return association_data(task, i, cols)
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
            eval_sets.classnames(task, store),
            eval_sets.templates(task, store),
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
            d.captions[n].append(str(cols["txt"][k]))
    d.text_mu = cols["mu"][txt]
    d.text_logvar = None if logvar is None else logvar[txt]
    return d


def association_data(task: Task, i: int, cols: dict[str, np.ndarray]) -> TaskData:
    """An association task's games: candidate images (``labels`` 1 = association, ``groups`` = game) and
    one cue per game (``text_mu``, game order). A game with an undecodable candidate is left out whole."""
    logvar = cols.get("logvar")
    mine = cols["task"] == i
    img, txt = np.flatnonzero(mine & (cols["sub"] < 0)), np.flatnonzero(mine & (cols["sub"] >= 0))
    game_of = {(int(cols["shard"][k]), int(cols["pos"][k])): g for g, k in enumerate(txt)}
    game = np.array([game_of[(int(cols["shard"][k]), int(cols["pos"][k]))] for k in img], dtype=np.int64)
    ok = cols["ok"][img].astype(bool)
    bad_games = np.unique(game[~ok])
    keep_img = ~np.isin(game, bad_games)
    keep_game = ~np.isin(np.arange(len(txt)), bad_games)
    if not keep_game.any():
        raise EvalSetError(f"eval set {task.name}: no game with decodable images in {task.path}")
    renumber = np.cumsum(keep_game) - 1
    keep, cues = img[keep_img], txt[keep_game]
    return TaskData(
        task=task,
        image_mu=cols["mu"][keep],
        image_logvar=None if logvar is None else logvar[keep],
        labels=cols["label"][keep].astype(np.int64),
        groups=renumber[game[keep_img]],
        captions=[],
        n_undecodable=int((~ok).sum()),
        text_mu=cols["mu"][cues],
        text_logvar=None if logvar is None else logvar[cues],
    )


def task_metrics(d: TaskData) -> dict[str, float]:
    """Metrics of one task from its gathered embeddings."""
    if d.task.kind == "zeroshot_classification":
        c, t = len(d.classnames), len(d.templates)
        mu = d.text_mu.reshape(c, t, -1)
        logvar = None if d.text_logvar is None else d.text_logvar.reshape(c, t, -1)
        scores = zero_shot_scores(mu, logvar, d.image_mu, d.image_logvar)
        extra = {}
        if d.task.group_column is not None:
            extra = dict(
                groups=d.groups,
                group_metric=d.task.group_metric,
                group_metric_name=d.task.main_metric,
                group_exclude=d.task.group_exclude,
            )
        return classification_metrics(scores, d.labels, **extra)
    if d.task.kind == "association":
        scores, truth = [], []
        for g in range(len(d.text_mu)):
            on = d.groups == g
            ilv = None if d.image_logvar is None else d.image_logvar[on]
            tlv = None if d.text_logvar is None else d.text_logvar[g : g + 1]
            scores.append(score_matrix(d.text_mu[g : g + 1], tlv, d.image_mu[on], ilv)[0])
            truth.append(d.labels[on] == 1)
        return association_metrics(scores, truth)
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


def _validate(tasks: list[Task], store: Storage) -> tuple[list[Task], list[list[str]], list[str]]:
    kept, shards, skipped = [], [], []
    for t in tasks:
        present = (
            hf_sets.arrow_files(t, store) if t.hf_dataset else store.exists(storage.join(t.path, "test"))
        )
        if t.optional and not present:
            skipped.append(t.name)
            continue
        shards.append(hf_sets.validate_task(t, store) if t.hf_dataset else eval_sets.validate_task(t, store))
        kept.append(t)
    return kept, shards, skipped


def _write_outputs(report: EvalReport, store: Storage, plot_files: list[str]) -> None:
    lines = "".join(
        json.dumps(r, sort_keys=True, default=storage.json_default) + "\n" for r in report.results
    )
    store.write_bytes(lines.encode(), storage.join(report.out_dir, "eval_results.jsonl"))
    aggs = {
        "aggregates": report.aggregates,
        "datacomp": datacomp_names(report.aggregates),
        "missing": report.missing_aggregates,
        "skipped": report.skipped,
    }
    store.write_json(aggs, storage.join(report.out_dir, "aggregates.json"))
    store.write_json(report.analyses, storage.join(report.out_dir, "analyses.json"))
    if storage.is_s3(report.out_dir):
        report.plots = []
        for f in plot_files:
            dest = storage.join(report.out_dir, "plots", os.path.basename(f))
            with open(f, "rb") as fh:
                store.write_bytes(fh.read(), dest)
            report.plots.append(dest)


def _evaluate_tasks(
    kept: list[Task],
    shards: list[list[str]],
    max_samples: int | None,
    checkpoint: str,
    store: Storage,
    pool: dict[str, Any],
    say: Callable[[str], None] = print,
) -> tuple[list[TaskData], dict[str, dict]]:
    """Encode the tasks in one pipeline and score each; returns their data and result lines by name."""
    prompts = [
        [tp.replace("{c}", c) for c in eval_sets.classnames(t, store) for tp in eval_sets.templates(t, store)]
        if t.kind == "zeroshot_classification"
        else []
        for t in kept
    ]
    t0 = time.perf_counter()
    say(f"[eval] encoding {len(kept)} task(s) from {sum(map(len, shards))} shard(s) …")
    cols = encode_all(kept, shards, prompts, max_samples, checkpoint, store, **pool)
    say(f"[eval] encoded {len(cols['task'])} images and texts in {time.perf_counter() - t0:.0f} s")
    data = [task_data(t, i, cols, max_samples, store) for i, t in enumerate(kept)]
    lines = {}
    for i, d in enumerate(data, 1):
        metrics = task_metrics(d)
        metrics["n_undecodable"] = d.n_undecodable
        lines[d.task.name] = result_line(d.task, metrics, checkpoint)
        say(task_line(i, len(data), d.task, lines[d.task.name]))
    return data, lines


def evaluate(
    checkpoint: str,
    tasks: list[Task] | str,
    out_dir: str,
    *,
    store: Storage = LOCAL,
    num_actors: int | None = 1,
    num_gpus: float | None = 0.0,
    batch_size: int = 256,
    analyses: bool = True,
    max_samples: int | None = None,
    seed: int = 0,
    resume: bool = True,
    init: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = print,
) -> EvalReport:
    """Evaluate ``checkpoint`` on ``tasks`` (a list or a task-list name/file); see the module docstring.

    The checkpoint is loaded once in the driver and every task's layout is checked before any Ray work:
    ``CheckpointError`` / ``EvalSetError`` name the offending file. ``init`` (e.g. ``jobs.common.init_ray``)
    runs after those checks, so a bad input fails before a cluster is started or joined. ``log`` gets one
    line for what is resumed and what runs, one per task as it is scored, and one for the analyses.
    ``num_actors``/``num_gpus`` None: the cluster's GPUs (``batch_inference.gpu_pool``).
    """
    from training.eval.uncertainty.analyses import run_analyses

    say = log or (lambda line: None)
    encoder = Encoder(checkpoint, store)  # validates the checkpoint; also serves the analyses
    task_list = eval_sets.load_tasks(tasks) if isinstance(tasks, str) else list(tasks)
    done, others = previous_results(out_dir, task_list, checkpoint, store) if resume else ({}, [])
    kept, shards, skipped = _validate([t for t in task_list if t.name not in done], store)
    if not kept and not done:
        raise EvalSetError("no eval set found: " + ", ".join(t.path for t in task_list))
    say(plan_line(out_dir, task_list, done, kept, skipped))
    found, plot_files, new = {}, [], {}
    plot_dir = storage.join(out_dir, "plots") if not storage.is_s3(out_dir) else tempfile.mkdtemp()
    if kept:
        if init is not None:
            init()
        pool = dict(num_actors=num_actors, num_gpus=num_gpus, batch_size=batch_size)
        data, new = _evaluate_tasks(kept, shards, max_samples, checkpoint, store, pool, say)
        if analyses:
            t0, subject = time.perf_counter(), plot_subject(out_dir, checkpoint, encoder)
            found, plot_files = run_analyses(data, encoder, plot_dir, seed=seed, store=store, subject=subject)
            say(f"[eval] analyses and {len(plot_files)} plots: {time.perf_counter() - t0:.0f} s")
            for d in data:  # hierarchy ordering belongs to its task's line too
                if d.task.kind == "hierarchy" and isinstance(found.get("hierarchy_order"), dict):
                    order = found["hierarchy_order"]["ordered_fraction"]
                    new[d.task.name]["metrics"]["ordered_fraction"] = order
    elif analyses and store.exists(storage.join(out_dir, "analyses.json")):
        found = store.read_json(storage.join(out_dir, "analyses.json"))
    both = {**done, **new}
    results = [both[t.name] for t in task_list if t.name in both] + others
    aggs, missing = aggregates(results, task_list)
    if not storage.is_s3(out_dir):
        store.makedirs(out_dir)
    report = EvalReport(results, aggs, found, plot_files, out_dir, missing, skipped)
    _write_outputs(report, store, plot_files)
    return report
