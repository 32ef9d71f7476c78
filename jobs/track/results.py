"""What a track's report says, computed: the comparison table, the CSD-vs-controls verdict, subset purity
and how well each score finds the pool's bad captions.

The verdict is computed, never written by hand: for each seed the CSD model's average minus the
no-filter and random models' averages, then the mean and the sign count over seeds. On the demo pool the
ground truth (``pool/truth.parquet``: which captions were mismatched or not English) also says how clean
each subset is, so a filter that wins or loses can be explained rather than guessed at.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import Storage

Row = dict[str, Any]
CANDIDATES = ("csd", "csd_uncertainty", "csd_ucb", "csd_inclusion", "csd_posterior")  # CSD and its variants


def _main_metrics(ev: dict[str, Any]) -> dict[str, float]:
    """Task → main-metric value of an evaluation's result lines (DataComp's schema)."""
    from training.eval.results import main_value

    values = {r.get("task", r["key"]): main_value(r) for r in ev.get("results", [])}
    return {t: v for t, v in values.items() if v is not None}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def comparison_table(
    cfg: Any, subsets: dict[str, Any], models: dict[str, Any], evals: dict[str, Any]
) -> list[Row]:
    """One row per subset: its size as listed (DataComp's count for a build subset in metadata scope), how
    many of those downloaded (what the model trains on), samples seen, each task's main metric and the
    average, mean over seeds."""
    rows: list[Row] = []
    for name in cfg.subsets:
        runs = [f"{name}-seed{s}" for s in cfg.seeds]
        per_task: dict[str, list[float]] = {}
        averages: list[float] = []
        for run in runs:
            ev = evals.get(run, {})
            for task, value in _main_metrics(ev).items():
                per_task.setdefault(task, []).append(value)
            if "average" in ev.get("aggregates", {}):
                averages.append(float(ev["aggregates"]["average"]))
        avg, sd = _mean_sd(averages)
        rows.append(
            {
                "subset": name,
                "size": subsets[name]["size"],
                "downloaded": subsets[name].get("downloaded", subsets[name]["size"]),
                "samples_seen": models[runs[0]]["samples_seen"] if runs[0] in models else None,
                "tasks": {t: _mean_sd(v)[0] for t, v in per_task.items()},
                "average": avg,
                "average_sd": sd,
                "average_by_seed": averages,
            }
        )
    return rows


def task_values(cfg: Any, evals: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """subset → task (and "average") → one main-metric value per seed that has it: the report's figure
    draws their mean and spread."""
    out: dict[str, dict[str, list[float]]] = {}
    for name in cfg.subsets:
        per: dict[str, list[float]] = {}
        for seed in cfg.seeds:
            ev = evals.get(f"{name}-seed{seed}", {})
            for task, value in _main_metrics(ev).items():
                per.setdefault(task, []).append(float(value))
            if "average" in ev.get("aggregates", {}):
                per.setdefault("average", []).append(float(ev["aggregates"]["average"]))
        out[name] = per
    return out


def verdict(cfg: Any, evals: dict[str, Any]) -> dict[str, Any]:
    """CSD (and each uncertainty-native method) minus each control on the average, per seed; "beats" only
    when better on every seed. ``clip_score_l14`` is DataComp's CLIP L/14 score at the CSD fraction, the
    comparison of ProLIP's Table C.7."""
    out: dict[str, Any] = {}
    candidates = [s for s in CANDIDATES if s in cfg.subsets]
    controls = [s for s in ("no_filter", "random", "basic", "clip_score_l14") if s in cfg.subsets]
    for cand in candidates:
        for ctrl in controls:
            diffs = []
            for seed in cfg.seeds:
                a = evals.get(f"{cand}-seed{seed}", {}).get("aggregates", {}).get("average")
                b = evals.get(f"{ctrl}-seed{seed}", {}).get("aggregates", {}).get("average")
                if a is not None and b is not None:
                    diffs.append(float(a) - float(b))
            if diffs:
                out[f"{cand}_vs_{ctrl}"] = {
                    "diff_by_seed": diffs,
                    "mean_diff": statistics.fmean(diffs),
                    "wins": sum(d > 0 for d in diffs),
                    "seeds": list(cfg.seeds),
                    "beats": all(d > 0 for d in diffs),
                }
    return out


def _pool_truth(cfg: Any, store: Storage) -> dict[str, list] | None:
    """The demo pool's ground truth as columns, or None when the run was built from real metadata."""
    truth_path = storage.join(cfg.output, "pool", "truth.parquet")
    if cfg.build.metadata or not store.exists(truth_path):
        return None
    return store.read_parquet(truth_path).to_pydict()


def subset_purity(cfg: Any, subsets: dict[str, Any], store: Storage) -> dict[str, dict[str, float]] | None:
    """Share of clean / mismatched / non-English captions in each subset (demo pool ground truth)."""
    from pipeline.subsets.uid_files import subset_uids

    truth = _pool_truth(cfg, store)
    if truth is None or "uid" not in truth or "caption_noise" not in truth:
        return None
    noise = dict(zip(truth["uid"], truth["caption_noise"], strict=True))
    out: dict[str, dict[str, float]] = {}
    for name, info in subsets.items():
        with store.open_input(info["path"]) as fh:  # the run directory may be on S3
            uids = subset_uids(fh)
        kinds = [noise.get(u, "unknown") or "clean" for u in uids]
        n = max(len(kinds), 1)
        out[name] = {k: kinds.count(k) / n for k in sorted(set(kinds))}
    return out


def _auroc(score: list[float], positive: list[bool]) -> float:
    """P(score of a positive > score of a negative), ties half (the Mann–Whitney U form of ROC AUC)."""
    import numpy as np
    from scipy.stats import rankdata

    s, y = np.asarray(score, float), np.asarray(positive, bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def noise_detection(cfg: Any, scores_path: str, store: Storage) -> dict[str, float] | None:
    """How well each score separates the demo pool's bad captions (ground truth), as ROC AUC: CSD and
    −cosine for mismatched captions, Σσ²_t for mismatched, non-English and uninformative (level-0, "a photo
    of an object") ones, and the mean Σσ²_t of each group beside clean specific captions. 0.5 = chance."""
    truth = _pool_truth(cfg, store)
    if truth is None:
        return None
    noise = dict(zip(truth["uid"], truth["caption_noise"], strict=True))
    level = dict(zip(truth["uid"], truth["level"], strict=True))
    from training.infer.scoring import read_scores  # loads torch: not on the --help path

    sc = read_scores(scores_path, store).to_pydict()
    rows = [i for i, ok in enumerate(sc["ok"]) if ok and sc["uid"][i] in noise]
    kinds = [noise[sc["uid"][i]] for i in rows]
    out = {
        "csd_auroc_mismatched": _auroc([sc["csd"][i] for i in rows], [k == "mismatched" for k in kinds]),
        "neg_cosine_auroc_mismatched": _auroc(
            [-sc["cosine"][i] for i in rows], [k == "mismatched" for k in kinds]
        ),
    }
    if "text_unc" in sc and not all(math.isnan(sc["text_unc"][i]) for i in rows):
        unc = [sc["text_unc"][i] for i in rows]
        out["text_unc_auroc_mismatched"] = _auroc(unc, [k == "mismatched" for k in kinds])
        out["text_unc_auroc_non_english"] = _auroc(unc, [k == "non_english" for k in kinds])
        vague = [k == "clean" and level[sc["uid"][i]] == 0 for k, i in zip(kinds, rows, strict=True)]
        out["text_unc_auroc_uninformative"] = _auroc(unc, vague)
        groups = {
            "clean_specific": [k == "clean" and not v for k, v in zip(kinds, vague, strict=True)],
            "uninformative": vague,
            "non_english": [k == "non_english" for k in kinds],
            "mismatched": [k == "mismatched" for k in kinds],
        }
        for name, member in groups.items():
            picked = [u for u, m in zip(unc, member, strict=True) if m]
            out[f"text_unc_mean_{name}"] = sum(picked) / len(picked) if picked else float("nan")
    return out
