"""Uncertainty analyses of a probabilistic checkpoint (ProLIP §4.3–4.4, C.7) (their plots: ``plots.py``).

Everything takes gathered embeddings (numpy μ, log σ²) and returns JSON-able dicts. The claims measured in miniature (ProLIP §4.3–4.4):

- text σ² > image σ² (mean tr(Σ) = Σ_d σ²_d per modality);
- shorter / more general captions have larger σ² (Spearman of word count vs tr(Σ); per hierarchy level,
  and the fraction of adjacent levels (k, k+1) where the more general one has the larger tr(Σ) —
  paper: 90.0% on HierarCaps);
- inclusion: fraction of pairs with H(Z₁ ⊂ Z₂) > 0 (Eq. 4) for image ⊂ own caption and original ⊂ masked
  (paper: > 70%). H is evaluated with ε = 1 (log ε = 0), i.e. of the Gaussians as they are, not of the
  ε-rescaled ones the training loss uses;
- image traversal (§4.4, B.4): root = the caption including the image most, averaged with the
  empty-caption embedding; 50 linear steps of (μ, σ²) from the root to the image's nearest caption,
  retrieving the nearest caption (CSD) at each step and recording its hierarchy level;
- BPRW (``training/eval/uncertainty/bprw.py``) zero-shot and few-shot, accuracy before/after.

Each claim's figure comes with ``ci95``: a 95% percentile bootstrap interval that resamples the eval set's
images (every caption or pair of a resampled image comes along, since they share it). It is the error of
having measured on this sample of pictures, not the spread between training seeds, which on the demo is
larger (docs/track.md, "Reading the report").

Not a paper claim, a diagnostic of the report (docs/track.md, "Reading the report"): per class of a
zero-shot set, the mean tr(Σ)
of its prompts against the class's zero-shot recall. PPCL raises a caption's σ² with the negatives its
mean cannot keep away, so a class name the model cannot tell apart from others should read more
uncertain: Spearman(tr(Σ), recall) < 0. On the demo it explains which hierarchy pairs a scorer orders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from training.eval.metrics import classification_metrics, score_matrix, topk, zero_shot_scores
from training.eval.uncertainty import bprw
from training.eval.uncertainty.calibration import spearman
from training.losses.inclusion import inclusion_hypothesis

NOT_APPLICABLE = "not applicable: deterministic checkpoint (no σ²)"
BOOTSTRAP_ROUNDS = 1000


def group_bootstrap(
    statistic: Callable[[np.ndarray], float],
    groups: np.ndarray,
    rounds: int = BOOTSTRAP_ROUNDS,
    level: float = 0.95,
    seed: int = 0,
) -> list[float] | None:
    """[low, high]: the percentile interval of ``statistic(rows)`` over ``rounds`` resamples, each drawing as
    many groups as there are, with replacement, and passing the row indices of every drawn group (a group
    drawn twice gives its rows twice). ``groups`` (n,) labels each row; rows of one group (one picture's
    captions) are dependent, so they are resampled together. Non-finite resampled values are left out; None
    if none is finite or there are no rows."""
    labels, inverse = np.unique(np.asarray(groups), return_inverse=True)
    if labels.size == 0:
        return None
    order = np.argsort(inverse, kind="stable")
    members = np.split(order, np.cumsum(np.bincount(inverse))[:-1])
    rng = np.random.default_rng(seed)
    values = np.array(
        [
            statistic(np.concatenate([members[g] for g in rng.integers(0, len(labels), len(labels))]))
            for _ in range(rounds)
        ],
        dtype=np.float64,
    )
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    tail = (1.0 - level) / 2
    return [float(np.quantile(values, tail)), float(np.quantile(values, 1.0 - tail))]


def trace(logvar: np.ndarray) -> np.ndarray:
    """tr(Σ) = Σ_d σ²_d per row, float64."""
    return np.exp(logvar.astype(np.float64)).sum(-1)


def modality_sigma2(image_logvar: np.ndarray, text_logvar: np.ndarray) -> dict:
    ti, tt = trace(image_logvar), trace(text_logvar)
    return {
        "image_mean_trace": float(ti.mean()),
        "text_mean_trace": float(tt.mean()),
        "text_gt_image": bool(tt.mean() > ti.mean()),
        "n_images": int(len(ti)),
        "n_texts": int(len(tt)),
    }


def word_counts(captions: Sequence[str]) -> np.ndarray:
    """A caption's length as every analysis here measures it: its whitespace-separated words."""
    return np.array([len(c.split()) for c in captions], dtype=np.int64)


def length_correlation(
    captions: Sequence[str], text_logvar: np.ndarray, groups: np.ndarray | None = None
) -> dict:
    """Spearman ρ of caption length (words) vs tr(Σ); the claim predicts ρ < 0 (NaN for < 2 captions).
    With ``groups`` (the picture of each caption), also its ``ci95`` over resampled pictures."""
    words, tr = word_counts(captions), trace(text_logvar)
    rho = spearman(words, tr) if len(words) >= 2 else float("nan")
    out = {"spearman_words_vs_trace": rho, "n": int(len(words))}
    if groups is not None and len(words) >= 2:
        out["ci95"] = group_bootstrap(lambda rows: spearman(words[rows], tr[rows]), groups)
    return out


def hierarchy_order(level_traces: np.ndarray, level_captions: Sequence[Sequence[str]] | None = None) -> dict:
    """``level_traces`` (n, L): tr(Σ) of each image's level-k caption (k = 0 most general).

    ordered_fraction = fraction of the n·(L−1) adjacent pairs with tr(level k) > tr(level k+1), with its
    ``ordered_fraction_ci95`` over resampled images (an image's pairs share its captions).
    With ``level_captions`` (n × L strings, the same captions), also what caption length alone explains:
    length_only_ordered_fraction is the score of the ranking "the shorter caption is the more uncertain"
    (ties count one half, a coin flip), and same_length_ordered_fraction is ordered_fraction over the pairs
    whose two captions have equal word counts, where only what the captions name can decide (None if none);
    against_length_ordered_fraction is ordered_fraction over the pairs whose general caption has more words
    than its specific one, where length points the wrong way and only reading what they name orders them
    (None if none);
    level_only_spearman is Spearman(words, tr(Σ)) over these captions for a tr(Σ) that reads the level and
    nothing else (−level): what a σ² exactly right about specificity scores on the length claim here.
    """
    ordered = level_traces[:, :-1] > level_traces[:, 1:]  # (n, L-1)
    per_image = ordered.mean(1)  # equal pairs per image: the mean of these is ordered_fraction
    out = {
        "mean_trace_per_level": [float(x) for x in level_traces.mean(0)],
        "ordered_fraction": float(ordered.mean()),
        "ordered_fraction_ci95": group_bootstrap(
            lambda rows: per_image[rows].mean(), np.arange(len(per_image))
        ),
        "ordered_fraction_per_pair": [float(x) for x in ordered.mean(0)],
        "n": int(level_traces.shape[0]),
        "paper_ordered_fraction": 0.900,
    }
    if level_captions is not None:
        level_words = np.stack([word_counts(cs) for cs in level_captions])  # (n, L)
        general, specific = level_words[:, :-1], level_words[:, 1:]
        by_length = (general < specific) + 0.5 * (general == specific)
        same = general == specific
        out["length_only_ordered_fraction"] = float(by_length.mean())
        out["length_only_ordered_fraction_per_pair"] = [float(x) for x in by_length.mean(0)]
        out["same_length_pairs"] = int(same.sum())
        out["same_length_ordered_fraction"] = float(ordered[same].mean()) if same.any() else None
        against = general > specific
        out["against_length_pairs"] = int(against.sum())
        out["against_length_ordered_fraction"] = float(ordered[against].mean()) if against.any() else None
        out["level_only_spearman"] = spearman(
            level_words.ravel(), -np.broadcast_to(np.arange(level_words.shape[1]), level_words.shape).ravel()
        )
    return out


def class_uncertainty(prompt_logvar: np.ndarray, scores: np.ndarray, labels: np.ndarray) -> dict:
    """Per class of a zero-shot set: the mean tr(Σ) of its prompts (``prompt_logvar`` (C, N, D)) and its
    zero-shot recall (``scores`` (n, C) of the n labelled images); Spearman ρ of the two over the classes
    that have images (NaN for fewer than 2). The reading above predicts ρ < 0."""
    c = prompt_logvar.shape[0]
    prompt_trace = trace(prompt_logvar).mean(1)  # (C,)
    labels = np.asarray(labels)
    valid = (labels >= 0) & (labels < c)  # an unlabelled image counts for no class
    labels, pred = labels[valid], scores[valid].argmax(1)
    counts = np.bincount(labels, minlength=c)
    hits = np.bincount(labels[pred == labels], minlength=c)
    has = counts > 0
    recall = np.where(has, hits / np.maximum(counts, 1), np.nan)
    rho = spearman(prompt_trace[has], recall[has]) if has.sum() >= 2 else float("nan")
    return {
        "spearman_trace_vs_recall": rho,
        "n_classes": int(has.sum()),
        "prompt_trace": [float(x) for x in prompt_trace],
        "recall": [None if np.isnan(x) else float(x) for x in recall],
    }


def hypothesis(mu1: np.ndarray, logvar1: np.ndarray, mu2: np.ndarray, logvar2: np.ndarray) -> np.ndarray:
    """H(Z₁ ⊂ Z₂) per row (Eq. 4, log ε = 0), float64 (n,)."""
    t = [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)) for x in (mu1, logvar1, mu2, logvar2)]
    return inclusion_hypothesis(*t, log_eps=0.0).numpy()


def inclusion_rate(
    mu1: np.ndarray,
    logvar1: np.ndarray,
    mu2: np.ndarray,
    logvar2: np.ndarray,
    groups: np.ndarray | None = None,
) -> dict:
    """Fraction of rows with H(Z₁ ⊂ Z₂) > 0; with ``groups`` (the picture of each pair), its ``ci95``."""
    h = hypothesis(mu1, logvar1, mu2, logvar2)
    out = {"rate": float(np.mean(h > 0)), "median_H": float(np.median(h)), "n": int(len(h))}
    if groups is not None and len(h):
        inside = h > 0
        out["ci95"] = group_bootstrap(lambda rows: inside[rows].mean(), groups)
    return out


def _nearest(mu: np.ndarray, var: np.ndarray, pool_mu: np.ndarray, pool_logvar: np.ndarray) -> np.ndarray:
    return np.argmax(score_matrix(mu, np.log(var), pool_mu, pool_logvar), axis=1)


def traversal(
    image_mu: np.ndarray,
    image_logvar: np.ndarray,
    caption_mu: np.ndarray,
    caption_logvar: np.ndarray,
    caption_level: np.ndarray,
    empty_mu: np.ndarray,
    empty_logvar: np.ndarray,
    steps: int = 50,
) -> dict:
    """Image traversal (module docstring); returns per-step mean level and the per-image level paths."""
    n, m = len(image_mu), len(caption_mu)
    cap_var = np.exp(caption_logvar.astype(np.float64))
    paths = np.zeros((n, steps), dtype=np.int64)
    roots = np.zeros(n, dtype=np.int64)
    nearest = np.argmax(score_matrix(image_mu, image_logvar, caption_mu, caption_logvar), axis=1)  # (n,)
    ts = np.linspace(0.0, 1.0, steps)[:, None]
    for i in range(n):
        h = hypothesis(
            np.repeat(image_mu[i : i + 1], m, 0),
            np.repeat(image_logvar[i : i + 1], m, 0),
            caption_mu,
            caption_logvar,
        )
        roots[i] = int(np.argmax(h))
        root_mu = 0.5 * (caption_mu[roots[i]] + empty_mu)
        root_var = 0.5 * (cap_var[roots[i]] + np.exp(empty_logvar.astype(np.float64)))
        mu_t = (1 - ts) * root_mu + ts * caption_mu[nearest[i]]  # (steps, D)
        var_t = (1 - ts) * root_var + ts * cap_var[nearest[i]]
        paths[i] = caption_level[_nearest(mu_t, var_t, caption_mu, caption_logvar)]
    non_decreasing = (np.diff(paths, axis=1) >= 0).all(axis=1)
    return {
        "steps": int(steps),
        "mean_level_per_step": [float(x) for x in paths.mean(0)],
        "start_mean_level": float(paths[:, 0].mean()),
        "end_mean_level": float(paths[:, -1].mean()),
        "root_mean_level": float(caption_level[roots].mean()),
        "non_decreasing_fraction": float(non_decreasing.mean()),
        "n": int(n),
        "paths": paths.tolist(),
    }


def bprw_analysis(
    prompt_mu: np.ndarray,
    prompt_logvar: np.ndarray,
    image_mu: np.ndarray,
    image_logvar: np.ndarray,
    labels: np.ndarray,
    shots: int = 4,
    seed: int = 0,
) -> dict:
    """BPRW on a classification set: prompts (C, N, D), images (n, D). Zero-shot: each class's 5 nearest
    images (CSD to the ensemble) × 10 samples, α = 5, scored on all images. Few-shot: the first ``shots``
    labelled images per class (capped so one is left), α = 2, scored on the remaining images."""
    labels = np.asarray(labels)
    c = prompt_mu.shape[0]
    before = zero_shot_scores(prompt_mu, prompt_logvar, image_mu, image_logvar)
    zs = bprw.ZERO_SHOT
    near = topk(before.T, zs["n_images"])  # (C, m): images nearest to each class
    new_mu, new_logvar, pi = bprw.reweight_classes(
        prompt_mu, prompt_logvar, image_mu, image_logvar, list(near), zs["alpha"], zs["n_samples"], seed=seed
    )
    after = score_matrix(image_mu, image_logvar, new_mu, new_logvar)
    out = {
        "zero_shot": {
            "acc1_before": classification_metrics(before, labels)["acc1"],
            "acc1_after": classification_metrics(after, labels)["acc1"],
            "alpha": zs["alpha"],
            "n_images": zs["n_images"],
            "n_samples": zs["n_samples"],
            "mean_max_weight": float(pi.max(1).mean()),
        }
    }
    counts = np.bincount(labels, minlength=c)
    k = int(min(shots, counts.min() - 1)) if counts.min() > 1 else 0
    if k < 1:
        out["few_shot"] = "skipped: needs at least 2 images per class"
        return out
    shot_idx = [np.flatnonzero(labels == j)[:k] for j in range(c)]
    held = np.setdiff1d(np.arange(len(labels)), np.concatenate(shot_idx))
    fs = bprw.FEW_SHOT
    new_mu, new_logvar, pi = bprw.reweight_classes(
        prompt_mu, prompt_logvar, image_mu, image_logvar, shot_idx, fs["alpha"], fs["n_samples"], seed=seed
    )
    after = score_matrix(image_mu[held], image_logvar[held], new_mu, new_logvar)
    out["few_shot"] = {
        "shots": k,
        "acc1_before": classification_metrics(before[held], labels[held])["acc1"],
        "acc1_after": classification_metrics(after, labels[held])["acc1"],
        "alpha": fs["alpha"],
        "n_eval": int(len(held)),
    }
    return out
