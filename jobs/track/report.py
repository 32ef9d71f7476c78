"""``report.md`` and ``report.html`` of a track run: the comparison table and its figure, the loss curves,
the verdicts, what the filters kept, the scorer's uncertainty figures and plots, written from what
``jobs/track/results.py`` computes; every figure of the analyses stays in the eval's ``analyses.json``,
which the report links. ``jobs/track/render.py`` draws the figures and the HTML."""

from __future__ import annotations

import math
from typing import Any

from jobs.track import curation_report
from jobs.track.config import BUILD_SUBSETS
from jobs.track.datacomp.baselines import SAME_FRACTION
from jobs.track.datacomp.recipe import recipe_changes, unofficial_line
from jobs.track.datacomp.submission import datacomp_view, view_lines, write_submissions
from jobs.track.results import Row, comparison_table, noise_detection, subset_purity, task_values, verdict
from pipeline.common import storage
from pipeline.common.storage import Storage


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v, digits) for v in x) + "]"
    return str(x)


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


def _scorer_words(scorer: dict[str, Any]) -> str:
    if scorer.get("imported_from"):
        return f"scorer: {scorer['loss']} from {scorer['imported_from']} (not trained here)"
    return (
        f"scorer: {scorer['loss']} trained on the unfiltered pool for {scorer['samples_seen']} samples seen "
        f"(loss {_fmt(scorer.get('first_loss'))} → {_fmt(scorer.get('final_loss'))})"
    )


def _header_lines(
    cfg: Any, built: dict[str, Any], scorer: dict[str, Any], rows: list[Row], view: list[dict[str, Any]]
) -> list[str]:
    seeds = ", ".join(str(s) for s in cfg.seeds)
    pool = f"existing shards {built['adopted_from']}" if built.get("adopted_from") else "pool"
    return [
        "# Filtering track report",
        "",
        f"Run directory `{cfg.output}`; {pool} of {built['n_input']} rows, {built['status'].get('success', 0)} "
        f"downloaded; {_scorer_words(scorer)}; each subset model: {cfg.train.loss.name}, {cfg.train.model}, "
        f"{cfg.train.samples_seen} samples seen, seeds {seeds}; recipe {cfg.recipe or 'not locked'}"
        f"{' (unofficial)' if cfg.unofficial else ''}, pool rules {cfg.pool}.",
        "",
        "The same report with every figure inline, as one file: `report.html`; DataComp's submission files of "
        "each subset (nothing uploaded): `submission/<subset>/`.",
        "",
        "## DataComp's view (mean over seeds)",
        "",
        *view_lines(view),
        "",
        "## Results (main metric per task; average = mean of the task main metrics)",
        "",
        'size: uids the subset lists (for a build subset in the build\'s filters.subset_scope; "metadata" '
        "= DataComp's count, downloaded or not); downloaded: those in the shards, which the model trains on.",
        "",
        markdown_table(rows),
        "",
        "![each subset's main metrics side by side](figures/results.png)",
        "",
        "![training loss of the scorer and every subset model](figures/loss_curves.png)",
    ]


def _verdict_lines(verdicts: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## CSD filter vs controls (equal samples seen; clip_score_l14: DataComp's CLIP L/14 score)",
        "",
    ]
    if not verdicts:
        lines.append("No CSD subset with a control in this run.")
    for key, v in verdicts.items():
        cand, ctrl = key.split("_vs_")
        by_seed = ", ".join(
            f"seed {s}: {d:+.4f}" for s, d in zip(v["seeds"], v["diff_by_seed"], strict=False)
        )
        word = "beats" if v["beats"] else "does not beat"
        same = " (same fraction)" if ctrl == SAME_FRACTION else ""
        lines.append(
            f"- {cand} vs {ctrl}{same}: **{word}** on the average, mean difference {v['mean_diff']:+.4f} "
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
        rel = _relative(cfg, storage.join(scorer_eval.get("dir") or storage.join(cfg.output, "eval", "scorer"),
                                          "analyses.json"))  # fmt: skip
        lines += ["", "## Uncertainty (scorer, measured on the demo eval sets)", *_claim_lines(analyses)]
        lines += ["", f"Every figure of the analyses, with its interval and sample counts: [{rel}]({rel})."]
    plots = scorer_eval.get("plots") or []
    if plots:
        lines += ["", "## Plots (scorer)", ""]
        for path in plots:
            rel = _relative(cfg, path)
            lines.append(f"![{rel.rsplit('/', 1)[-1]}]({rel})")
    return lines


def _relative(cfg: Any, path: str) -> str:
    return path[len(cfg.output) :].lstrip("/") if path.startswith(cfg.output) else path


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
    """Write ``report.md``, ``report.html``, ``figures/`` and ``track_results.json`` under ``cfg.output``;
    returns (report path, table, verdicts). ``store`` defaults to the one ``cfg.storage`` names."""
    store = store if store is not None else cfg.storage.store()
    rows = comparison_table(cfg, subsets, models, evals)
    verdicts = verdict(cfg, evals)
    view = datacomp_view(cfg, evals)
    from jobs.track.config import RECIPES

    marks = {"unofficial": bool(cfg.unofficial), "recipe": cfg.recipe, "recipe_changes": (
        recipe_changes(cfg.train, RECIPES[cfg.recipe]) if cfg.recipe in RECIPES else [])}  # fmt: skip
    submissions = write_submissions(cfg, subsets, models, evals, store, marks)
    # The build's own subsets that train no model here (the demo's ``basic``) still show what they keep.
    untrained = {
        f"{name} (not trained)": {"path": path}
        for name, path in (built.get("subsets") or {}).items()
        if name in BUILD_SUBSETS and name not in subsets
    }
    purity = subset_purity(cfg, {**subsets, **untrained}, store)
    detection = noise_detection(cfg, scores["path"], store)
    from jobs.track.render import html_report, write_figures

    write_figures(cfg, task_values(cfg, evals), models, scorer, store)
    curation_lines, curation = curation_report.section(cfg, built, evals, store)
    first = unofficial_line(cfg, RECIPES)
    lines = [
        *([first, ""] if first else []),
        *_header_lines(cfg, built, scorer, rows, view),
        *_verdict_lines(verdicts),
        *_ground_truth_lines(detection, purity),
        *curation_lines,
        *_scorer_lines(cfg, evals.get("scorer", {})),
        *_timing_lines(scores, timings, machine, cfg.train_parallel),
    ]
    path = storage.join(cfg.output, "report.md")
    text = "\n".join(lines)
    store.write_bytes(text.encode(), path)
    page = html_report(text, cfg.output, store, f"Filtering track report: {cfg.output}")
    store.write_bytes(page.encode(), storage.join(cfg.output, "report.html"))
    results = {
        **marks,
        "datacomp_view": view,
        "submissions": submissions,
        "table": rows,
        "verdict": verdicts,
        "purity": purity,
        "noise_detection": detection,
        "curation": curation,
        "timings": timings,
        "machine": machine or {},
    }
    store.write_json(results, storage.join(cfg.output, "track_results.json"))
    return path, rows, verdicts
