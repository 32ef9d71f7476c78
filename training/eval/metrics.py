"""Evaluation metrics over gathered embeddings: zero-shot classification, retrieval, DataComp aggregates.

Pure numpy/torch; the Ray side (``training/eval/run.py``) gathers the embeddings and calls these.

- Scores are "higher is better": −CSD (Eq. 1 of ProLIP) for probabilistic embeddings, cosine similarity
  for deterministic ones (``logvar`` None), so one ranking code path serves both.
- Zero-shot (ProLIP §4.2): the class embedding of N prompts is N(mean_i μ_i, mean_i σ²_i), the
  plain mean (not 1/N² of a sum of Gaussians). The mean of unit vectors is *not* renormalised (ProLIP
  says nothing of it), so its CSD keeps the exact ‖μ_c‖² term; for deterministic models the cosine
  normalises it anyway, which is CLIP's prompt ensemble.
- Classification metrics follow clip_benchmark/DataComp names: ``acc1``, ``acc5`` (top-min(5, C)),
  ``mean_per_class_recall`` (mean over classes present in the labels), ``F1-macro_all`` (WILDS iWildCam:
  macro F1 over classes present in labels or predictions) and worst-group accuracies from per-sample
  metadata (WILDS / DataComp fairness: ``acc_worst_region``, ``acc_wg``, ``acc_top5_wg``).
- Retrieval: image→text R@k counts an image as hit when any of its captions ranks in its top k; text→image
  when its image does. Names as clip_benchmark: ``text_retrieval_recall@k`` (image→text),
  ``image_retrieval_recall@k`` (text→image), and DataComp's main metric ``mean_recall@1``.
- Association (WinoGAViL, as DataComp scores it): per game the k best candidate images against the cue,
  k = its number of associations, scored by Jaccard index against them.
- Aggregates over a results file: ``training/eval/results.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from training.losses.contrastive import csd_matrix

# ---------------------------------------------------------------- scores


def gaussian_mean(
    mu: np.ndarray, logvar: np.ndarray | None, axis: int = 1
) -> tuple[np.ndarray, np.ndarray | None]:
    """N(mean μ, mean σ²) over ``axis`` (the prompt-ensemble rule of §4.2); returns (μ, log σ²)."""
    mu_c = mu.mean(axis=axis)
    if logvar is None:
        return mu_c, None
    var = np.exp(logvar.astype(np.float64)).mean(axis=axis)
    return mu_c, np.log(var).astype(logvar.dtype)


def score_matrix(
    mu_a: np.ndarray, logvar_a: np.ndarray | None, mu_b: np.ndarray, logvar_b: np.ndarray | None
) -> np.ndarray:
    """(A, B) similarity: −CSD(a_i, b_j) when both have log-variances, else the cosine of the means."""
    if logvar_a is not None and logvar_b is not None:
        d = csd_matrix(*(torch.from_numpy(np.ascontiguousarray(x)) for x in (mu_a, logvar_a, mu_b, logvar_b)))
        return -d.double().numpy()
    a = mu_a / np.maximum(np.linalg.norm(mu_a, axis=1, keepdims=True), 1e-12)
    b = mu_b / np.maximum(np.linalg.norm(mu_b, axis=1, keepdims=True), 1e-12)
    return a.astype(np.float64) @ b.astype(np.float64).T


def zero_shot_scores(
    prompt_mu: np.ndarray,
    prompt_logvar: np.ndarray | None,
    image_mu: np.ndarray,
    image_logvar: np.ndarray | None,
) -> np.ndarray:
    """(n, C) scores of n images against C classes, each the prompt ensemble (C, N, D) → ``gaussian_mean``."""
    class_mu, class_logvar = gaussian_mean(prompt_mu, prompt_logvar, axis=1)
    return score_matrix(image_mu, image_logvar, class_mu, class_logvar)


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """(N, k) column indices by decreasing score; ties keep the lower index first (stable)."""
    k = min(k, scores.shape[1])
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


# ---------------------------------------------------------------- classification


def classification_metrics(
    scores: np.ndarray,
    labels: np.ndarray,
    *,
    groups: np.ndarray | None = None,
    group_metric: str = "acc1",
    group_metric_name: str = "acc_wg",
    group_exclude: Iterable[int] = (),
) -> dict[str, float]:
    """acc1, acc5 (top-min(5, C)), mean_per_class_recall, F1-macro_all; with ``groups`` (N,) the worst
    group's ``group_metric`` (acc1 or acc5) under ``group_metric_name`` (groups in ``group_exclude`` and
    empty ones are skipped, as WILDS skips FMoW's "Other" region). Shapes: scores (N, C), labels (N,)."""
    labels = np.asarray(labels, dtype=np.int64)
    n, c = scores.shape
    if n == 0:
        raise ValueError("no samples to score")
    ranked = topk(scores, 5)
    hit1 = ranked[:, 0] == labels
    hit5 = (ranked == labels[:, None]).any(axis=1)
    pred = ranked[:, 0]
    present = np.unique(labels)
    recalls = [hit1[labels == k].mean() for k in present]
    f1s = []
    for k in np.union1d(present, np.unique(pred)):
        tp = float(np.sum((pred == k) & (labels == k)))
        denom = float(np.sum(pred == k) + np.sum(labels == k))
        f1s.append(2 * tp / denom if denom else 0.0)
    out = {
        "acc1": float(hit1.mean()),
        "acc5": float(hit5.mean()),
        "mean_per_class_recall": float(np.mean(recalls)),
        "F1-macro_all": float(np.mean(f1s)),
        "n": int(n),
        "n_classes": int(c),
    }
    if groups is not None:
        hits = {"acc1": hit1, "acc5": hit5}[group_metric]
        groups = np.asarray(groups)
        skip = set(int(g) for g in group_exclude)
        per_group = {int(g): float(hits[groups == g].mean()) for g in np.unique(groups) if int(g) not in skip}
        out[group_metric_name] = min(per_group.values()) if per_group else float("nan")
    return out


# ---------------------------------------------------------------- retrieval


def retrieval_metrics(
    scores: np.ndarray, text_image: np.ndarray, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
    """Recall@k both ways. ``scores`` (n_images, n_texts); ``text_image`` (n_texts,) the image of each text.

    image→text R@k = mean over images of [some own caption in the image's top k texts];
    text→image R@k = mean over texts of [own image in the text's top k images].
    """
    text_image = np.asarray(text_image, dtype=np.int64)
    n_img, n_txt = scores.shape
    own = text_image[None, :] == np.arange(n_img)[:, None]  # (n_img, n_txt)
    # Rank of the best own caption: captions scoring strictly higher, plus better-placed ties (stable).
    order_i2t = np.argsort(-scores, axis=1, kind="stable")
    first_own = np.argmax(np.take_along_axis(own, order_i2t, axis=1), axis=1)  # (n_img,)
    order_t2i = np.argsort(-scores.T, axis=1, kind="stable")  # (n_txt, n_img)
    rank_t2i = np.argmax(order_t2i == text_image[:, None], axis=1)  # (n_txt,)
    out: dict[str, float] = {}
    for k in ks:
        out[f"text_retrieval_recall@{k}"] = float(np.mean(first_own < k))
        out[f"image_retrieval_recall@{k}"] = float(np.mean(rank_t2i < k))
        out[f"mean_recall@{k}"] = 0.5 * (
            out[f"text_retrieval_recall@{k}"] + out[f"image_retrieval_recall@{k}"]
        )
    out["n_images"], out["n_texts"] = int(n_img), int(n_txt)
    return out


# ---------------------------------------------------------------- association (WinoGAViL)


def association_metrics(scores: Sequence[np.ndarray], truth: Sequence[np.ndarray]) -> dict[str, float]:
    """WinoGAViL's Jaccard scores, DataComp's names. For each game, ``scores`` (n_candidates,) of its
    candidate images against the cue and ``truth`` (n_candidates,) bool, its associations. The k best
    candidates (k = number of associations) are the prediction; the game's score is the Jaccard index
    |predicted ∩ true| / |predicted ∪ true|. Means over all games, over games of 5, 6, 10 and 12
    candidates, of 5–6 and of 10–12 (the main metric, ``jaccard_score_10-12``); NaN where no game fits."""
    jac, size = [], []
    for s, t in zip(scores, truth, strict=True):
        t = np.asarray(t, bool)
        pred = np.zeros(len(t), bool)
        pred[np.argsort(-np.asarray(s, np.float64), kind="stable")[: int(t.sum())]] = True
        union = int((pred | t).sum())
        jac.append((pred & t).sum() / union if union else 0.0)
        size.append(len(t))
    jac_a, size_a = np.asarray(jac, np.float64), np.asarray(size)

    def mean(mask: np.ndarray) -> float:
        return float(jac_a[mask].mean()) if mask.any() else float("nan")

    out = {"avg_jaccard_score": mean(np.ones(len(jac_a), bool))}
    for n in (5, 6, 10, 12):
        out[f"jaccard_score_{n}"] = mean(size_a == n)
    out["jaccard_score_5-6"] = mean(size_a <= 6)
    out["jaccard_score_10-12"] = mean(size_a >= 10)
    out["n"] = len(jac_a)
    return out
