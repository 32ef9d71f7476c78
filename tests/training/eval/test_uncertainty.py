"""Uncertainty analyses on constructed embeddings: level ordering, inclusion, traversal, length, plots."""

from __future__ import annotations

import math

import numpy as np
import pytest

from training.eval.uncertainty import measures as U
from training.eval.uncertainty.plots import plot_all


def test_hierarchy_order_fraction():
    # 3 images × 4 levels; adjacent pairs ordered (general larger): 3, 2, 1 of 3 → 6/9
    tr = np.array([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 3.5, 1.0], [1.0, 2.0, 3.0, 0.5]])
    out = U.hierarchy_order(tr)
    assert out["ordered_fraction"] == pytest.approx(6 / 9)
    assert out["ordered_fraction_per_pair"] == pytest.approx([2 / 3, 1 / 3, 1.0])
    assert out["mean_trace_per_level"][0] == pytest.approx(3.0)


def captions(words: np.ndarray) -> list[list[str]]:
    """Captions of the given word counts, spaced irregularly (words are what count, not characters)."""
    return [[" ".join(["w"] * n) + "  " for n in row] for row in words]


def test_hierarchy_order_reports_what_length_alone_explains():
    tr = np.array([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 3.5, 1.0], [1.0, 2.0, 3.0, 0.5]])
    # word counts: image 0 gets longer with each level, image 1 shorter, image 2 equal from level 1 on
    words = np.array([[2, 3, 4, 5], [9, 7, 5, 3], [3, 6, 6, 6]])
    out = U.hierarchy_order(tr, captions(words))
    assert out["ordered_fraction"] == pytest.approx(6 / 9)  # unchanged by the word counts
    # "shorter = more uncertain" orders image 0's 3 pairs, none of image 1's, image 2's first and half of
    # each of its two ties: (3 + 0 + 1 + 0.5 + 0.5) / 9
    assert out["length_only_ordered_fraction"] == pytest.approx(5 / 9)
    assert out["length_only_ordered_fraction_per_pair"] == pytest.approx([2 / 3, 0.5, 0.5])
    # equal-length pairs: image 2's levels 1>2 (2.0 > 3.0: no) and 2>3 (3.0 > 0.5: yes)
    assert out["same_length_pairs"] == 2
    assert out["same_length_ordered_fraction"] == pytest.approx(0.5)
    # general caption longer: image 1's three pairs (4>3 yes, 3>3.5 no, 3.5>1 yes)
    assert out["against_length_pairs"] == 3
    assert out["against_length_ordered_fraction"] == pytest.approx(2 / 3)
    growing = U.hierarchy_order(tr, captions(words + np.arange(4) * 9))
    assert growing["same_length_ordered_fraction"] is None
    assert growing["against_length_ordered_fraction"] is None
    assert "length_only_ordered_fraction" not in U.hierarchy_order(tr)


def test_level_only_spearman_is_a_property_of_the_captions():
    tr = np.array([[4.0, 3.0], [2.0, 1.0]])
    # words grow with the level: ranks 1, 4, 2, 3 against the tied −level ranks 3.5, 1.5, 3.5, 1.5
    level_only = U.hierarchy_order(tr, captions(np.array([[2, 5], [3, 4]])))["level_only_spearman"]
    assert level_only == pytest.approx(-2 / math.sqrt(5))
    # one image's general caption is the long one, the other's the short one: length says nothing
    crossed = U.hierarchy_order(tr, captions(np.array([[2, 3], [3, 2]])))["level_only_spearman"]
    assert crossed == pytest.approx(0.0)
    # independent of the traces it is given
    words = np.array([[2, 3, 4, 5], [9, 7, 5, 3], [3, 6, 6, 6]])
    a = U.hierarchy_order(np.zeros((3, 4)), captions(words))["level_only_spearman"]
    b = U.hierarchy_order(np.random.default_rng(0).random((3, 4)), captions(words))["level_only_spearman"]
    assert a == b and -1.0 < a < 0.0


def test_length_analysis_reports_each_task_and_both_together():
    from types import SimpleNamespace

    from training.eval.uncertainty.analyses import _length_analysis

    def task(name, caps, traces):
        lv = np.log(np.asarray(traces, np.float64))[:, None]
        return SimpleNamespace(task=SimpleNamespace(name=name), captions=caps, text_logvar=lv)

    # retrieval: shorter is more uncertain; hierarchy: longer is, and by more
    ret = task("ret", [["a b", "a b c d"]], [3.0, 2.0])
    hier = task("hier", [["a", "a b c"], ["a b c d e"]], [1.0, 4.0, 5.0])
    found, arrays = _length_analysis([ret, hier])
    out = found["sigma2_length"]
    assert out["per_task"] == {"ret": pytest.approx(-1.0), "hier": pytest.approx(1.0)}
    assert out["n"] == 5 and out["tasks"] == ["ret", "hier"]
    # over all five captions: words 2, 4, 1, 3, 5 against traces 3, 2, 1, 4, 5 → ranks d = 1, -2, 0, -1, 0
    assert out["spearman_words_vs_trace"] == pytest.approx(1 - 6 * 6 / (5 * 24))
    assert arrays["caption_words"].tolist() == [2, 4, 1, 3, 5]


def test_inclusion_rate_sign():
    mu = np.zeros((2, 4))
    small, big = np.full((2, 4), math.log(0.01)), np.full((2, 4), math.log(1.0))
    assert U.inclusion_rate(mu, small, mu, big)["rate"] == 1.0  # narrow inside wide
    assert U.inclusion_rate(mu, big, mu, small)["rate"] == 0.0


def test_length_correlation_negative_when_short_is_uncertain():
    caps = ["a", "a b", "a b c", "a b c d"]
    lv = np.log(np.array([[4.0], [3.0], [2.0], [1.0]]))
    assert U.length_correlation(caps, lv)["spearman_words_vs_trace"] == pytest.approx(-1.0)


def _csd(m1, v1, m2, v2):
    return float(((m1 - m2) ** 2).sum() + v1.sum() + v2.sum())


def _h(m1, v1, m2, v2):  # Eq. 4 per the simplified per-dimension form (docs/math.md), float64
    a = 0.5 * np.log(v2 / v1) + 0.5 * np.log((v2 + 2 * v1) / (v1 + 2 * v2))
    b = (m1 - m2) ** 2 * (1 / (v2 + 2 * v1) - 1 / (v1 + 2 * v2))
    return float((a + b).sum())


def test_traversal_matches_bruteforce_and_climbs_levels():
    # Captions along an arc: level k at angle 90° − 30°·k with σ² shrinking; the image sits at 0°.
    ang = np.radians([90, 60, 30, 0])
    cap_mu = np.stack([np.cos(ang), np.sin(ang)], 1)
    cap_var = np.array([0.8, 0.2, 0.05, 0.005])[:, None].repeat(2, 1)
    img_mu, img_var = np.array([[1.0, 0.0]]), np.full((1, 2), 0.001)
    e_mu, e_var = np.array([0.0, 1.0]), np.full(2, 1.0)
    out = U.traversal(
        img_mu, np.log(img_var), cap_mu, np.log(cap_var), np.arange(4), e_mu, np.log(e_var), steps=50
    )
    # brute force in float64 with the formulas written out
    root = int(np.argmax([_h(img_mu[0], img_var[0], cap_mu[k], cap_var[k]) for k in range(4)]))
    near = int(np.argmin([_csd(img_mu[0], img_var[0], cap_mu[k], cap_var[k]) for k in range(4)]))
    r_mu, r_var = 0.5 * (cap_mu[root] + e_mu), 0.5 * (cap_var[root] + e_var)
    path = []
    for t in np.linspace(0, 1, 50):
        m, v = (1 - t) * r_mu + t * cap_mu[near], (1 - t) * r_var + t * cap_var[near]
        path.append(int(np.argmin([_csd(m, v, cap_mu[k], cap_var[k]) for k in range(4)])))
    assert out["paths"][0] == path
    assert root == 0 and near == 3  # the widest caption includes the image most; the tightest is nearest
    assert out["root_mean_level"] == 0.0 and out["end_mean_level"] == 3.0
    assert out["non_decreasing_fraction"] == 1.0


def test_bprw_analysis_reports_before_after():
    rng = np.random.default_rng(0)
    c, n, d = 3, 4, 8
    centres = np.eye(d)[:c]
    prompt_mu = centres[:, None, :] + 0.3 * rng.normal(size=(c, n, d))
    prompt_lv = np.full((c, n, d), math.log(0.01))
    labels = np.repeat(np.arange(c), 5)
    img_mu = centres[labels] + 0.3 * rng.normal(size=(15, d))
    out = U.bprw_analysis(prompt_mu, prompt_lv, img_mu, np.full((15, d), math.log(0.01)), labels, shots=2)
    zs, fs = out["zero_shot"], out["few_shot"]
    assert 0 <= zs["acc1_before"] <= 1 and 0 <= zs["acc1_after"] <= 1
    assert fs["shots"] == 2 and fs["n_eval"] == 9


def test_class_uncertainty_against_recall():
    from scipy.stats import spearmanr

    # 4 classes × 3 prompts × 2 dims; class 3 has no image. Prompt traces (mean over prompts): 2e^a per
    # prompt with a = the log-variance, so class k's trace is the mean of 2·exp(lv) over its prompts.
    lv = np.log(np.array([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5], [0.3, 0.2, 0.4], [1.0, 1.0, 1.0]]))
    prompt_lv = np.repeat(lv[:, :, None], 2, axis=2)
    labels = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2])
    pred = np.array([0, 0, 0, 1, 2, 2, 2, 2, 0])  # recall 3/4, 0/2, 2/3; nothing to recall for class 3
    scores = np.eye(4)[pred]
    out = U.class_uncertainty(prompt_lv, scores, labels)
    # Unlabelled images (−1) count for no class.
    assert U.class_uncertainty(prompt_lv, np.vstack([scores, np.eye(4)[:1]]), np.append(labels, -1)) == out
    trace = 2 * np.exp(lv).mean(1)
    assert out["prompt_trace"] == pytest.approx(trace.tolist())
    assert out["recall"][:3] == pytest.approx([0.75, 0.0, 2 / 3]) and out["recall"][3] is None
    assert out["n_classes"] == 3
    assert out["spearman_trace_vs_recall"] == pytest.approx(spearmanr(trace[:3], [0.75, 0.0, 2 / 3])[0])
    assert out["spearman_trace_vs_recall"] == pytest.approx(-1.0)  # the more uncertain, the less recalled


@pytest.mark.slow  # matplotlib import alone takes seconds on a loaded machine
def test_plots_written(tmp_path):
    classes = {"prompt_trace": [0.3, 0.2, 0.4], "recall": [0.5, 0.9, None], "spearman_trace_vs_recall": -1.0}
    analyses = {
        "bprw": {"zero_shot": {"acc1_before": 0.5, "acc1_after": 0.6}},
        "class_uncertainty": {"shapes": classes},
    }
    arrays = {"image_trace": np.array([1.0, 2.0]), "text_trace": np.array([3.0, 4.0])}
    paths = plot_all(analyses, arrays, str(tmp_path))
    names = ["bprw.png", "class_uncertainty.png", "sigma2_modality.png"]
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == names
    assert all((tmp_path / p.rsplit("/", 1)[1]).stat().st_size > 1000 for p in paths)


@pytest.mark.parametrize("mode", ["mask", "drop"])
def test_original_in_masked_masks_as_the_checkpoint_trained(tmp_path, mode):
    # A scorer trained with data.text_mask_mode="drop" never saw [MASK]; its original ⊂ masked analysis must
    # encode captions with the masked words removed, and a [MASK]-trained one with [MASK] in their place.
    import torch

    from pipeline.ingest.masking import drop_masked_tokens, mask_text_tokens
    from pipeline.ingest.tokenizer import train_tokenizer
    from tests.fixtures.checkpoints import DEMO_CAPTIONS
    from tests.fixtures.train_shards import demo_samples
    from training.eval.uncertainty.analyses import masked_inclusion
    from training.infer.encode import Encoder
    from training.model.checkpoint import save_checkpoint
    from training.model.config import model_config
    from training.model.two_tower import ProLIP

    tok = train_tokenizer(DEMO_CAPTIONS * 4, vocab_size=512)
    cfg = model_config("tiny", vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path, ProLIP(cfg).eval(), cfg, tok, {"loss": "prolip", "text_mask_mode": mode})
    enc = Encoder(str(ckpt))
    samples = demo_samples(6, size=64)
    captions = [s["txt"] for s in samples]
    _, h = masked_inclusion(enc, [s["jpg"] for s in samples], captions, seed=3)

    tokens = tok.encode_batch(captions, cfg.context_length)
    masked = mask_text_tokens(tokens, tok.pad_id, tok.end_id, tok.mask_id, 0.75, rng=3)
    dropped = drop_masked_tokens(masked, tok.mask_id, tok.pad_id)
    with torch.inference_mode():
        t = enc.model.encode_text(torch.as_tensor(tokens))
        expected = {}
        for name, m in (("mask", masked), ("drop", dropped)):
            e = enc.model.encode_text(torch.as_tensor(m))
            expected[name] = U.hypothesis(*(x.float().numpy() for x in (*t, *e)))
    assert not np.allclose(expected["mask"], expected["drop"])
    np.testing.assert_allclose(h["text ⊂ masked"], expected[mode], rtol=1e-5)


def test_group_bootstrap_matches_the_binomial_interval():
    # Independent pass/fail rows: the percentile interval of their mean is the normal one, p ± 1.96·SE.
    rows = np.random.default_rng(1).random(600) < 0.8
    p = rows.mean()
    half = 1.96 * math.sqrt(p * (1 - p) / len(rows))
    low, high = U.group_bootstrap(lambda r: rows[r].mean(), np.arange(len(rows)), rounds=2000)
    assert low == pytest.approx(p - half, abs=0.006)
    assert high == pytest.approx(p + half, abs=0.006)
    # Seeded: the same call gives the same interval.
    assert U.group_bootstrap(lambda r: rows[r].mean(), np.arange(len(rows)), rounds=2000) == [low, high]


def test_group_bootstrap_resamples_whole_groups():
    # Each picture's outcome repeated for its 3 captions: 200 independent outcomes, not 600. Resampling
    # pictures gives the interval of 200 (√3 wider than treating the 600 rows as independent).
    outcome = np.random.default_rng(2).random(200) < 0.7
    rows, pictures = np.repeat(outcome, 3), np.repeat(np.arange(200), 3)

    def mean(r: np.ndarray) -> float:
        return rows[r].mean()

    by_picture = np.diff(U.group_bootstrap(mean, pictures, rounds=2000))[0]
    by_row = np.diff(U.group_bootstrap(mean, np.arange(600), rounds=2000))[0]
    p = outcome.mean()
    assert by_picture == pytest.approx(2 * 1.96 * math.sqrt(p * (1 - p) / 200), rel=0.12)
    assert by_picture / by_row == pytest.approx(math.sqrt(3), rel=0.15)


def test_length_correlation_interval_matches_fisher_z():
    # Bivariate normal lengths and traces: Spearman's ρ has standard error ≈ 1.03/√(n−3) on Fisher's z scale
    # (Fieller, Hartley & Pearson's approximation), an interval independent of the bootstrap.
    rng = np.random.default_rng(3)
    n = 400
    x = rng.standard_normal(n)
    y = -0.5 * x + math.sqrt(0.75) * rng.standard_normal(n)
    words = np.round(8 + 3 * x).astype(int).clip(1)
    caps = [" ".join(["w"] * k) for k in words]
    logvar = np.log(np.exp(y)[:, None] / 4 * np.ones((1, 4)))  # tr(Σ) = e^y, monotone in y
    out = U.length_correlation(caps, logvar, groups=np.arange(n))
    rho, (low, high) = out["spearman_words_vs_trace"], out["ci95"]
    z, se = math.atanh(rho), 1.03 / math.sqrt(n - 3)
    assert low == pytest.approx(math.tanh(z - 1.96 * se), abs=0.02)
    assert high == pytest.approx(math.tanh(z + 1.96 * se), abs=0.02)
    assert "ci95" not in U.length_correlation(caps, logvar)


def test_hierarchy_and_inclusion_intervals():
    tr = np.random.default_rng(4).random((50, 4))
    out = U.hierarchy_order(tr)
    per_image = (tr[:, :-1] > tr[:, 1:]).mean(1)
    assert out["ordered_fraction_ci95"] == U.group_bootstrap(lambda r: per_image[r].mean(), np.arange(50))
    low, high = out["ordered_fraction_ci95"]
    assert low < out["ordered_fraction"] < high
    mu = np.zeros((6, 2))
    lv = np.log(np.array([[1.0, 1.0], [2.0, 2.0]] * 3))
    narrow, wide = lv, lv[:, ::-1] + np.log(3.0)
    inc = U.inclusion_rate(mu, narrow, mu, wide, groups=np.array([0, 0, 1, 1, 2, 2]))
    assert inc["rate"] == 1.0 and inc["ci95"] == [1.0, 1.0]
    assert "ci95" not in U.inclusion_rate(mu, narrow, mu, wide)
    # An empty set has no interval (its figures are NaN), rather than an error.
    assert U.group_bootstrap(lambda r: 0.0, np.array([], dtype=int)) is None
    assert U.hierarchy_order(np.zeros((0, 4)))["ordered_fraction_ci95"] is None
