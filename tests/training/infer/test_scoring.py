"""The one batch encoder with the scoring / embedding outputs on a hand-built batch, checked against a
float64 formula and the loss code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.common.storage import LOCAL
from tests.fixtures.train_shards import demo_samples
from training.infer.encode import Encoder
from training.infer.scoring import (
    SCORE_COLUMNS,
    embedding_columns,
    embedding_table,
    pair_scores,
    score_columns,
)
from training.losses import contrastive as losses
from training.losses.inclusion import inclusion_hypothesis


def _batch(n: int = 8, corrupt: int | None = 3, with_json: bool = False) -> dict[str, np.ndarray]:
    samples = demo_samples(n, seed=1)
    batch = {
        "__key__": np.array([f"{i:09d}" if with_json else s["__key__"] for i, s in enumerate(samples)]),
        "jpg": np.array([s["jpg"] for s in samples], dtype=object),
        "txt": np.array([s["txt"] for s in samples], dtype=object),
    }
    if with_json:
        batch["json"] = np.array([json.dumps(s["json"]).encode() for s in samples], dtype=object)
    if corrupt is not None:
        batch["jpg"][corrupt] = b"\xff\xd8 not a jpeg"
    return batch


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    return Encoder(tiny_checkpoint, batch_size=4, output=score_columns)


def test_csd_matches_loss_code_on_encoder_outputs(scorer):
    batch = _batch(corrupt=None)
    out = scorer(batch)
    assert list(out) == list(SCORE_COLUMNS)
    mu_v, lv_v, ok = scorer.images(list(batch["jpg"]))
    mu_t, lv_t = scorer.texts(list(batch["txt"]))
    assert ok.all() and out["ok"].all()
    ref = losses.csd(*(torch.from_numpy(a).double() for a in (mu_v, lv_v, mu_t, lv_t))).numpy()
    np.testing.assert_allclose(out["csd"], ref, atol=1e-5)
    # float64 numpy reference for every column
    v, t = mu_v.astype(np.float64), mu_t.astype(np.float64)
    np.testing.assert_allclose(out["dot"], (v * t).sum(1), atol=1e-6)
    np.testing.assert_allclose(out["image_unc"], np.exp(lv_v.astype(np.float64)).sum(1), rtol=1e-5)
    np.testing.assert_allclose(out["text_unc"], np.exp(lv_t.astype(np.float64)).sum(1), rtol=1e-5)
    # unit μ: cosine = dot and CSD = 2 − 2·dot + Σσ²_v + Σσ²_t
    np.testing.assert_allclose(out["cosine"], out["dot"], atol=1e-5)
    np.testing.assert_allclose(out["csd"], 2 - 2 * out["dot"] + out["image_unc"] + out["text_unc"], atol=1e-5)
    assert (out["image_unc"] > 0).all() and (out["text_unc"] > 0).all()


def test_text_len_counts_non_special_tokens(scorer):
    # The tokenizer was trained on these captions: each word is one token; a long caption is cut so
    # that the end token fits in the context (tiny: 32 → 31 content tokens).
    texts = ["a photo of a red circle", "", "red " * 100]
    out = scorer({"uid": np.array(["a" * 32] * 3), "jpg": _batch(3, corrupt=None)["jpg"], "txt": texts})
    assert out["text_len"].tolist() == [6, 0, scorer.config.context_length - 1]


def test_corrupt_image_row_is_flagged_not_raised(scorer):
    out = scorer(_batch(corrupt=3))
    assert out["ok"].tolist() == [i != 3 for i in range(8)]
    for name in ("dot", "image_unc", "text_unc", "csd", "cosine"):
        assert np.isnan(out[name][3]) and np.isfinite(np.delete(out[name], 3)).all()


def test_uid_comes_from_json_else_key(scorer):
    with_json = scorer(_batch(4, corrupt=None, with_json=True))
    assert with_json["uid"].tolist() == [s["__key__"] for s in demo_samples(4, seed=1)]
    keyed = scorer({"__key__": np.array(["000000001"]), "jpg": _batch(1, corrupt=None)["jpg"], "txt": ["x"]})
    assert keyed["uid"].tolist() == ["000000001"]


def test_deterministic_checkpoint_gives_cosine_csd_and_nan_uncertainty(clip_checkpoint):
    scorer = Encoder(clip_checkpoint, output=score_columns)
    out = scorer(_batch(corrupt=None))
    assert np.isnan(out["image_unc"]).all() and np.isnan(out["text_unc"]).all()
    np.testing.assert_allclose(out["csd"], 2 - 2 * out["cosine"], atol=1e-5)


def test_pair_scores_uses_exact_distance_for_non_unit_mu():
    rng = np.random.default_rng(0)
    mv, mt, lv, lt = (rng.normal(size=(5, 3)) for _ in range(4))
    s = pair_scores(mv, lv, mt, lt)
    ref = ((mv - mt) ** 2).sum(1) + np.exp(lv).sum(1) + np.exp(lt).sum(1)
    np.testing.assert_allclose(s["csd"], ref, rtol=1e-12)
    cos = (mv * mt).sum(1) / np.linalg.norm(mv, axis=1) / np.linalg.norm(mt, axis=1)
    np.testing.assert_allclose(s["cosine"], cos, rtol=1e-12)


def test_embedder_shapes_and_arrow_columns(tiny_checkpoint, clip_checkpoint):
    out = Encoder(tiny_checkpoint, output=embedding_columns)(_batch(corrupt=2))
    d = out["image_mu"].shape[1]
    assert out["image_mu"].shape == out["text_logvar"].shape == (8, d)
    assert np.isnan(out["image_mu"][2]).all() and not out["ok"][2]
    np.testing.assert_allclose(np.linalg.norm(out["text_mu"], axis=1), 1.0, atol=1e-5)
    table = embedding_table(out)
    assert str(table.schema.field("image_mu").type) == f"fixed_size_list<item: float>[{d}]"
    back = table.column("text_mu").combine_chunks().flatten().to_numpy().reshape(-1, d)
    np.testing.assert_array_equal(back, out["text_mu"])
    det = Encoder(clip_checkpoint, output=embedding_columns)(_batch(2, corrupt=None))
    assert "image_logvar" not in det and "text_logvar" not in det


def test_threaded_decode_gives_the_same_rows(tiny_checkpoint):
    batch = _batch(32, corrupt=17)  # 2 threads × 16 rows: the smallest batch that is split
    plain = Encoder(tiny_checkpoint, batch_size=64, output=score_columns)
    threaded = Encoder(tiny_checkpoint, batch_size=64, decode_threads=2, output=score_columns)
    a, b = plain(batch), threaded(batch)
    assert a["ok"].tolist() == b["ok"].tolist() and not b["ok"][17]
    np.testing.assert_allclose(a["csd"], b["csd"], atol=1e-6, equal_nan=True)


@pytest.mark.slow  # bf16 matmuls are emulated on most CPUs: seconds, not milliseconds
def test_bf16_autocast_path_stays_close_to_float32(tiny_checkpoint, scorer):
    # The path GPUs take (bf16 autocast), run on CPU: outputs stay float32 and near the fp32 scores.
    batch = _batch(4, corrupt=None)
    amp = Encoder(tiny_checkpoint, amp=True, output=score_columns)(batch)
    assert amp["csd"].dtype == np.float32
    np.testing.assert_allclose(amp["csd"], scorer(batch)["csd"], atol=0.05)


def test_encoder_batch_runs_each_tower_only_on_its_rows(tiny_checkpoint, scorer):
    # Eval's mixed batch: image rows and caption rows, each encoded by its own tower only.
    from training.eval.run import merge_towers

    pairs = _batch(4, corrupt=2)
    batch = {
        "jpg": np.array([*pairs["jpg"], b"", b""], dtype=object),
        "txt": np.array(["", "", "", "", *pairs["txt"][:2]], dtype=object),
        "has_image": np.array([True] * 4 + [False] * 2),
        "has_text": np.array([False] * 4 + [True] * 2),
        "sub": np.array([-1] * 4 + [0, 1]),
    }
    raw = scorer.encode_batch(batch)
    assert (
        "jpg" not in raw
        and "has_image" not in raw
        and raw["ok"].tolist() == [True, True, False, True, True, True]
    )
    assert np.isnan(raw["text_mu"][:4]).all() and np.isnan(raw["image_mu"][4:]).all()
    assert raw["text_len"][:4].tolist() == [0, 0, 0, 0] and (raw["text_len"][4:] > 0).all()
    mu_v, lv_v, _ = scorer.images(list(pairs["jpg"]))
    mu_t, lv_t = scorer.texts(list(pairs["txt"][:2]))
    np.testing.assert_allclose(raw["image_mu"][:4], mu_v, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(raw["text_logvar"][4:], lv_t, atol=1e-6)
    merged = merge_towers(raw)
    assert "image_mu" not in merged and merged["mu"].shape == (6, mu_v.shape[1])
    np.testing.assert_allclose(merged["mu"], np.concatenate([mu_v, mu_t]), atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(merged["logvar"], np.concatenate([lv_v, lv_t]), atol=1e-6, equal_nan=True)


def test_encoder_sees_the_pixels_training_sees(tiny_checkpoint):
    """One deterministic preprocessing: the encoder's pixels equal the training decoder's with augmentation
    off. The sizes include JPEGs whose DCT downscale alone reaches the model's side (8× and 4×), where an
    encoder decoding for the output side itself once skipped training's bicubic step."""
    import io

    import torch
    from PIL import Image

    from pipeline.ingest.device_augment import DeviceAugment
    from pipeline.ingest.transforms import DecodeAugment
    from training.config import DataConfig

    enc = Encoder(tiny_checkpoint)
    size = enc.config.image_size
    rng = np.random.default_rng(0)
    jpgs = []
    for h, w in ((8 * size, 8 * size), (4 * size, 6 * size + 5), (size, 2 * size), (size // 2, size + 3)):
        smooth = rng.uniform(0, 255, (h // 4 + 1, w // 4 + 1, 3)).astype(np.uint8)
        img = Image.fromarray(smooth).resize((w, h), Image.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        jpgs.append(buf.getvalue())
    pixels, ok = enc.preprocess(jpgs)
    assert ok.all()
    cfg = DataConfig(augment=False, mean=tuple(map(float, enc.mean)), std=tuple(map(float, enc.std)))
    batch = {
        "key": np.array([str(i) for i in range(len(jpgs))], dtype=object),
        "jpg": np.array(jpgs, dtype=object),
        "txt": np.array(["a photo"] * len(jpgs), dtype=object),
    }
    crops = DecodeAugment(size, enc.config.context_length, enc.tokenizer, cfg)(batch)["image"]
    # The train step normalises the decoded uint8 crops on its device (pipeline/ingest/device_augment.py).
    trained_on = DeviceAugment(cfg.mean, cfg.std)({"images": torch.from_numpy(crops)}).numpy()
    np.testing.assert_allclose(pixels, trained_on, rtol=0, atol=1e-6)


def test_score_columns_inclusion_and_spread():
    rng = np.random.default_rng(4)
    mv, mt = rng.normal(size=(6, 16)), rng.normal(size=(6, 16))
    mv /= np.linalg.norm(mv, axis=1, keepdims=True)
    mt /= np.linalg.norm(mt, axis=1, keepdims=True)
    lv, lt = rng.normal(-4, 0.5, (6, 16)), rng.normal(-3, 0.5, (6, 16))
    got = pair_scores(mv, lv, mt, lt)
    want = inclusion_hypothesis(*(torch.from_numpy(a) for a in (mv, lv, mt, lt))).numpy()
    np.testing.assert_allclose(got["inclusion"], want, rtol=1e-12)
    # csd_std: the spread of ‖z_v − z_t‖² over samples of the two Gaussians (its mean is CSD)
    samples = 200_000
    zv = mv[0] + np.exp(0.5 * lv[0]) * rng.standard_normal((samples, 16))
    zt = mt[0] + np.exp(0.5 * lt[0]) * rng.standard_normal((samples, 16))
    dist = ((zv - zt) ** 2).sum(1)
    assert dist.mean() == pytest.approx(got["csd"][0], rel=5e-3)
    assert dist.std() == pytest.approx(got["csd_std"][0], rel=2e-2)
    det = pair_scores(mv, None, mt, None)
    assert np.isnan(det["inclusion"]).all() and np.isnan(det["csd_std"]).all()


def test_score_parts_written_by_the_encoder_read_back_sorted_with_stale_parts_ignored(
    tiny_checkpoint, tmp_path
):
    """Each batch becomes a part written where it was scored; only the parts the index lists are read."""
    from training.infer.scoring import (
        ScorePartWriter,
        clear_scores,
        read_scores,
        scores_complete,
        write_score_index,
    )

    out = str(tmp_path / "scores.parquet")
    whole = Encoder(tiny_checkpoint, batch_size=4, output=score_columns)(_batch(8, corrupt=3))
    writer = Encoder(tiny_checkpoint, batch_size=4, output=ScorePartWriter(out, LOCAL, "run1"))
    summaries = [writer(_batch(8, corrupt=3))]
    (tmp_path / "scores.parquet" / "part-killed-0.parquet").write_bytes(b"half a file of a killed run")
    assert not scores_complete(out)  # no index yet: a reuse would rescore
    files = [str(f) for s in summaries for f in s["file"]]
    assert summaries[0]["rows"].tolist() == [8] and summaries[0]["failed"].tolist() == [1]
    write_score_index(out, files, 8, 1, LOCAL)
    assert scores_complete(out)
    table = read_scores(out)
    order = np.argsort(whole["uid"])
    assert table.column("uid").to_pylist() == sorted(whole["uid"].tolist())
    np.testing.assert_allclose(table.column("csd").to_numpy(zero_copy_only=False), whole["csd"][order])
    clear_scores(out, LOCAL)
    assert not scores_complete(out) and not list((tmp_path / "scores.parquet").iterdir())
