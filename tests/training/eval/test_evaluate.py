"""Evaluation metrics on hand-computed toys, aggregates, task lists and eval-set layout errors."""

from __future__ import annotations

import io
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest

from training.eval.metrics import (
    classification_metrics,
    gaussian_mean,
    retrieval_metrics,
    score_matrix,
)
from training.eval.results import aggregates
from training.eval.run import TaskData, task_metrics
from training.eval.sets import EvalSetError, Task, load_tasks, validate_task


def _unit(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


# Three classes at 0°, 90°, 180° in 2-D, two prompts each (identical means). Class 1's prompts have
# σ² = 0.2 and 0.3 per dimension → ensemble σ² = 0.25 per dim (mean of σ², not of log σ²), Σσ² = 0.5.
# Images (σ² = 0) at 10°, 80°, 50°, 180°, 100° with labels 0, 1, 0, 2, 2.
#   cosine: 50° is nearer 90° (cos 40° = .766 > cos 50° = .643)                → preds 0, 1, 1, 2, 1
#   CSD = 2 − 2cos + Σσ²_c: 50° → c0: 2 − 2(.643) = .714;  c1: 2 − 2(.766) + .5 = .968 → class 0
#        100° → c1: 2 − 2cos 10° + .5 = .530;  c2: 2 − 2cos 80° = 1.653            → class 1
#   → CSD preds 0, 1, 0, 2, 1: acc1 = 4/5, recall per class (1, 1, 1/2) → 5/6
#   → cosine preds 0, 1, 1, 2, 1: acc1 = 3/5, recall per class (1/2, 1, 1/2) → 2/3
IMAGE_DEG = [10, 80, 50, 180, 100]
LABELS = np.array([0, 1, 0, 2, 2])


def _toy(probabilistic: bool) -> TaskData:
    task = Task("toy", "/nonexistent", "zeroshot_classification", "acc1")
    prompt_mu = np.array([_unit(d) for d in (0, 0, 90, 90, 180, 180)], np.float32)
    var = np.full((6, 2), 1e-12)
    var[2], var[3] = 0.2, 0.3
    image_mu = np.array([_unit(d) for d in IMAGE_DEG], np.float32)
    d = TaskData(
        task=task,
        image_mu=image_mu,
        image_logvar=np.full((5, 2), math.log(1e-12), np.float32) if probabilistic else None,
        labels=LABELS,
        groups=np.full(5, -1),
        captions=[],
        n_undecodable=0,
        classnames=["a", "b", "c"],
        templates=["{c}", "x {c}"],
    )
    d.text_mu = prompt_mu
    d.text_logvar = np.log(var).astype(np.float32) if probabilistic else None
    return d


def test_zeroshot_toy_csd_vs_cosine():
    csd = task_metrics(_toy(True))
    cos = task_metrics(_toy(False))
    assert csd["acc1"] == pytest.approx(4 / 5)
    assert csd["mean_per_class_recall"] == pytest.approx(5 / 6)
    assert cos["acc1"] == pytest.approx(3 / 5)
    assert cos["mean_per_class_recall"] == pytest.approx(2 / 3)
    assert csd["acc5"] == cos["acc5"] == 1.0  # top-min(5, C) with C = 3


def test_prompt_ensemble_is_mean_mu_and_mean_variance():
    d = _toy(True)
    mu, logvar = gaussian_mean(d.text_mu.reshape(3, 2, 2), d.text_logvar.reshape(3, 2, 2))
    assert np.exp(logvar[1]) == pytest.approx([0.25, 0.25], rel=1e-6)
    # CSD against the ensemble, float64 by hand: ||μ_v − μ_c||² + Σσ²_v + Σσ²_c
    v = np.array(_unit(50))
    s = score_matrix(v[None].astype(np.float32), np.full((1, 2), math.log(1e-12), np.float32), mu, logvar)
    assert -s[0, 1] == pytest.approx(2 - 2 * math.cos(math.radians(40)) + 0.5, abs=1e-5)


def test_classification_top5_f1_and_worst_group():
    scores = np.array(
        [
            [9, 8, 7, 6, 5, 4, 3],  # label 6: rank 7 → miss@5
            [1, 9, 2, 3, 4, 5, 6],  # label 1: hit@1
            [9, 1, 8, 2, 7, 3, 6],  # label 4: rank 3 → hit@5 only
            [0, 0, 9, 0, 0, 0, 0],  # label 2: hit@1
        ],
        float,
    )
    labels = np.array([6, 1, 4, 2])
    m = classification_metrics(
        scores, labels, groups=np.array([0, 0, 1, 5]), group_exclude=[5], group_metric="acc5"
    )
    assert m["acc1"] == 0.5 and m["acc5"] == 0.75
    assert m["mean_per_class_recall"] == pytest.approx(0.5)  # classes 6, 1, 4, 2 → 0, 1, 0, 1
    # preds 0, 1, 0, 2: F1 per class in {0,1,2,4,6} = 0, 1, 1, 0, 0
    assert m["F1-macro_all"] == pytest.approx(2 / 5)
    assert m["acc_wg"] == pytest.approx(0.5)  # group 0: top-5 hits (0, 1) → .5; group 1: 1; group 5 excluded


def test_retrieval_toy_known_ranks():
    scores = np.array(
        [
            [0.9, 0.1, 0.8, 0.2, 0.3, 0.4],  # image 0: own caption t0 ranked first
            [0.7, 0.6, 0.5, 0.1, 0.2, 0.3],  # image 1: best own caption t2 at rank 2
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.05],  # image 2: own caption t4 ranked first
        ]
    )
    text_image = np.array([0, 0, 1, 1, 2, 2])
    m = retrieval_metrics(scores, text_image, ks=(1, 2, 5))
    # image→text ranks (0, 2, 0); text→image ranks of the own image per text: (0, 2, 1, 2, 0, 2)
    assert m["text_retrieval_recall@1"] == pytest.approx(2 / 3)
    assert m["text_retrieval_recall@2"] == pytest.approx(2 / 3)
    assert m["text_retrieval_recall@5"] == 1.0
    assert m["image_retrieval_recall@1"] == pytest.approx(2 / 6)
    assert m["image_retrieval_recall@2"] == pytest.approx(3 / 6)
    assert m["image_retrieval_recall@5"] == 1.0
    assert m["mean_recall@1"] == pytest.approx(0.5)


def test_aggregates_and_missing_tasks():
    tasks = [
        Task("imagenet1k", "p", "zeroshot_classification", "acc1", "imagenet"),
        Task("imagenetv2", "p", "zeroshot_classification", "acc1", "imagenet_dist_shift"),
        Task("objectnet", "p", "zeroshot_classification", "acc1", "imagenet_dist_shift"),
        Task("cifar10", "p", "zeroshot_classification", "acc1", ""),
    ]

    def line(key: str, v: float) -> dict:
        return {"key": key, "dataset": key, "metrics": {"acc1": v, "main_metric": v}}

    results = [line("imagenet1k", 0.4), line("imagenetv2", 0.3), line("cifar10", 0.8)]
    aggs, missing = aggregates(results, tasks)
    assert aggs == {"imagenet": 0.4}
    assert missing == {"imagenet_dist_shift": ["objectnet"], "average": ["objectnet"]}
    results.append(line("objectnet", 0.1))
    aggs, missing = aggregates(results, tasks)
    assert aggs == pytest.approx({"imagenet": 0.4, "imagenet_dist_shift": 0.2, "average": 0.4})
    assert missing == {}


def test_task_lists_parse():
    demo = load_tasks("demo", root="/pool/eval")
    assert [t.name for t in demo] == ["colours", "shapes", "retrieval", "hierarchy"]
    assert demo[0].path == "/pool/eval/colours"
    dc = load_tasks("datacomp", root="s3://bucket/evals")
    assert len(dc) == 38 and all(t.optional for t in dc)
    groups = [t.group for t in dc]
    assert groups.count("vtab") == 13 and groups.count("imagenet_dist_shift") == 6
    assert groups.count("retrieval") == 3 and groups.count("imagenet") == 1
    assert dc[0].path.startswith("s3://bucket/evals/")
    fmow = next(t for t in dc if t.name == "fmow")
    assert (fmow.main_metric, fmow.group_column, fmow.group_exclude) == ("acc_worst_region", 0, (5,))


def test_task_list_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks:\n  - {name: x, path: p, kind: detection, main_metric: acc1}\n")
    with pytest.raises(EvalSetError, match="bad.yaml"):
        load_tasks(str(bad))


def _write_set(root: Path, cls: str = "1", templates: str | None = "a {c}.\n") -> Task:
    (root / "test").mkdir(parents=True)
    (root / "classnames.txt").write_text("cat\ndog\n")
    if templates is not None:
        (root / "zeroshot_classification_templates.txt").write_text(templates)
    with tarfile.open(root / "test" / "0.tar", "w") as tar:
        for name, data in (("000.jpg", b"\xff\xd8fake"), ("000.cls", cls.encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return Task("toy", str(root), "zeroshot_classification", "acc1")


def test_good_layout_passes(tmp_path):
    assert validate_task(_write_set(tmp_path / "ok"))[0].endswith("test/0.tar")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"templates": None}, "zeroshot_classification_templates.txt"),
        ({"templates": "a photo.\n"}, "zeroshot_classification_templates.txt"),
        ({"cls": "7"}, "0.tar"),
    ],
)
def test_bad_layout_names_the_file(tmp_path, kwargs, named):
    task = _write_set(tmp_path / "set", **kwargs)
    with pytest.raises(EvalSetError, match=named):
        validate_task(task)


def test_missing_shards_named(tmp_path):
    (tmp_path / "classnames.txt").write_text("a\n")
    (tmp_path / "zeroshot_classification_templates.txt").write_text("{c}\n")
    with pytest.raises(EvalSetError, match="test"):
        validate_task(Task("t", str(tmp_path), "zeroshot_classification", "acc1"))
