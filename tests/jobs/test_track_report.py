"""The track report's figures and its HTML: every figure titled with its run and model, the BPRW bars
zoomed on their values, and report.html one self-contained file (every picture inline, no reference to
another file or site). The tiny track in tests/jobs/test_track.py checks the same on a real run."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from jobs.track.config import TRACK_PRESETS
from jobs.track.render import loss_figure, results_figure
from jobs.track.report import write_report
from pipeline.common.config import merge
from pipeline.common.storage import LOCAL
from training.eval.uncertainty.plots import draw_all, plot_all

PNG = b"\x89PNG\r\n\x1a\n"


def _analyses_and_arrays(rng: np.random.Generator) -> tuple[dict, dict]:
    """Every analysis the plots draw, in the shapes training/eval/uncertainty/analyses.py returns."""
    analyses = {
        "sigma2_length": {"spearman_words_vs_trace": -0.31},
        "hierarchy_order": {"ordered_fraction": 0.62},
        "bprw": {"task": "colours", "zero_shot": {"acc1_before": 0.956, "acc1_after": 0.958},
                 "few_shot": {"acc1_before": 0.951, "acc1_after": 0.957}},
        "traversal": {"steps": 5, "mean_level_per_step": [3.0, 2.6, 2.2, 2.1, 2.0]},
        "class_uncertainty": {"shapes": {"recall": [0.2, None, 0.5], "prompt_trace": [0.1, 0.2, 0.3],
                                         "spearman_trace_vs_recall": -0.5}},
    }  # fmt: skip
    arrays = {
        "image_trace": rng.random(50), "text_trace": rng.random(50) + 0.5, "caption_words": rng.integers(2, 9, 40),
        "caption_trace": rng.random(40), "level_traces": rng.random((12, 4)), "H_image_in_caption": rng.normal(size=30),
        "H_original_in_masked_text": rng.normal(size=30),
    }  # fmt: skip
    return analyses, arrays


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


def test_every_uncertainty_plot_says_what_it_shows_and_whose_it_is():
    analyses, arrays = _analyses_and_arrays(np.random.default_rng(0))
    subject = "scorer · train/scorer/checkpoint_00000016 · 32 px conv image tower, 128-d Gaussian embeddings"
    figures = dict(draw_all(analyses, arrays, subject))
    assert set(figures) == {
        "sigma2_modality.png", "sigma2_vs_length.png", "sigma2_vs_level.png", "inclusion.png", "bprw.png",
        "traversal.png", "class_uncertainty.png",
    }  # fmt: skip
    for name, fig in figures.items():
        assert fig._suptitle is not None and fig._suptitle.get_text() == subject, name
        assert _titles(fig), f"{name} has no title"
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), (name, "an axis without a label")
    bprw = figures["bprw.png"]
    low, high = bprw.axes[0].get_ylim()
    assert 0.85 < low < 0.951 and 0.958 < high <= 1.0  # zoomed on bars at ~0.956, not a 0–1 axis
    assert "zero-shot +0.002" in _titles(bprw)[0] and "few-shot +0.006" in _titles(bprw)[0]
    legend = bprw.axes[0].get_legend()
    assert (
        legend is not None and legend.get_bbox_to_anchor().x0 > bprw.axes[0].bbox.x1
    )  # beside, not over a bar


def test_results_and_loss_figures_are_titled_with_run_and_models():
    values = {
        "no_filter": {"shapes": [0.2, 0.3], "average": [0.25, 0.3]},
        "csd": {"shapes": [0.4, 0.5], "average": [0.4, 0.45]},
    }
    fig = results_figure(
        "runs/demo: each subset's model (clip, demo-32px-cnn)", ["no_filter", "csd"], ["shapes"], values
    )
    assert _titles(fig) == ["runs/demo: each subset's model (clip, demo-32px-cnn)"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["shapes", "average"]
    assert ax.get_legend().get_title().get_text() == "subset"
    assert len(ax.lines) + len(ax.collections) > 0  # the seeds' spread drawn as error bars
    assert {"0.250", "0.450"} <= {t.get_text() for t in ax.texts}  # each mean written on its bar
    curves = [("scorer: prolip, demo-32px-cnn-unc", {"scorer": [(64, 5.1), (128, 4.9)]}),
              ("subset models: clip", {"csd-seed0": [(64, 4.0), (128, 3.8)], "random-seed0": [(64, 4.1)]})]  # fmt: skip
    fig = loss_figure("runs/demo: training loss of the scorer and every subset model", curves)
    assert fig._suptitle.get_text().startswith("runs/demo")
    assert _titles(fig) == ["scorer: prolip, demo-32px-cnn-unc", "subset models: clip"]
    assert [len(ax.lines) for ax in fig.axes] == [1, 2]


class _Refs(HTMLParser):
    """Every attribute of the page that could load or link something."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "poster", "action") or (value or "").startswith(
                "url("
            ):
                self.refs.append((tag, name, value or ""))


@pytest.fixture
def run(tmp_path):
    """A finished track's records, as the steps return them, with checkpoints holding loss histories and
    the scorer's plots drawn by the eval's own code."""
    cfg = merge(TRACK_PRESETS["tiny"], {"output": str(tmp_path)})
    models, evals = {}, {}
    for i, name in enumerate(("scorer", *[f"{s}-seed0" for s in cfg.subsets])):
        ckpt = tmp_path / "train" / name / "checkpoint_00000008"
        ckpt.mkdir(parents=True)
        history = [
            {"step": s, "samples_seen": 32 * s, "loss/total": 4.0 - 0.1 * s + 0.01 * i} for s in (2, 4, 8)
        ]
        (ckpt / "extra.json").write_text(json.dumps({"metrics": history}))
        models[name] = {"checkpoint": str(ckpt), "samples_seen": 256, "loss": "clip"}
        evals[name] = {
            "results": [{"key": t, "task": t, "metrics": {"main_metric": 0.1 * (i + 1) + 0.01 * k}}
                        for k, t in enumerate(("colours", "shapes"))],
            "aggregates": {"average": 0.1 * (i + 1)},
        }  # fmt: skip
    analyses, arrays = _analyses_and_arrays(np.random.default_rng(1))
    plots = plot_all(analyses, arrays, str(tmp_path / "eval" / "scorer" / "plots"), "scorer · a checkpoint")
    evals["scorer"].update(analyses=analyses, plots=plots, dir=str(tmp_path / "eval" / "scorer"))
    scorer = {**models.pop("scorer"), "loss": "prolip", "first_loss": 4.9, "final_loss": 4.6}
    from pipeline.subsets.uid_files import write_subset

    write_subset(["0" * 32], tmp_path / "one.npy")
    subsets = {s: {"size": 100, "downloaded": 90, "path": str(tmp_path / "one.npy")} for s in cfg.subsets}
    built = {"n_input": 120, "status": {"success": 100}, "subsets": {}}
    scores = {"path": str(tmp_path / "scores.parquet"), "n_rows": 100, "pairs_per_s": 50.0}
    return cfg, built, scores, subsets, models, scorer, evals


def test_report_html_is_one_self_contained_file_with_every_figure(run):
    cfg, *rest = run
    path, rows, _ = write_report(cfg, *rest, timings={"build": 1.0}, machine=None, store=LOCAL)
    out = Path(cfg.output)
    report = Path(path).read_text()
    page = (out / "report.html").read_text()
    for name in ("results.png", "loss_curves.png"):
        assert (out / "figures" / name).read_bytes().startswith(PNG) and f"](figures/{name})" in report
    refs = _Refs()
    refs.feed(page)
    images = [value for tag, name, value in refs.refs if tag == "img"]
    assert len(images) == report.count("![") == 2 + 7  # the two track figures and the scorer's seven plots
    for tag, name, value in refs.refs:
        assert tag == "img" and name == "src" and value.startswith("data:image/png;base64,"), (
            tag,
            name,
            value[:60],
        )
        assert base64.b64decode(value.split(",", 1)[1]).startswith(PNG)
    assert "<link" not in page and "<script" not in page and "url(" not in page and "@import" not in page
    # The raw analyses stay in their JSON file, which the Markdown links and the HTML names.
    assert (
        "[eval/scorer/analyses.json](eval/scorer/analyses.json)" in report
        and "| quantity | value |" not in report
    )
    assert "<code>eval/scorer/analyses.json</code> beside this report" in page
    assert "<table>" in page and rows[0]["subset"] in page
