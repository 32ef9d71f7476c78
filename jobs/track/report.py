"""``report.md`` of a track run: the DataComp-style comparison table, the CSD-vs-controls verdict, what the
filters kept, the scorer's uncertainty figures and the plots.

The verdict is computed, never written by hand: for each seed the CSD model's average minus the
no-filter and random models' averages, then the mean and the sign count over seeds. On the demo pool the
ground truth (``pool/truth.parquet``: which captions were mismatched or not English) also says how clean
each subset is, so a filter that wins or loses can be explained rather than guessed at.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from jobs.track.config import BUILD_SUBSETS
from pipeline.common import storage
from pipeline.common.storage import Storage

Row = dict[str, Any]


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v, digits) for v in x) + "]"
    return str(x)


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


def verdict(cfg: Any, evals: dict[str, Any]) -> dict[str, Any]:
    """CSD minus each control on the average, per seed; "beats" only when better on every seed."""
    out: dict[str, Any] = {}
    candidates = [s for s in ("csd", "csd_uncertainty") if s in cfg.subsets]
    controls = [s for s in ("no_filter", "random", "basic") if s in cfg.subsets]
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
        uids = subset_uids(info["path"])
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
    sc = store.read_parquet(scores_path).to_pydict()
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


def _flat(prefix: str, obj: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out.append((prefix, obj))
    elif isinstance(obj, list) and 0 < len(obj) <= _SHORT_LIST and all(_number(v) for v in obj):
        out.append((prefix, obj))  # an interval, or one figure per level or pair


_SHORT_LIST = 8  # longer lists (per class, per template) stay in the eval's own JSON


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def markdown_table(rows: list[Row]) -> str:
    tasks = sorted({t for r in rows for t in r["tasks"]})
    head = ["subset", "size", "downloaded", "samples seen", *tasks, "average"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        avg = _fmt(r["average"])
        if r["average_sd"] and not math.isnan(r["average_sd"]):
            avg += f" ± {r['average_sd']:.3f}"
        cells = [
            r["subset"],
            str(r["size"]),
            str(r["downloaded"]),
            _fmt(r["samples_seen"]),
            *[_fmt(r["tasks"].get(t)) for t in tasks],
        ]
        lines.append("| " + " | ".join([*cells, avg]) + " |")
    return "\n".join(lines)


def _header_lines(cfg: Any, built: dict[str, Any], scorer: dict[str, Any], rows: list[Row]) -> list[str]:
    seeds = ", ".join(str(s) for s in cfg.seeds)
    return [
        "# Filtering track report",
        "",
        f"Run directory `{cfg.output}`; pool of {built['n_input']} rows, {built['status'].get('success', 0)} "
        f"downloaded; scorer: {scorer['loss']} trained on the unfiltered pool for {scorer['samples_seen']} "
        f"samples seen (loss {_fmt(scorer.get('first_loss'))} → {_fmt(scorer.get('final_loss'))}); each subset "
        f"model: {cfg.train.loss.name}, {cfg.train.model}, {cfg.train.samples_seen} samples seen, seeds {seeds}.",
        "",
        "## Results (main metric per task; average = mean of the task main metrics)",
        "",
        'size: uids the subset lists (for a build subset in the build\'s filters.subset_scope; "metadata" '
        "= DataComp's count, downloaded or not); downloaded: those in the shards, which the model trains on.",
        "",
        markdown_table(rows),
    ]


def _verdict_lines(verdicts: dict[str, Any]) -> list[str]:
    lines = ["", "## CSD filter vs controls (equal samples seen)", ""]
    if not verdicts:
        lines.append("No CSD subset with a control in this run.")
    for key, v in verdicts.items():
        cand, ctrl = key.split("_vs_")
        by_seed = ", ".join(
            f"seed {s}: {d:+.4f}" for s, d in zip(v["seeds"], v["diff_by_seed"], strict=False)
        )
        word = "beats" if v["beats"] else "does not beat"
        lines.append(
            f"- **{cand}** {word} **{ctrl}** on the average: mean difference {v['mean_diff']:+.4f} "
            f"({v['wins']}/{len(v['diff_by_seed'])} seeds better; {by_seed})."
        )
    return lines


def _ground_truth_lines(
    detection: dict[str, float] | None, purity: dict[str, dict[str, float]] | None
) -> list[str]:
    """The demo-only sections: how well the scores find bad captions, and what each subset kept."""
    lines: list[str] = []
    if detection:
        lines += ["", "## Does the scorer see the bad captions? (ROC AUC on the pool's ground truth)", ""]
        lines.append(", ".join(f"{k} {_fmt(v)}" for k, v in detection.items()) + " (0.5 = chance).")
    if purity:
        lines += ["", "## What each subset kept (demo ground truth: caption noise)", ""]
        kinds = sorted({k for d in purity.values() for k in d})
        lines.append("| subset | " + " | ".join(kinds) + " |")
        lines.append("|" + "---|" * (len(kinds) + 1))
        for name, d in purity.items():
            lines.append(f"| {name} | " + " | ".join(f"{100 * d.get(k, 0.0):.1f}%" for k in kinds) + " |")
    return lines


def _get(tree: Any, path: str) -> Any:
    """``tree["a"]["b"]`` for ``path`` "a.b"; None where a level is missing or not a dict (a deterministic
    scorer's analyses are "not applicable" strings)."""
    for key in path.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


# The paper's σ² observations (ProLIP §4.3) as the analyses measure them: claim, figure, its interval, what
# the paper reports or predicts.
_CLAIMS = (
    ("mean tr(Σ), text", "sigma2_modality.text_mean_trace", None, "larger than the image's (§4.3)"),
    ("mean tr(Σ), image", "sigma2_modality.image_mean_trace", None, ""),
    ("image ⊂ own caption (H > 0)", "inclusion.image_in_caption.rate", "inclusion.image_in_caption.ci95", ""),
    ("original ⊂ masked, text", "inclusion.original_in_masked_text.rate", None, ""),
    ("original ⊂ masked, image", "inclusion.original_in_masked_image.rate", None, "> 0.70 (HierarImgs)"),
    (
        "Spearman(caption words, tr Σ_t)",
        "sigma2_length.spearman_words_vs_trace",
        "sigma2_length.ci95",
        "< 0: shorter, more uncertain",
    ),
    (
        "adjacent hierarchy levels ordered",
        "hierarchy_order.ordered_fraction",
        "hierarchy_order.ordered_fraction_ci95",
        "0.90 (HierarCaps)",
    ),
    (
        "… by caption length alone",
        "hierarchy_order.length_only_ordered_fraction",
        None,
        "(the set's baseline)",
    ),
    (
        "… where the general caption is the longer",
        "hierarchy_order.against_length_ordered_fraction",
        None,
        "(length points the wrong way)",
    ),
)


def _claim_lines(analyses: dict[str, Any]) -> list[str]:
    """The claims above as a short table before the full one; empty for a scorer without σ²."""
    rows = [
        (label, _get(analyses, fig), _get(analyses, ci) if ci else None, paper)
        for label, fig, ci, paper in _CLAIMS
    ]
    rows = [r for r in rows if _number(r[1])]
    if not rows:
        return []
    lines = [
        "",
        "The paper's σ² observations in miniature (interval: 95% over resampled eval pictures; training seeds",
        "move these figures by more, docs/track.md):",
        "",
        "| claim | figure | 95% interval | paper |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {label} | {_fmt(v, 4)} | {_fmt(ci, 4) if ci else '–'} | {paper or '–'} |"
        for label, v, ci, paper in rows
    ]
    return lines


def _scorer_lines(cfg: Any, scorer_eval: dict[str, Any]) -> list[str]:
    """The scorer's uncertainty analyses: the paper's claims first, then every figure as a flat table, and
    its plots linked relative to the run."""
    lines: list[str] = []
    analyses = scorer_eval.get("analyses") or {}
    if analyses:
        flat: list[tuple[str, Any]] = []
        _flat("", analyses, flat)
        lines += ["", "## Uncertainty (scorer, measured on the demo eval sets)", *_claim_lines(analyses)]
        lines += ["", "| quantity | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v, 4)} |" for k, v in flat]
    plots = scorer_eval.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""]
        for path in plots:
            rel = path[len(cfg.output) :].lstrip("/") if path.startswith(cfg.output) else path
            lines.append(f"![{rel.rsplit('/', 1)[-1]}]({rel})")
    return lines


def _timing_lines(
    scores: dict[str, Any], timings: dict[str, float], machine: dict[str, float] | None, parallel: int = 1
) -> list[str]:
    lines = [
        "",
        "## Timings (seconds)",
        "",
        ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
        "",
        *(
            [f"Subset models trained {parallel} at a time (train_parallel): their times overlap.", ""]
            if parallel > 1
            else []
        ),
        f"Scoring: {scores['n_rows']} pairs at {scores['pairs_per_s']:.0f} pairs/s.",
        "",
    ]
    if machine:
        lines += [
            f"Machine: {machine['cores']:.0f} cores, fp32 matmul {machine['matmul_gflops']:.1f} GFLOP/s "
            "at the start of this invocation (a yardstick for comparing these timings between runs).",
            "",
        ]
    return lines


def write_report(
    cfg: Any,
    built: dict[str, Any],
    scores: dict[str, Any],
    subsets: dict[str, Any],
    models: dict[str, Any],
    scorer: dict[str, Any],
    evals: dict[str, Any],
    timings: dict[str, float],
    machine: dict[str, float] | None = None,
    store: Storage | None = None,
) -> tuple[str, list[Row], dict[str, Any]]:
    """Write ``report.md`` and ``track_results.json`` under ``cfg.output``; returns (report path, table,
    verdicts). ``store`` defaults to the one ``cfg.s3_endpoint`` names."""
    store = store if store is not None else Storage.from_env(cfg.s3_endpoint)
    rows = comparison_table(cfg, subsets, models, evals)
    verdicts = verdict(cfg, evals)
    # The build's own subsets that train no model here (the demo's ``basic``) still show what they keep.
    untrained = {
        f"{name} (not trained)": {"path": path}
        for name, path in (built.get("subsets") or {}).items()
        if name in BUILD_SUBSETS and name not in subsets
    }
    purity = subset_purity(cfg, {**subsets, **untrained}, store)
    detection = noise_detection(cfg, scores["path"], store)
    lines = [
        *_header_lines(cfg, built, scorer, rows),
        *_verdict_lines(verdicts),
        *_ground_truth_lines(detection, purity),
        *_scorer_lines(cfg, evals.get("scorer", {})),
        *_timing_lines(scores, timings, machine, cfg.train_parallel),
    ]
    path = storage.join(cfg.output, "report.md")
    store.write_bytes("\n".join(lines).encode(), path)
    results = {
        "table": rows,
        "verdict": verdicts,
        "purity": purity,
        "noise_detection": detection,
        "timings": timings,
        "machine": machine or {},
    }
    store.write_json(results, storage.join(cfg.output, "track_results.json"))
    return path, rows, verdicts
