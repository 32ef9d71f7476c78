"""DataComp's retrieval sets and WinoGAViL in the Hugging Face ``datasets`` cache its downloader fills:
small sets written by ``datasets`` itself (its Arrow writer and Image feature) in that cache layout, read
back, scored, and aggregated into DataComp's Retrieval."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset, Features, Image, List, Value
from datasets.arrow_writer import ArrowWriter
from PIL import Image as PILImage

from training.eval import hf_sets
from training.eval.metrics import association_metrics
from training.eval.run import evaluate
from training.eval.sets import EvalSetError, load_tasks
from training.infer.encode import Encoder

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 20)}
COLOURS |= {"purple": (140, 30, 160), "orange": (240, 140, 20), "white": (245, 245, 245)}


def jaccard_score(truth: np.ndarray, pred: np.ndarray) -> float:
    """Jaccard index of two boolean labelings as sets of positive positions (sklearn's binary form)."""
    a, b = set(np.flatnonzero(truth)), set(np.flatnonzero(pred))
    return len(a & b) / len(a | b)


def _jpeg(rgb: tuple[int, int, int], size: int = 48) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (size, size), rgb).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _write(cache: Path, repo: str, features: Features, rows: list[dict], shards: int = 1) -> list[Path]:
    """The test split as ``datasets`` prepares it: <cache>/<ns>___<name>/<config>/<version>/<hash>/."""
    ns, name = repo.split("/")
    where = cache / f"{ns}___{name}" / "TEST" / "1.1.0" / "0123abcd"
    where.mkdir(parents=True)
    per = -(-len(rows) // shards)
    files = []
    for s in range(shards):
        suffix = f"-{s:05d}-of-{shards:05d}" if shards > 1 else ""
        path = where / f"{name}-test{suffix}.arrow"
        with ArrowWriter(features=features, path=str(path)) as w:
            for row in rows[s * per : (s + 1) * per]:
                w.write(features.encode_example(row))
            w.finalize()
        files.append(path)
    (where / "dataset_info.json").write_text(json.dumps({"features": features.to_dict()}))
    return files


@pytest.fixture
def datacomp_root(tmp_path):
    """An eval root with Flickr as a script-prepared set (image paths into downloads/extracted), MSCOCO
    with embedded image bytes in two Arrow shards, and four WinoGAViL games."""
    cache = tmp_path / "evals" / "hf_cache"
    extracted = cache / "downloads" / "extracted" / "5f1e" / "images_flickr_1k_test"
    extracted.mkdir(parents=True)
    retrieval = Features({"image": Image(), "caption": List(Value("string")), "filename": Value("string")})
    flickr = []
    for i, (c, rgb) in enumerate(COLOURS.items()):
        (extracted / f"{i}.jpg").write_bytes(_jpeg(rgb))
        caps = [f"a {c} square", f"something {c}"]
        flickr.append({"image": str(extracted / f"{i}.jpg"), "caption": caps, "filename": f"{i}.jpg"})
    _write(cache, "nlphuji/flickr_1k_test_image_text_retrieval", retrieval, flickr)
    coco = [
        {"image": {"bytes": _jpeg(rgb), "path": None}, "caption": [f"{c}"], "filename": c}
        for c, rgb in COLOURS.items()
    ]
    _write(cache, "nlphuji/mscoco_2014_5k_test_image_text_retrieval", retrieval, coco, shards=2)
    wino = Features(
        {
            "candidate_images": List(Image()),
            "candidates": List(Value("string")),
            "associations": List(Value("string")),
            "cue": Value("string"),
        }
    )
    names = list(COLOURS)
    games = []
    for g, (size, cue) in enumerate(((5, "Apple"), (6, "sky"), (10, "Ocean"), (12, "sun"))):
        cands = [names[(g + j) % len(names)] + f"-{j}" for j in range(size)]
        # Every candidate its own shade (wrapping, so white stays distinct): games of 10 and 12 repeat
        # colours, and two solid squares of one colour score alike up to rounding, which would leave
        # the top k to the order of float ties (the smallest top-k margin is now ~1e-3 of the scores).
        shade = [tuple((v + 23 * j) % 256 for v in COLOURS[c.split("-")[0]]) for j, c in enumerate(cands)]
        imgs = [{"bytes": _jpeg(rgb, 32 + j), "path": None} for j, rgb in enumerate(shade)]
        games.append(
            {"candidate_images": imgs, "candidates": cands, "associations": cands[1 : 2 + g], "cue": cue}
        )
    _write(cache, "nlphuji/winogavil", wino, games)
    return tmp_path / "evals", flickr, coco, games


def _hf_tasks(root: Path):
    return [t for t in load_tasks("datacomp", root=str(root)) if t.hf_dataset]


def test_reads_the_cache_as_datasets_does(datacomp_root, tmp_path):
    root, flickr, coco, games = datacomp_root
    tasks = {t.name: t for t in _hf_tasks(root)}
    assert set(tasks) == {"flickr30k", "mscoco_2014_5k_test_image_text_retrieval", "winogavil"}
    for task, rows in (
        (tasks["flickr30k"], flickr),
        (tasks["mscoco_2014_5k_test_image_text_retrieval"], coco),
    ):
        files = hf_sets.arrow_files(task)
        by_datasets = [r for f in files for r in Dataset.from_file(f)]  # the library's own reader
        ours = [r for c in hf_sets.validate_task(task) for r in hf_sets.iter_rows(c, "retrieval")]
        assert [r["captions"].split("\n") for r in ours] == [r["caption"] for r in by_datasets]
        assert [r["captions"].split("\n") for r in ours] == [r["caption"] for r in rows]
        decoded = [np.asarray(PILImage.open(io.BytesIO(r["image"]))) for r in ours]
        assert all(
            np.array_equal(a, np.asarray(b["image"])) for a, b in zip(decoded, by_datasets, strict=True)
        )
    assert len(hf_sets.arrow_files(tasks["mscoco_2014_5k_test_image_text_retrieval"])) == 2
    (chunk,) = hf_sets.validate_task(tasks["winogavil"])
    wino = list(hf_sets.iter_rows(chunk, "association"))
    assert [r["cue"] for r in wino] == ["An apple", "A sky", "An ocean", "A sun"]  # DataComp's prompt
    assert [sum(r["truth"]) for r in wino] == [1, 2, 3, 4] and [len(r["images"]) for r in wino] == [
        5,
        6,
        10,
        12,
    ]

    # A cache moved elsewhere: image paths into the old downloads/ are found under the new cache.
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    shutil.rmtree(root / "hf_cache" / "downloads")
    task = next(t for t in _hf_tasks(moved) if t.name == "flickr30k")
    images = [r["image"] for c in hf_sets.validate_task(task) for r in hf_sets.iter_rows(c, "retrieval")]
    assert images == [Path(r["image"].replace(str(root), str(moved))).read_bytes() for r in flickr]

    # An absent set is reported naming where it was looked for; a wrong set names the missing column.
    with pytest.raises(EvalSetError, match="nlphuji___flickr_1k_test_image_text_retrieval"):
        hf_sets.validate_task(next(t for t in _hf_tasks(tmp_path / "nowhere") if t.name == "flickr30k"))
    shutil.copy(hf_sets.arrow_files(tasks["flickr30k"])[0], hf_sets.arrow_files(tasks["winogavil"])[0])
    with pytest.raises(EvalSetError, match="candidate_images"):
        hf_sets.validate_task(tasks["winogavil"])


def test_association_metrics_match_set_jaccard():
    rng = np.random.default_rng(0)
    scores, truth, ref = [], [], {5: [], 6: [], 10: [], 12: []}
    for size in (5, 6, 10, 12, 12, 5):
        s, t = rng.normal(size=size), np.zeros(size, bool)
        t[rng.choice(size, rng.integers(1, size // 2 + 1), replace=False)] = True
        pred = np.isin(np.arange(size), np.argsort(s)[-int(t.sum()) :])  # DataComp: the top-k by score
        ref[size].append(jaccard_score(t, pred))
        scores.append(s)
        truth.append(t)
    m = association_metrics(scores, truth)
    assert m["jaccard_score_12"] == pytest.approx(np.mean(ref[12]))
    assert m["jaccard_score_5-6"] == pytest.approx(np.mean(ref[5] + ref[6]))
    assert m["jaccard_score_10-12"] == pytest.approx(np.mean(ref[10] + ref[12]))
    assert m["avg_jaccard_score"] == pytest.approx(np.mean(sum(ref.values(), [])))
    assert np.isnan(association_metrics(scores[:1], truth[:1])["jaccard_score_10-12"])


@pytest.mark.ray
def test_retrieval_aggregate_on_datacomps_cache(ray_local, datacomp_root, clip_checkpoint, tmp_path):
    root, flickr, _, games = datacomp_root
    rep = evaluate(clip_checkpoint, _hf_tasks(root), str(tmp_path / "out"), analyses=False)
    lines = {r["key"]: r for r in rep.results}
    assert set(lines) == {
        "retrieval/flickr_1k_test_image_text_retrieval",
        "retrieval/mscoco_2014_5k_test_image_text_retrieval",
        "misc/winogavil",
    }
    main = [r["metrics"]["main_metric"] for r in rep.results]
    # On these three alone both aggregates are their mean (on the full list, Average takes all 38).
    assert rep.aggregates == pytest.approx({"retrieval": sum(main) / 3, "average": sum(main) / 3})
    assert rep.missing_aggregates == {} and all(0.0 <= m <= 1.0 for m in main)

    # The same numbers from the encoder directly (cosine scores of the deterministic checkpoint).
    enc = Encoder(clip_checkpoint)
    img, _, _ = enc.images([Path(r["image"]).read_bytes() for r in flickr])
    caps = [c for r in flickr for c in r["caption"]]
    txt, _ = enc.texts(caps)
    img, txt = (x / np.linalg.norm(x, axis=1, keepdims=True) for x in (img, txt))
    sim, owner = img @ txt.T, np.repeat(np.arange(len(flickr)), 2)
    i2t = np.mean([owner[np.argmax(sim[i])] == i for i in range(len(flickr))])
    t2i = np.mean([np.argmax(sim[:, j]) == owner[j] for j in range(len(caps))])
    flickr_line = lines["retrieval/flickr_1k_test_image_text_retrieval"]["metrics"]
    assert flickr_line["main_metric"] == pytest.approx((i2t + t2i) / 2)
    big = []
    for g in games:
        im, _, _ = enc.images([c["bytes"] for c in g["candidate_images"]])
        cue, _ = enc.texts([hf_sets.cue_prompt(g["cue"])])
        s = (im / np.linalg.norm(im, axis=1, keepdims=True)) @ (cue[0] / np.linalg.norm(cue[0]))
        t = np.isin(g["candidates"], g["associations"])
        pred = np.isin(np.arange(len(t)), np.argsort(s)[-int(t.sum()) :])
        if len(t) >= 10:
            big.append(jaccard_score(t, pred))
    assert lines["misc/winogavil"]["metrics"]["main_metric"] == pytest.approx(np.mean(big))
