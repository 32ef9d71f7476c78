"""The curation parts of a track's report: what the build's curation stage found (against the demo pool's
planted truth) and how the uncertainty-native selection methods and the embedding-only filters compare with
``csd`` and a CLIP-score fraction at the same size.

``report.py`` adds ``section``'s lines after its ground-truth sections and its figures to
``track_results.json`` under ``"curation"``; ``seeds.py`` adds ``selection_figures`` of each run to its table
over scorer seeds (mean, spread, wins per seed) and ``selection_verdict`` under it. All figures are computed
from the run's files, never written by hand.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import Storage

# The selection methods a track may train (jobs/track/config.py) and the references they are held against:
# csd (ProLIP App. C.8) and the CLIP-score-style fraction of the same size (``clip_fraction = csd_fraction``).
METHODS = ("csd_ucb", "csd_inclusion", "csd_posterior", "neg_clip_loss", "norm_sim")
REFERENCES = ("csd", "scorer_cosine")
ACCEPT = 0.95  # recall and precision the planted truth must be found with (issue acceptance)


def selection_label(method: str, ref: str) -> str:
    return f"{method} − {ref} (average)"


def selection_tests() -> dict[str, str]:
    """Every selection figure counts as a win on a seed where it is > 0."""
    return {selection_label(m, r): "> 0" for m in METHODS for r in REFERENCES}


def _average(evals: dict[str, Any], run: str) -> float | None:
    value = evals.get(run, {}).get("aggregates", {}).get("average")
    return float(value) if value is not None else None


def selection(cfg: Any, evals: dict[str, Any]) -> dict[str, Any]:
    """Per method and reference: the difference of the averages per subset-model seed, their mean, SD,
    range and wins (better on a seed)."""
    out: dict[str, Any] = {}
    for method in (m for m in METHODS if m in cfg.subsets):
        for ref in (r for r in REFERENCES if r in cfg.subsets):
            diffs = []
            for seed in cfg.seeds:
                a, b = _average(evals, f"{method}-seed{seed}"), _average(evals, f"{ref}-seed{seed}")
                if a is not None and b is not None:
                    diffs.append(a - b)
            if diffs:
                out[f"{method}_vs_{ref}"] = {
                    "diff_by_seed": diffs,
                    "mean_diff": statistics.fmean(diffs),
                    "sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                    "min": min(diffs),
                    "max": max(diffs),
                    "wins": sum(d > 0 for d in diffs),
                    "seeds": list(cfg.seeds),
                }
    return out


def build_figures(cfg: Any, built: dict[str, Any], store: Storage) -> dict[str, Any]:
    """The build's curation counts and, on the demo pool, how well they match the planted truth."""
    out: dict[str, Any] = dict(built.get("curation") or {})
    truth_path = storage.join(cfg.output, "pool", "truth.parquet")
    status_path = storage.join(cfg.output, "metadata", "status.parquet")
    if cfg.build.metadata or not store.exists(truth_path) or not store.exists(status_path):
        return out
    truth = store.read_parquet(truth_path)
    if "semantic_dup_of" not in truth.column_names:
        return out  # a pool generated before the planted truth
    from pipeline.demo.planted import curation_figures

    out["truth"] = curation_figures(truth, store.read_parquet(status_path))
    return out


def _pct(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _build_lines(cfg: Any, fig: dict[str, Any]) -> list[str]:
    if not fig:
        return []
    leaks = fig.get("eval_leaks") or {}
    lines = ["", "## Curation in the build (semantic dedup, eval-set decontamination)", ""]
    per_task = ", ".join(f"{t} {n}" for t, n in sorted(leaks.items())) or "none"
    lines.append(
        f"Eval leaks removed, per task: {per_task}; semantic duplicates: {fig.get('semantic_duplicates', 0)} "
        f"({fig.get('clusters', 0)} k-means clusters, cosine > {cfg.build.dedupe.semantic_threshold:g}). "
        "No subset lists a leak."
    )
    truth = fig.get("truth")
    if truth:
        ok = (
            truth["semantic_recall"] >= ACCEPT
            and truth["semantic_precision"] >= ACCEPT
            and truth["leak_recall"] >= ACCEPT
            and truth["false_leaks"] == 0
        )
        lines += [
            "",
            "Against the demo pool's planted truth (pool/truth.parquet):",
            "",
            "| | planted | found | recall | precision / false |",
            "|---|---|---|---|---|",
            f"| semantic duplicates (pairs) | {truth['semantic_planted_pairs']} | {truth['semantic_marked']} | "
            f"{_pct(truth['semantic_recall'])} | {_pct(truth['semantic_precision'])} |",
            f"| eval leaks | {truth['leaks_planted']} | {truth['leaks_flagged']} | {_pct(truth['leak_recall'])} | "
            f"{truth['false_leaks']} false |",
            "",
            f"{'Meets' if ok else 'Misses'} the bar: recall and precision ≥ {ACCEPT:.0%}, no false leak.",
        ]
    return lines


def _selection_lines(sel: dict[str, Any]) -> list[str]:
    if not sel:
        return []
    lines = [
        "",
        "## Selection methods vs csd and the CLIP-score fraction (equal size, equal samples seen)",
        "",
        "| method | vs | difference by seed | mean | SD | wins |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in sel.items():
        method, ref = key.split("_vs_")
        by_seed = ", ".join(f"{d:+.4f}" for d in v["diff_by_seed"])
        lines.append(
            f"| {method} | {ref} | {by_seed} | {v['mean_diff']:+.4f} | {v['sd']:.4f} | "
            f"{v['wins']}/{len(v['diff_by_seed'])} |"
        )
    lines += ["", "One scorer seed per run: `jobs.track.seeds` puts runs of other scorer seeds side by side."]
    return lines


def section(
    cfg: Any, built: dict[str, Any], evals: dict[str, Any], store: Storage
) -> tuple[list[str], dict[str, Any]]:
    """The report's curation lines and the figures for ``track_results.json``."""
    fig = build_figures(cfg, built, store)
    sel = selection(cfg, evals)
    return [*_build_lines(cfg, fig), *_selection_lines(sel)], {"build": fig, "selection": sel}


# --- over scorer seeds (jobs.track.seeds) --------------------------------------------------------------


def _table_average(results: dict[str, Any], subset: str) -> float | None:
    for row in results.get("table", []):
        if row.get("subset") == subset and row.get("average") is not None:
            return float(row["average"])
    return None


def selection_figures(results: dict[str, Any]) -> dict[str, float | None]:
    """One run's method − reference differences of the (seed-mean) averages, for the methods it trained."""
    out: dict[str, float | None] = {}
    for method in METHODS:
        a = _table_average(results, method)
        if a is None:
            continue
        for ref in REFERENCES:
            b = _table_average(results, ref)
            out[selection_label(method, ref)] = a - b if b is not None else None
    truth = ((results.get("curation") or {}).get("build") or {}).get("truth") or {}
    for key in ("semantic_recall", "semantic_precision", "leak_recall", "false_leaks"):
        if key in truth:
            out[f"curation: {key.replace('_', ' ')}"] = truth[key]
    return out


def selection_verdict(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Which method beats both references on every run (scorer seed): only such a one may become a default
    subset of the track (docs/decisions/0052-uncertainty-native-selection.md)."""
    lines = []
    for method in METHODS:
        labels = [selection_label(method, r) for r in REFERENCES]
        values = [[run["figures"].get(label) for run in runs.values()] for label in labels]
        if not any(v is not None for vs in values for v in vs):
            continue
        every = all(v is not None and v > 0 for vs in values for v in vs)
        wins = [sum(v is not None and v > 0 for v in vs) for vs in values]
        lines.append(
            f"- {method}: better than csd on {wins[0]}/{len(runs)} runs, than scorer_cosine on {wins[1]}/{len(runs)}"
            f" — {'wins on every seed' if every else 'does not win on every seed'}"
        )
    return ["", "Selection methods over the runs:", *lines] if lines else []
