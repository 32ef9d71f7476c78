"""``python -m jobs.evaluate``: the demo eval sets end to end (Ray), and bad inputs stopping at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from jobs.evaluate import main
from pipeline.shards.reader import iter_shard
from training.eval.uncertainty.measures import NOT_APPLICABLE


def test_corrupt_checkpoint_is_an_input_error_naming_the_file(tmp_path, tiny_checkpoint, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    (ckpt / "weights.pt").write_bytes(b"not a zip archive")
    code = main(["--checkpoint", str(ckpt), "--eval-root", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 3  # docs/jobs.md, "Errors and exit codes"
    assert str(ckpt / "weights.pt") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_checkpoint_and_bad_eval_set_are_input_errors(tmp_path, tiny_checkpoint, capsys):
    assert (
        main(
            [
                "--checkpoint",
                str(tmp_path / "nope"),
                "--eval-root",
                str(tmp_path),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 3
    )
    assert str(tmp_path / "nope") in capsys.readouterr().err
    colours = tmp_path / "eval" / "colours"  # the demo list's first task
    colours.mkdir(parents=True)
    (colours / "classnames.txt").write_text("red\n")  # no templates file, no shards
    code = main(
        ["--checkpoint", tiny_checkpoint, "--eval-root", str(tmp_path / "eval"), "--out", str(tmp_path / "o")]
    )
    assert code == 3
    assert str(colours / "zeroshot_classification_templates.txt") in capsys.readouterr().err


@pytest.mark.ray
def test_demo_eval_end_to_end(ray_local, demo_pool, tiny_checkpoint, clip_checkpoint, tmp_path, capsys):
    eval_root = str(Path(demo_pool.pool_dir) / "eval")
    out = tmp_path / "prolip"
    assert (
        main(
            ["--checkpoint", tiny_checkpoint, "--tasks", "demo", "--eval-root", eval_root, "--out", str(out)]
        )
        == 0
    )
    lines = [json.loads(x) for x in (out / "eval_results.jsonl").read_text().splitlines()]
    assert [r["task"] for r in lines] == ["colours", "shapes", "retrieval", "hierarchy"]
    assert [r["key"] for r in lines] == [r["dataset"] for r in lines] == [r["task"] for r in lines]
    assert all(0.0 <= r["metrics"]["main_metric"] <= 1.0 for r in lines)  # DataComp's schema
    assert lines[2]["metrics"]["main_metric"] == lines[2]["metrics"]["mean_recall@1"]
    assert lines[0]["metrics"]["n"] == 32  # 8 colours × 4 per class in the fixture's eval sizes
    aggs = json.loads((out / "aggregates.json").read_text())["aggregates"]
    assert aggs["average"] == pytest.approx(sum(r["metrics"]["main_metric"] for r in lines) / 4)
    analyses = json.loads((out / "analyses.json").read_text())
    order = analyses["hierarchy_order"]
    assert 0.0 <= order["ordered_fraction"] <= 1.0
    # The length-only baseline comes from the set's own captions, whatever the model.
    words = [
        [len(c.split()) for c in s["txt"].decode().splitlines()[:4]]
        for tar in sorted(Path(eval_root, "hierarchy", "test").glob("*.tar"))
        for s in iter_shard(str(tar), decode=False)
    ]
    pairs = [(a, b) for w in words for a, b in zip(w[:-1], w[1:], strict=True)]
    shorter = sum((a < b) + 0.5 * (a == b) for a, b in pairs) / len(pairs)
    assert order["length_only_ordered_fraction"] == pytest.approx(shorter)
    assert order["same_length_pairs"] == sum(a == b for a, b in pairs)
    # So does the Spearman of a σ² that reads only the level (−level) against the words.
    level_only = spearmanr([n for w in words for n in w], [-k for w in words for k in range(len(w))])
    assert order["level_only_spearman"] == pytest.approx(level_only.statistic)
    assert set(analyses["sigma2_length"]["per_task"]) == {"retrieval", "hierarchy"}
    # Each claim's figure lies inside its interval over resampled pictures.
    for figure, (low, high) in (
        (order["ordered_fraction"], order["ordered_fraction_ci95"]),
        (analyses["sigma2_length"]["spearman_words_vs_trace"], analyses["sigma2_length"]["ci95"]),
        (
            analyses["inclusion"]["image_in_caption"]["rate"],
            analyses["inclusion"]["image_in_caption"]["ci95"],
        ),
    ):
        assert low <= figure <= high
    assert {"image_in_caption", "original_in_masked_text", "original_in_masked_image"} <= set(
        analyses["inclusion"]
    )
    # Per class, the prompts' σ² against recall; the recalls average to the metric the eval reports.
    per_class = analyses["class_uncertainty"]
    assert set(per_class) == {"colours", "shapes"}
    for r in lines[:2]:
        mine = per_class[r["task"]]
        assert mine["n_classes"] == len(mine["classes"]) == 8
        assert np.mean(mine["recall"]) == pytest.approx(r["metrics"]["mean_per_class_recall"])
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert plots == sorted(
        [
            "sigma2_modality.png",
            "sigma2_vs_length.png",
            "sigma2_vs_level.png",
            "inclusion.png",
            "bprw.png",
            "traversal.png",
            "class_uncertainty.png",
        ]
    )
    assert json.loads((out / "manifest.json").read_text())["jobs"]["evaluate"]["config"]["tasks"] == "demo"
    assert "Average" in capsys.readouterr().out

    # Resume: a second run into the same --out keeps every line and evaluates nothing (its eval root is
    # empty, so any task left to encode would fail).
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["--checkpoint", tiny_checkpoint, "--tasks", "demo", "--eval-root", str(empty), "--out", str(out)]
    assert main(argv) == 0
    assert [json.loads(x) for x in (out / "eval_results.jsonl").read_text().splitlines()] == lines
    assert json.loads((out / "aggregates.json").read_text())["aggregates"] == aggs
    assert json.loads((out / "analyses.json").read_text()) == analyses

    # Deterministic checkpoint on one retrieval task: cosine scores, σ² analyses not applicable.
    tasks = tmp_path / "one.yaml"
    tasks.write_text(
        "tasks:\n  - {name: retrieval, path: retrieval, kind: retrieval, main_metric: mean_recall@1}\n"
    )
    out = tmp_path / "clip"
    argv = [
        "--checkpoint",
        clip_checkpoint,
        "--tasks",
        str(tasks),
        "--eval-root",
        eval_root,
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert len((out / "eval_results.jsonl").read_text().splitlines()) == 1
    analyses = json.loads((out / "analyses.json").read_text())
    assert analyses["sigma2_modality"] == analyses["hierarchy_order"] == NOT_APPLICABLE
