"""``eval_results.jsonl`` in DataComp's schema: a 38-task file written the way DataComp's ``evaluate.py``
writes it aggregates to the values DataComp's rules give (computed here independently), our lines keep
DataComp's column names free, and evaluate resumes from a DataComp-written file."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from training.eval.results import aggregates, datacomp_names, main_value, read_results, result_line
from training.eval.run import evaluate
from training.eval.sets import EvalSetError, Task, load_tasks

# DataComp's tasklist.yml: (key, display name, main metric), the 38 tasks that carry a main metric.
DATACOMP_TASKS = [
    ("vtab/caltech101", "Caltech-101", "mean_per_class_recall"),
    ("cifar10", "CIFAR-10", "acc1"),
    ("vtab/cifar100", "CIFAR-100", "acc1"),
    ("vtab/clevr_count_all", "CLEVR Counts", "acc1"),
    ("vtab/clevr_closest_object_distance", "CLEVR Distance", "acc1"),
    ("country211", "Country211", "acc1"),
    ("vtab/dtd", "Describable Textures", "acc1"),
    ("vtab/eurosat", "EuroSAT", "acc1"),
    ("fgvc_aircraft", "FGVC Aircraft", "mean_per_class_recall"),
    ("food101", "Food-101", "acc1"),
    ("gtsrb", "GTSRB", "acc1"),
    ("imagenet1k", "ImageNet 1k", "acc1"),
    ("imagenet_sketch", "ImageNet Sketch", "acc1"),
    ("imagenetv2", "ImageNet v2", "acc1"),
    ("imagenet-a", "ImageNet-A", "acc1"),
    ("imagenet-o", "ImageNet-O", "acc1"),
    ("imagenet-r", "ImageNet-R", "acc1"),
    ("vtab/kitti_closest_vehicle_distance", "KITTI Vehicle Distance", "acc1"),
    ("mnist", "MNIST", "acc1"),
    ("objectnet", "ObjectNet", "acc1"),
    ("vtab/flowers", "Oxford Flowers-102", "mean_per_class_recall"),
    ("vtab/pets", "Oxford-IIIT Pet", "mean_per_class_recall"),
    ("voc2007", "Pascal VOC 2007", "acc1"),
    ("vtab/pcam", "PatchCamelyon", "acc1"),
    ("renderedsst2", "Rendered SST2", "acc1"),
    ("vtab/resisc45", "RESISC45", "acc1"),
    ("cars", "Stanford Cars", "acc1"),
    ("stl10", "STL-10", "acc1"),
    ("sun397", "SUN397", "acc1"),
    ("vtab/svhn", "SVHN", "acc1"),
    ("retrieval/flickr_1k_test_image_text_retrieval", "Flickr", "mean_recall@1"),
    ("retrieval/mscoco_2014_5k_test_image_text_retrieval", "MSCOCO", "mean_recall@1"),
    ("misc/winogavil", "WinoGAViL", "jaccard_score_10-12"),
    ("wilds/iwildcam", "iWildCam", "F1-macro_all"),
    ("wilds/camelyon17", "Camelyon17", "acc1"),
    ("wilds/fmow", "FMoW", "acc_worst_region"),
    ("fairness/dollar_street", "Dollar Street", "acc_top5_wg"),
    ("fairness/geode", "GeoDE", "acc_wg"),
]
SHIFTS = ["ImageNet Sketch", "ImageNet v2", "ImageNet-A", "ImageNet-O", "ImageNet-R", "ObjectNet"]
VTAB = [
    "Caltech-101", "CIFAR-100", "CLEVR Counts", "CLEVR Distance", "Describable Textures", "EuroSAT",
    "KITTI Vehicle Distance", "Oxford Flowers-102", "Oxford-IIIT Pet", "PatchCamelyon", "RESISC45", "SVHN",
    "SUN397",
]  # fmt: skip
RETRIEVAL = ["Flickr", "MSCOCO", "WinoGAViL"]


def _datacomp_file(seed: int = 0, drop: str = "") -> tuple[str, dict[str, float]]:
    """A results file as DataComp's evaluate.py writes it (json.dumps of key/dataset/metrics, main_metric
    the value), plus its FairFace and UTKFace lines, which carry no main metric."""
    rng = np.random.default_rng(seed)
    lines, values = [], {}
    for key, name, metric in DATACOMP_TASKS:
        if name == drop:
            continue
        if metric == "mean_recall@1":
            t2i, i2t = rng.uniform(0.05, 0.6, 2)
            m = {
                "image_retrieval_recall@1": t2i,
                "text_retrieval_recall@1": i2t,
                "mean_recall@1": (t2i + i2t) / 2,
            }
        elif metric.startswith("jaccard"):
            m = {"avg_jaccard_score": rng.uniform(0.3, 0.6), "jaccard_score_10-12": rng.uniform(0.3, 0.5)}
        else:
            m = {
                "acc1": rng.uniform(0.01, 0.9),
                "acc5": rng.uniform(0.2, 1.0),
                "mean_per_class_recall": rng.uniform(),
            }
            m[metric] = m.get(metric, rng.uniform(0.01, 0.5))
        m = {k: float(v) for k, v in m.items()}
        m["main_metric"] = m[metric]
        values[name] = m[metric]
        lines.append(json.dumps({"key": key, "dataset": name, "metrics": m}))
    for key, name in (("fairness/fairface", "FairFace"), ("fairness/utkface", "UTKFace")):
        metrics = {"acc_race_avg": float(rng.uniform()), "main_metric": None}
        lines.append(json.dumps({"key": key, "dataset": name, "metrics": metrics}))
    return "\n".join(lines) + "\n", values


def test_datacomp_file_aggregates_by_datacomps_rules():
    text, v = _datacomp_file()
    assert len(text.splitlines()) == 40 and len(v) == 38
    lines = read_results(text)
    aggs, missing = aggregates(lines, load_tasks("datacomp"))
    expected = {
        "ImageNet": v["ImageNet 1k"],
        "ImageNet dist. shifts": sum(v[n] for n in SHIFTS) / 6,
        "VTAB": sum(v[n] for n in VTAB) / 13,
        "Retrieval": sum(v[n] for n in RETRIEVAL) / 3,
        "Average": sum(v.values()) / 38,
    }
    assert missing == {}
    assert datacomp_names(aggs) == pytest.approx(expected, abs=1e-12)

    # A task missing: its group's aggregate and the average are omitted, naming it; the rest stand.
    text, v = _datacomp_file(drop="WinoGAViL")
    aggs, missing = aggregates(read_results(text), load_tasks("datacomp"))
    assert missing == {"retrieval": ["winogavil"], "average": ["winogavil"]}
    assert aggs["vtab"] == pytest.approx(sum(v[n] for n in VTAB) / 13)


def test_our_lines_are_datacomps_schema():
    task = Task("fmow", "p", "zeroshot_classification", "acc_worst_region", key="wilds/fmow", display="FMoW")
    line = result_line(task, {"acc1": np.float64(0.5), "acc_worst_region": float("nan"), "n": 4}, "ckpt")
    assert (line["key"], line["dataset"]) == ("wilds/fmow", "FMoW")
    assert line["metrics"]["main_metric"] is None and line["metrics"]["acc_worst_region"] is None
    ok = result_line(Task("cifar10", "p", "zeroshot_classification", "acc1"), {"acc1": 0.25}, "ckpt")
    assert main_value(ok) == 0.25 and ok["key"] == ok["dataset"] == "cifar10"
    # DataComp's aggregate script spreads ``metrics`` into top-level columns: none may clash with ours.
    df = pd.read_json(pd.io.common.StringIO(json.dumps(line) + "\n" + json.dumps(ok) + "\n"), lines=True)
    spread = pd.concat([df.drop(columns=["metrics"]), df["metrics"].apply(pd.Series)], axis=1)
    assert spread.columns.is_unique and list(spread["main_metric"].isna()) == [True, False]
    with pytest.raises(EvalSetError, match="results.jsonl:2"):
        read_results(json.dumps(ok) + "\n{not json\n", "results.jsonl")


def test_a_broken_task_list_is_one_line_naming_the_file(tmp_path):
    broken = tmp_path / "tasks.yaml"
    broken.write_text("tasks:\n  - {name: shapes, path: [x\n")
    with pytest.raises(EvalSetError, match=r"tasks\.yaml: not valid YAML \(line 3, column 1: ") as info:
        load_tasks(str(broken))
    assert "\n" not in str(info.value)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00tasks: []\n")
    with pytest.raises(EvalSetError, match=r"binary\.yaml: cannot read the task list"):
        load_tasks(str(binary))


def test_evaluate_resumes_from_a_datacomp_file(tmp_path, tiny_checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    values = {"colours": 0.5, "shapes": 0.25, "retrieval": 0.125, "hierarchy": 0.0625}
    extra = {"key": "fairness/fairface", "dataset": "FairFace", "metrics": {"main_metric": None}}
    lines = [{"key": k, "dataset": k, "metrics": {"acc1": v, "main_metric": v}} for k, v in values.items()]
    (out / "eval_results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [*lines, extra]))
    # Every demo task is in the file, so nothing is read from the (absent) eval root and no Ray starts.
    rep = evaluate(
        tiny_checkpoint, load_tasks("demo", root=str(tmp_path / "absent")), str(out), analyses=False
    )
    assert rep.aggregates == {"average": pytest.approx(sum(values.values()) / 4)}
    again = read_results((out / "eval_results.jsonl").read_text())
    assert again == [*lines, extra]  # nothing lost, nothing added

    # Lines that another checkpoint wrote stop the run instead of being mixed in.
    ours = result_line(Task("colours", "p", "zeroshot_classification", "acc1"), {"acc1": 0.5}, "/other/ckpt")
    (out / "eval_results.jsonl").write_text(json.dumps(ours) + "\n")
    with pytest.raises(EvalSetError, match="/other/ckpt"):
        evaluate(tiny_checkpoint, "demo", str(out))
