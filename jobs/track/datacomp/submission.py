"""DataComp's five-number view of a track and the ``submission/`` folder per subset.

The view: per subset, DataComp's aggregates — ImageNet, ImageNet dist. shifts, VTAB, Retrieval, Average
(training/eval/results.py, ``aggregate_scores.py``'s rules) — mean over seeds; an aggregate whose tasks the
task list lacks shows "–" and is named below the table. The per-task table follows it in the report.

``submission/<subset>/`` holds what DataComp's ``evaluate.py --submit`` packages for the leaderboard,
without uploading anything: ``samples/<subset>.npy`` (the uids, ``--samples``), ``results.jsonl`` (the
evaluation of the first seed's model, ``eval_results.jsonl``), ``checkpoint/`` (that model exported to
open_clip, ``--upload_checkpoint``; absent, with the reason in the YAML, for a model open_clip cannot
hold) and ``submission.yaml`` with the fields its submission records (scale, model, dataset size, batch
size, learning rate, method name, track, the per-task main metrics; author, e-mail and the Hugging Face
names left for the submitter), plus whether the run is unofficial.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import yaml

from pipeline.common import storage
from pipeline.common.storage import Storage

VIEW = (("imagenet", "ImageNet"), ("imagenet_dist_shift", "ImageNet dist. shifts"), ("vtab", "VTAB"),
        ("retrieval", "Retrieval"), ("average", "Average"))  # fmt: skip


def datacomp_view(cfg: Any, evals: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per subset: each of DataComp's five numbers, mean over the seeds that have it (None: none)."""
    rows = []
    for name in cfg.subsets:
        row: dict[str, Any] = {"subset": name}
        for key, _ in VIEW:
            values = [
                float(v)
                for seed in cfg.seeds
                if (v := evals.get(f"{name}-seed{seed}", {}).get("aggregates", {}).get(key)) is not None
            ]
            row[key] = statistics.fmean(values) if values else None
        rows.append(row)
    return rows


def view_lines(rows: list[dict[str, Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"

    head = ["subset", *(label for _, label in VIEW)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([r["subset"], *(cell(r[k]) for k, _ in VIEW)]) + " |" for r in rows]
    lacking = [label for key, label in VIEW if all(r[key] is None for r in rows)]
    if lacking:
        lines += ["", f"Not in this task list: {', '.join(lacking)} (DataComp's 38 tasks give all five)."]
    return lines


def _yaml_fields(cfg: Any, name: str, info: dict[str, Any], ev: dict[str, Any], ckpt: str | None) -> dict:
    from training.eval.results import main_value

    train = cfg.train
    fields = {
        "track": "filtering",
        "scale": cfg.recipe or "custom",
        "model": train.model,
        "dataset_size": info.get("size"),
        "checkpoint": ckpt,
        "batch_size": train.global_batch_size,
        "learning_rate": train.optim.lr,
        "samples_seen": train.samples_seen,
        "method_name": name,
        "samples": f"samples/{name}.npy",
        "author": None,
        "email": None,
        "hf_username": None,
        "hf_repo_name": None,
        "writeup": None,
        "unofficial": bool(cfg.unofficial),
        "seed": cfg.seeds[0],
    }
    # DataComp's record holds each task's main metric under the task's display name
    fields["main_metrics"] = {
        ln.get("dataset") or ln.get("key"): main_value(ln) for ln in ev.get("results", [])
    }
    return fields


def _export(checkpoint: str, out: str, info: dict[str, Any]) -> tuple[str | None, str]:
    """The model exported to open_clip under ``out``; (its directory or None, why not)."""
    if storage.is_s3(checkpoint) or storage.is_s3(out):
        return None, "checkpoints on S3 are not exported here: run jobs.export_checkpoint on a local copy"
    from training.imports.export import export_open_clip
    from training.model.checkpoint import CheckpointError

    try:
        return str(export_open_clip(checkpoint, out, info)), ""
    except CheckpointError as exc:  # a layout open_clip cannot hold (ExportError) or an unreadable checkpoint
        return None, str(exc)


def write_submissions(
    cfg: Any, subsets: dict[str, Any], models: dict[str, Any], evals: dict[str, Any], store: Storage,
    marks: dict[str, Any],
) -> dict[str, str]:  # fmt: skip
    """``submission/<subset>/`` for every trained subset (module docstring); subset → its directory."""
    out: dict[str, str] = {}
    for name in cfg.subsets:
        run = f"{name}-seed{cfg.seeds[0]}"
        if run not in models:
            continue
        root = storage.join(cfg.output, "submission", name)
        store.write_bytes(
            store.read_bytes(subsets[name]["path"]), storage.join(root, "samples", f"{name}.npy")
        )
        ev = evals.get(run, {})
        results = storage.join(ev.get("dir") or storage.join(cfg.output, "eval", run), "eval_results.jsonl")
        if store.exists(results):
            store.write_bytes(store.read_bytes(results), storage.join(root, "results.jsonl"))
        ckpt, why = _export(
            models[run]["checkpoint"], storage.join(root, "checkpoint"), {**marks, "subset": name}
        )
        fields = _yaml_fields(
            cfg, name, subsets[name], ev, "checkpoint/open_clip_model.safetensors" if ckpt else None
        )
        if why:
            fields["checkpoint_note"] = why
        store.write_bytes(
            yaml.safe_dump(fields, sort_keys=False).encode(), storage.join(root, "submission.yaml")
        )
        out[name] = root
    return out
