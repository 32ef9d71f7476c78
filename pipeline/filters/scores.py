"""Filters on model scores (the table ``training.infer.scoring`` writes): masks with reasons, and a registry.

Every filter is a pure function over a scores table (``pyarrow.Table`` or a mapping of arrays with the
columns of ``training.infer.scoring.SCORE_COLUMNS``) returning ``(keep, reason)``: a bool mask and, per row, ""
when kept or a short reason. Only *scorable* rows compete: ``ok`` (the image decoded) and a finite
score; the others are dropped as ``image_failed`` / ``score_missing``. n_ok below counts scorable rows.

Rules (exact counts, so subsets of different filters compare at equal size):

- ``csd_best(fraction)``: the round(fraction·n_ok) rows with the smallest CSD (ProLIP App. C.8 /
  Table C.7 keeps the best 20%); ties broken by uid ascending, so the result does not depend on row order.
- ``csd_uncertainty_aware(fraction, text_unc_quantile, text_unc_low_quantile)``: first drop the
  round((1 − q)·n_ok) rows with the largest text uncertainty Σ_d σ²_t (the top decile for q = 0.9: the
  least informative captions, ProLIP §4.3 — short/general captions have large σ²; q = 1 drops none), and
  the round(q_low·n_ok) rows with the smallest (q_low = 0: none; the demo scorer gives non-English
  captions its lowest σ², docs/decisions/0010-demo-csd-fraction-and-uncertainty-rule.md), ties by uid;
  then keep the round(fraction·n_ok)
  smallest-CSD rows among the rest — the same size as ``csd_best`` (all the rest when fewer remain).
  Needs a probabilistic checkpoint (text_unc is NaN for deterministic ones).
- ``clip_score_best(fraction)``: the round(fraction·n_ok) rows with the largest cosine (DataComp's
  CLIP-score top-k%, with our model as the scorer), ties by uid. DataComp's own rule — keep every score
  ≥ the int(N·f)-th largest over all N rows — is ``pipeline.filters.datacomp.clip_score_fraction``; to run it and
  the other CLIP-score baselines (``laion2b``) with our scorer, ``with_clip_scores`` puts our cosine into
  a metadata table's CLIP-score column.
- ``clip_score_threshold(threshold)``: cosine ≥ threshold (DataComp's rule).
- ``random_same_size(n_keep, seed)``: n_keep scorable rows at random (the control for a filter of that
  size, ``of=LABEL`` in a spec): the n_keep smallest seeded uid hashes (``pipeline.filters.datacomp.uid_hash``, the
  draw DataComp's ``random`` baseline uses too), so the choice depends on neither row order nor batching.

Uncertainty-native selection (the scorer's σ² and ProLIP's inclusion used to select or weight data):

- ``csd_ucb(fraction, k=1)``: the round(fraction·n_ok) rows with the smallest CSD + k·``csd_std``, a
  pessimistic distance: CSD is the mean of ‖z_v − z_t‖² under the two Gaussians and ``csd_std`` its
  standard deviation (training/infer/scoring.py), so a pair is kept for being close *and* sure.
- ``csd_inclusion(fraction, inclusion_quantile=0.1)``: first drop the round(q·n_ok) rows whose image is
  least included in its caption (smallest H(Z_v ⊂ Z_t), ProLIP Eq. 4: the caption does not cover what the
  picture shows), then keep round(fraction·n_ok) smallest-CSD rows among the rest.
- ``csd_posterior(fraction, scale, bias, seed)``: no hard cut; each scorable row gets the scorer's own
  posterior that the pair matches, w = sigmoid(scale·(μ_v·μ_t − ½(Σσ²_v + Σσ²_t)) + bias) (PPCL's logit,
  ProLIP Eq. 2, with the trained logit scale and bias), and the subset lists round(fraction·n_ok) entries
  drawn by systematic sampling with probabilities ∝ w: rows are repeated (w large) or dropped (w small),
  and the entry count equals ``csd_best``'s row count, so a model trained on it sees as many samples.
  The sampling offset comes from ``seed``; the order is by uid, so it does not depend on row order.

Round is half-up. Each returns ``pipeline.filters.datacomp.FilterResult``; the registry, the spec syntax
(``csd_best:fraction=0.2``) and the random control's sizing live in ``pipeline.filters.specs``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline import schema as S
from pipeline.filters.base import FilterResult, WeightedResult
from pipeline.filters.datacomp import uid_hash

Scores = pa.Table | Mapping[str, Any]


# --- helpers ------------------------------------------------------------------------------------------


def _column(scores: Scores, name: str) -> np.ndarray:
    if isinstance(scores, pa.Table):
        if name not in scores.column_names:
            raise KeyError(f"scores table has no column {name!r} (columns: {scores.column_names})")
        return scores.column(name).to_numpy(zero_copy_only=False)
    return np.asarray(scores[name])


def _pct(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def _check_fraction(name: str, value: float, low_open: bool = True) -> None:
    if not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def _scorable(scores: Scores, score: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uids as str, score values float64, reason with the unscorable rows filled in)."""
    uids = _column(scores, "uid").astype(str)
    values = _column(scores, score).astype(np.float64)
    ok = _column(scores, "ok").astype(bool)
    reason = np.full(len(uids), "", dtype=object)
    reason[~ok] = "image_failed"
    reason[ok & ~np.isfinite(values)] = "score_missing"
    return uids, values, reason


def _order(values: np.ndarray, uids: np.ndarray, rows: np.ndarray, descending: bool) -> np.ndarray:
    """``rows`` sorted by value (ascending, or descending), ties by uid ascending."""
    key = -values[rows] if descending else values[rows]
    return rows[np.lexsort((uids[rows], key))]


def _keep_first(order: np.ndarray, n_keep: int, reason: np.ndarray, why: str) -> FilterResult:
    keep = np.zeros(len(reason), bool)
    keep[order[:n_keep]] = True
    reason[order[n_keep:]] = why
    return FilterResult(keep, reason)


# --- filters ------------------------------------------------------------------------------------------


def csd_best(scores: Scores, fraction: float) -> FilterResult:
    """Keep the round(fraction·n_ok) smallest-CSD rows (Eq. 1; App. C.8 keeps 20%)."""
    _check_fraction("fraction", fraction)
    uids, csd, reason = _scorable(scores, "csd")
    rows = np.flatnonzero(reason == "")
    order = _order(csd, uids, rows, descending=False)
    return _keep_first(order, _round(fraction * len(rows)), reason, f"csd_not_in_best_{_pct(fraction)}")


def csd_uncertainty_aware(
    scores: Scores, fraction: float, text_unc_quantile: float, text_unc_low_quantile: float
) -> FilterResult:
    """Drop the round((1−q)·n_ok) most and the round(q_low·n_ok) least uncertain captions, then keep
    round(fraction·n_ok) smallest CSD among the rest."""
    _check_fraction("fraction", fraction)
    if not 0.0 < text_unc_quantile <= 1.0:
        raise ValueError(f"text_unc_quantile must be in (0, 1], got {text_unc_quantile}")
    if not 0.0 <= text_unc_low_quantile < text_unc_quantile:
        raise ValueError(
            f"text_unc_low_quantile must be in [0, text_unc_quantile={text_unc_quantile}), got {text_unc_low_quantile}"
        )
    uids, csd, reason = _scorable(scores, "csd")
    text_unc = _column(scores, "text_unc").astype(np.float64)
    rows = np.flatnonzero(reason == "")
    if len(rows) and not np.isfinite(text_unc[rows]).all():
        raise ValueError("csd_uncertainty_aware needs text_unc: score with a probabilistic checkpoint")
    n_ok = len(rows)
    n_top = _round((1.0 - text_unc_quantile) * n_ok)
    n_low = _round(text_unc_low_quantile * n_ok)
    by_unc = _order(text_unc, uids, rows, descending=True)  # most uncertain first
    reason[by_unc[:n_top]] = f"text_uncertainty_top_{_pct(1.0 - text_unc_quantile)}"
    rest = by_unc[n_top : n_ok - n_low]
    if n_low:
        reason[by_unc[n_ok - n_low :]] = f"text_uncertainty_bottom_{_pct(text_unc_low_quantile)}"
    order = _order(csd, uids, rest, descending=False)
    return _keep_first(order, _round(fraction * n_ok), reason, f"csd_not_in_best_{_pct(fraction)}")


def csd_ucb(scores: Scores, fraction: float, k: float) -> FilterResult:
    """Keep the round(fraction·n_ok) rows with the smallest CSD + k·csd_std."""
    _check_fraction("fraction", fraction)
    uids, csd, reason = _scorable(scores, "csd")
    spread = _column(scores, "csd_std").astype(np.float64)
    rows = np.flatnonzero(reason == "")
    if len(rows) and not np.isfinite(spread[rows]).all():
        raise ValueError("csd_ucb needs csd_std: score with a probabilistic checkpoint")
    bound = csd + k * np.nan_to_num(spread)
    order = _order(bound, uids, rows, descending=False)
    return _keep_first(order, _round(fraction * len(rows)), reason, f"csd_ucb_not_in_best_{_pct(fraction)}")


def csd_inclusion(scores: Scores, fraction: float, inclusion_quantile: float) -> FilterResult:
    """Drop the round(q·n_ok) rows with the smallest H(Z_v ⊂ Z_t), then keep round(fraction·n_ok)
    smallest CSD among the rest."""
    _check_fraction("fraction", fraction)
    if not 0.0 <= inclusion_quantile < 1.0:
        raise ValueError(f"inclusion_quantile must be in [0, 1), got {inclusion_quantile}")
    uids, csd, reason = _scorable(scores, "csd")
    inclusion = _column(scores, "inclusion").astype(np.float64)
    rows = np.flatnonzero(reason == "")
    if len(rows) and not np.isfinite(inclusion[rows]).all():
        raise ValueError("csd_inclusion needs inclusion: score with a probabilistic checkpoint")
    n_low = _round(inclusion_quantile * len(rows))
    by_inc = _order(inclusion, uids, rows, descending=False)  # least included first
    reason[by_inc[:n_low]] = f"inclusion_bottom_{_pct(inclusion_quantile)}"
    order = _order(csd, uids, by_inc[n_low:], descending=False)
    return _keep_first(order, _round(fraction * len(rows)), reason, f"csd_not_in_best_{_pct(fraction)}")


def posterior_weights(scores: Scores, scale: float, bias: float) -> np.ndarray:
    """sigmoid(scale·(dot − ½(image_unc + text_unc)) + bias) per row: PPCL's match probability."""
    dot = _column(scores, "dot").astype(np.float64)
    unc = _column(scores, "image_unc").astype(np.float64) + _column(scores, "text_unc").astype(np.float64)
    logit = scale * (dot - 0.5 * unc) + bias
    return 0.5 * (1.0 + np.tanh(0.5 * logit))  # sigmoid without overflow


def csd_posterior(scores: Scores, fraction: float, scale: float, bias: float, seed: int) -> FilterResult:
    """round(fraction·n_ok) entries drawn ∝ the scorer's match posterior (systematic sampling, rows in uid
    order): ``repeat`` says how often each row is listed."""
    _check_fraction("fraction", fraction)
    uids, csd, reason = _scorable(scores, "csd")
    w = posterior_weights(scores, scale, bias)
    rows = np.flatnonzero((reason == "") & np.isfinite(w))
    reason[(reason == "") & ~np.isfinite(w)] = "score_missing"
    rows = rows[np.argsort(uids[rows], kind="stable")]
    n_draw = _round(fraction * len(rows))
    count = np.zeros(len(uids), dtype=np.int64)
    total = w[rows].sum()
    if n_draw and total > 0:
        u = np.random.default_rng(np.random.SeedSequence([seed, 7])).random()
        edges = np.floor(np.cumsum(w[rows]) / total * n_draw + u)  # systematic: one offset for all draws
        count[rows] = np.diff(np.r_[np.floor(u), edges]).astype(np.int64)
    reason[(reason == "") & (count == 0)] = "posterior_not_drawn"
    return WeightedResult(count > 0, reason, count)


def clip_score_best(scores: Scores, fraction: float) -> FilterResult:
    """Keep the round(fraction·n_ok) rows with the largest cosine (DataComp CLIP score), ties by uid."""
    _check_fraction("fraction", fraction)
    uids, cosine, reason = _scorable(scores, "cosine")
    rows = np.flatnonzero(reason == "")
    order = _order(cosine, uids, rows, descending=True)
    return _keep_first(order, _round(fraction * len(rows)), reason, f"clip_score_not_in_top_{_pct(fraction)}")


def clip_score_threshold(scores: Scores, threshold: float) -> FilterResult:
    """Keep rows with cosine ≥ threshold (DataComp's threshold rule)."""
    _, cosine, reason = _scorable(scores, "cosine")
    below = (reason == "") & ~(cosine >= threshold)
    reason[below] = f"clip_score_below_{threshold:g}"
    return FilterResult(reason == "", reason)


def random_same_size(scores: Scores, n_keep: int, seed: int = 0) -> FilterResult:
    """Keep ``n_keep`` scorable rows drawn at random (seeded); the control at a filter's size."""
    uids, _, reason = _scorable(scores, "ok")
    rows = np.flatnonzero(reason == "")
    if not 0 <= n_keep <= len(rows):
        raise ValueError(f"n_keep must be in [0, {len(rows)}] (scorable rows), got {n_keep}")
    key = uid_hash(pa.array(uids[rows], pa.string()), seed) if len(rows) else np.zeros(0, np.uint64)
    order = rows[np.lexsort((uids[rows], key))]  # a 64-bit hash tie goes to the smaller uid
    return _keep_first(order, n_keep, reason, "random_not_selected")


def with_clip_scores(metadata: pa.Table, scores: Scores, column: str = S.CLIP_B32) -> pa.Table:
    """``metadata`` with ``column`` replaced by our cosine (null where a uid was not scored or failed),
    so ``pipeline.filters.datacomp``' CLIP-score baselines (clip_score, laion2b) run with our scorer."""
    uids = _column(scores, "uid").astype(str)
    cosine = np.where(_column(scores, "ok").astype(bool), _column(scores, "cosine"), np.nan)
    order = np.argsort(uids)
    meta_uids = metadata.column(S.UID).to_numpy(zero_copy_only=False).astype(str)
    pos = np.clip(np.searchsorted(uids[order], meta_uids), 0, max(len(uids) - 1, 0))
    found = (uids[order][pos] == meta_uids) if len(uids) else np.zeros(len(meta_uids), bool)
    values = np.where(found, cosine[order][pos] if len(uids) else np.nan, np.nan)
    arr = pa.array(values, pa.float64(), mask=~np.isfinite(values))
    if column in metadata.column_names:
        return metadata.set_column(metadata.column_names.index(column), column, arr)
    return metadata.append_column(column, arr)
