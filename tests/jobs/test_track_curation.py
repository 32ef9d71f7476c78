"""The track's curation additions without Ray: the new subset kinds and preset, their specs, and the report's
selection arithmetic (per run and over scorer seeds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jobs.track import curation_report as CR
from jobs.track.config import TRACK_PRESETS, TrackConfig
from jobs.track.seeds import summarise
from jobs.track.steps import subset_specs
from pipeline.common.config import ConfigError, merge
from pipeline.filters.registry import CsdPosterior, CsdUcb
from pipeline.filters.specs import parse_filter_specs

_NEW = ["csd", "scorer_cosine", "csd_ucb", "csd_inclusion", "csd_posterior", "neg_clip_loss", "norm_sim"]


def test_every_new_kind_becomes_a_spec_of_the_one_registry():
    cfg = merge(TrackConfig(), {"subsets": _NEW, "output": "runs/x"})
    specs = parse_filter_specs(subset_specs(cfg, (12.5, -3.25)), "subsets")
    by_label = {s.label: s for s in specs}
    assert list(by_label) == _NEW
    assert by_label["csd_posterior"].filters == [CsdPosterior(fraction=0.5, scale=12.5, bias=-3.25, seed=0)]
    assert by_label["neg_clip_loss"].params["embeddings_file"] == "runs/x/pool/embeddings.npz"
    assert by_label["norm_sim"].params["target_file"] == "runs/x/pool/target_embeddings.npy"
    assert by_label["csd_ucb"].filters == [CsdUcb(fraction=0.5)]


def test_the_selection_preset_compares_at_equal_size():
    cfg = TRACK_PRESETS["demo-selection"]
    assert cfg.clip_fraction == cfg.csd_fraction and {"csd", "scorer_cosine"} <= set(cfg.subsets)
    assert cfg.build.dedupe.semantic and cfg.build.decontam.reference == "demo"
    with pytest.raises(ConfigError, match="inclusion_quantile"):
        merge(cfg, {"filters": "csd_inclusion:inclusion_quantile=1.0,label=csd_inclusion"})


def _evals(averages: dict[str, float]) -> dict:
    return {run: {"aggregates": {"average": a}} for run, a in averages.items()}


def test_selection_differences_per_seed():
    cfg = SimpleNamespace(subsets=("csd", "scorer_cosine", "csd_ucb"), seeds=(0, 1))
    evals = _evals(
        {"csd-seed0": 0.40, "csd-seed1": 0.42, "scorer_cosine-seed0": 0.38, "scorer_cosine-seed1": 0.45,
         "csd_ucb-seed0": 0.41, "csd_ucb-seed1": 0.41}
    )  # fmt: skip
    sel = CR.selection(cfg, evals)
    assert sel["csd_ucb_vs_csd"]["diff_by_seed"] == pytest.approx([0.01, -0.01])
    assert sel["csd_ucb_vs_csd"]["wins"] == 1 and sel["csd_ucb_vs_scorer_cosine"]["wins"] == 1
    assert sel["csd_ucb_vs_scorer_cosine"]["mean_diff"] == pytest.approx((0.03 - 0.04) / 2)


def _results(avg: dict[str, float]) -> dict:
    return {"table": [{"subset": s, "average": a, "tasks": {}} for s, a in avg.items()]}


def test_over_scorer_seeds_wins_are_counted_and_the_verdict_needs_every_seed():
    runs = {}
    for k, (ucb, post) in enumerate([(0.45, 0.41), (0.44, 0.39), (0.46, 0.43)]):
        figures = CR.selection_figures(
            _results({"csd": 0.42, "scorer_cosine": 0.40, "csd_ucb": ucb, "csd_posterior": post})
        )
        runs[f"r{k}"] = {"figures": figures, "ci": {}, "scorer_seed": k, "per_pair": None}
    summary = summarise(runs)
    row = summary[CR.selection_label("csd_posterior", "csd")]
    assert (
        row["holds"] == 1 and row["n"] == 3 and row["mean"] == pytest.approx(-0.01)  # −0.01, −0.03, +0.01
    )
    verdict = "\n".join(CR.selection_verdict(runs))
    assert "csd_ucb: better than csd on 3/3 runs, than scorer_cosine on 3/3 — wins on every seed" in verdict
    assert "csd_posterior: better than csd on 1/3 runs" in verdict and "does not win on every seed" in verdict


def test_build_figures_without_a_demo_pool(tmp_path):
    from pipeline.common.storage import LOCAL

    cfg = SimpleNamespace(output=str(tmp_path), build=SimpleNamespace(metadata="s3://b/meta"))
    built = {"curation": {"eval_leaks": {"shapes": 2}, "semantic_duplicates": 3, "clusters": 1}}
    assert CR.build_figures(cfg, built, LOCAL) == built["curation"]
