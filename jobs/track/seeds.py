"""``python -m jobs.track.seeds RUN [RUN ...] [--out FILE.md]``: one table over track runs that differ in
their seed.

A track run trains one scorer; ``--set seeds=[k]`` with its own ``--set output=…`` is one scorer seed. The
scorer's σ² figures move more between training seeds than their eval-sample intervals say (docs/track.md,
"Reading the report"), so a claim about the scorer is a claim over seeds. This reads each run's ``track_results.json``
and ``track_state.json`` (local or ``s3://``) and prints, per run and over the runs, the filter's verdicts,
the scorer's CSD AUC and the paper's σ² observations with their intervals: mean, standard deviation, range
and, for the signed figures, on how many runs they hold. A run that lacks a figure shows "–" and leaves it
out of the summary; a directory that is not a finished track run is an error naming the missing file.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import field
from typing import Any

from jobs.common import job_main, parse_job_config
from jobs.track import curation_report
from jobs.track.report import _CLAIMS, _fmt, _get, _number
from pipeline.common import storage
from pipeline.common.config import Names, config_class
from pipeline.common.errors import InputError, JobError, UsageError, naming
from pipeline.common.storage import Storage
from pipeline.common.storage_config import StorageConfig

# (label, where, test): ``where`` is "results:…" (track_results.json) or "scorer:…" (the scorer's analyses);
# ``test`` names what holds on a run, counted over the runs.
_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("csd − no_filter (average)", "results:verdict.csd_vs_no_filter.mean_diff", "> 0"),
    ("csd − random (average)", "results:verdict.csd_vs_random.mean_diff", "> 0"),
    ("csd − basic (average)", "results:verdict.csd_vs_basic.mean_diff", "> 0"),
    ("csd_uncertainty − csd (average)", "derived:csd_uncertainty_minus_csd", ""),
    ("csd zero-shot shapes", "derived:csd_shapes", ""),
    ("CSD AUC, mismatched captions", "results:noise_detection.csd_auroc_mismatched", ""),
    ("text Σσ² > image Σσ²", "scorer:sigma2_modality.text_gt_image", "true"),
)


def _load(run: str, store: Storage) -> tuple[dict[str, Any], dict[str, Any]]:
    out = []
    for name in ("track_results.json", "track_state.json"):
        path = storage.join(run, name)
        if not store.exists(path):
            raise InputError(f"{path}: not found; is {run} a finished track run (python -m jobs.track)?")
        out.append(store.read_json(path))
    return out[0], out[1]


def _table_value(results: dict[str, Any], subset: str, key: str) -> float | None:
    for row in results.get("table", []):
        if row.get("subset") == subset:
            value = row.get("tasks", {}).get(key) if key != "average" else row.get("average")
            return float(value) if _number(value) else None
    return None


def run_figures(results: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run, keyed by label (None where the run lacks one), plus its scorer seed and the
    σ² claims' intervals under ``"ci"``."""
    analyses = (state.get("evaluate/scorer") or {}).get("analyses")
    analyses = analyses if isinstance(analyses, dict) else {}  # a deterministic scorer has none
    unc, csd = _table_value(results, "csd_uncertainty", "average"), _table_value(results, "csd", "average")
    derived = {
        "csd_uncertainty_minus_csd": unc - csd if unc is not None and csd is not None else None,
        "csd_shapes": _table_value(results, "csd", "shapes"),
    }
    sources = {"results": results, "scorer": analyses}
    figures: dict[str, Any] = {}
    for label, where, _test in _FIGURES:
        kind, path = where.split(":", 1)
        figures[label] = derived.get(path) if kind == "derived" else _get(sources[kind], path)
    ci: dict[str, Any] = {}
    for label, fig, interval, _paper in _CLAIMS:
        figures[label] = _get(analyses, fig)
        ci[label] = _get(analyses, interval) if interval else None
    figures.update(curation_report.selection_figures(results))
    per_pair = _get(analyses, "hierarchy_order.ordered_fraction_per_pair")
    return {"scorer_seed": _get(state, "scorer.seed"), "figures": figures, "ci": ci, "per_pair": per_pair}


def _holds(value: Any, test: str) -> bool | None:
    if value is None or not test:
        return None
    if test == "true":
        return value is True
    if test == "> 0":
        return _number(value) and value > 0
    if test == "< 0":
        return _number(value) and value < 0
    raise ValueError(f"unknown test {test!r}")


# The σ² claim whose sign the paper states (shorter captions, more uncertain), counted like the verdicts.
_SIGNED_CLAIMS = {"Spearman(caption words, tr Σ_t)": "< 0"}


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label over the runs: mean, SD (sample; 0 for one run), min, max of the numeric figures, and for a
    signed or boolean figure how many runs it holds on, out of those that have it."""
    labels = list(next(iter(runs.values()))["figures"]) if runs else []
    tests = {
        **{label: test for label, _where, test in _FIGURES}, **_SIGNED_CLAIMS, **curation_report.selection_tests(),
    }  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    for label in labels:
        values = [r["figures"].get(label) for r in runs.values()]
        present = [v for v in values if v is not None]
        row: dict[str, Any] = {"n": len(present)}
        numbers = [float(v) for v in present if _number(v)]
        if numbers:
            row.update(
                mean=statistics.fmean(numbers),
                sd=statistics.stdev(numbers) if len(numbers) > 1 else 0.0,
                min=min(numbers),
                max=max(numbers),
            )
        test = tests.get(label, "")
        if test and present:
            row["holds"] = sum(bool(_holds(v, test)) for v in present)
            row["test"] = test
        out[label] = row
    return out


def _cell(value: Any, ci: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = _fmt(value, 3)
    if isinstance(ci, list) and len(ci) == 2 and all(_number(c) for c in ci):
        text += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    return text


def markdown(runs: dict[str, dict[str, Any]], summary: dict[str, dict[str, Any]]) -> str:
    names = list(runs)
    head = [f"{n} (seed {runs[n]['scorer_seed']})" for n in names]
    lines = [
        "| figure | " + " | ".join(head) + " | mean ± SD | range | holds |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    for label, row in summary.items():
        cells = [_cell(runs[n]["figures"].get(label), runs[n]["ci"].get(label)) for n in names]
        spread = f"{row['mean']:.3f} ± {row['sd']:.3f}" if "mean" in row else "–"
        span = f"{row['min']:.3f} … {row['max']:.3f}" if "mean" in row else "–"
        holds = f"{row['holds']}/{row['n']} ({row['test']})" if "holds" in row else "–"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {spread} | {span} | {holds} |")
    pairs = [runs[n]["per_pair"] for n in names]
    if any(isinstance(p, list) for p in pairs):
        cells = ["/".join(f"{100 * x:.1f}" for x in p) if isinstance(p, list) else "–" for p in pairs]
        lines.append("| levels ordered per pair, % (0>1/1>2/2>3) | " + " | ".join(cells) + " | – | – | – |")
    return "\n".join(lines) + "\n"


@config_class
class SeedsConfig:
    runs: Names = field(default_factory=list)  # track run directories (their --set output=…), local or s3://
    out: str = ""  # also write the table here (markdown; a .json beside it)
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment


SUMMARY = """\
One table over track runs that differ in their scorer seed: per run and over the runs, the filters'
verdicts, the scorer's CSD AUC and the paper's σ² observations with their intervals."""
EXAMPLE = "python -m jobs.track.seeds runs/demo runs/demo-seed1 runs/demo-seed2 --out runs/seeds.md"


@job_main
def main(argv: list[str] | None = None) -> int:
    args = parse_job_config(
        argv, SUMMARY, {"default": SeedsConfig()}, {"RUN": "runs", "--out": "out", "--s3-endpoint": "storage.s3_endpoint"},
        default="default", required=("runs",), prog="jobs.track.seeds", example=EXAMPLE,
    )  # fmt: skip
    store = args.storage.store()
    names = [run.rstrip("/") for run in args.runs]
    twice = sorted(name for name, n in Counter(names).items() if n > 1)
    if twice:
        raise UsageError(f"runs: {', '.join(twice)} given more than once")
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            with naming(name):
                runs[name] = run_figures(*_load(name, store))
        except ValueError as exc:  # a file that is not JSON
            if isinstance(exc, JobError):
                raise
            raise InputError(f"{name}: {exc}") from None
    summary = summarise(runs)
    text = markdown(runs, summary) + "\n".join(curation_report.selection_verdict(runs)) + "\n"
    print(text, end="")
    if args.out:
        store.write_bytes(text.encode(), args.out)
        stem = args.out[: -len(".md")] if args.out.endswith(".md") else args.out
        store.write_json({"runs": runs, "summary": summary}, stem + ".json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
