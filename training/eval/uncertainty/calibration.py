"""Uncertainty-calibration metrics shared by every probabilistic method (ProLIP, PCME++, ProbVLM, AsymVLM).

The protocol of ProbVLM §4 (after PCME [10]) that AsymVLM §5 reuses:

1. sort the retrieval queries by their scalar uncertainty and cut them into ``n_levels`` equal-count
   uncertainty levels (10 in both papers);
2. compute Recall@1 inside each level;
3. ``S`` = Spearman rank correlation between the level index and R@1 (ideal −1: recall falls as the
   uncertainty rises), ``R²`` = coefficient of determination of the least-squares line R@1 ≈ a + b·level
   (how linear the fall is), and the combined score ``−S·R²`` (ideal +1).

Equal-count levels are ranks, not value ranges: level ``k`` holds queries whose uncertainty rank ``r``
(0-based, ascending, ties broken by position so the split is deterministic) has
``floor(r · n_levels / n) == k``; sizes differ by at most one. Constant R@1 across levels has no defined
rank correlation: ``S`` and ``R²`` are then NaN (so is the score), as scipy reports it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

N_LEVELS = 10  # ProbVLM §4 and AsymVLM §5 both use ten levels


def uncertainty_levels(u: np.ndarray, n_levels: int = N_LEVELS) -> np.ndarray:
    """Level index in ``[0, n_levels)`` per query, by ascending uncertainty, equal counts (±1).

    ``level[i] = floor(rank(u_i) · n_levels / n)`` with ``rank`` from a stable sort, so tied values keep
    their input order and the result never depends on the sort algorithm.
    """
    u = np.asarray(u, dtype=np.float64).reshape(-1)
    n = u.size
    if n < n_levels:
        raise ValueError(f"need at least n_levels={n_levels} queries, got {n}")
    if np.isnan(u).any():
        raise ValueError("uncertainty contains NaN")
    order = np.argsort(u, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    return (rank * n_levels) // n


def recall_at_1_per_level(correct: np.ndarray, u: np.ndarray, n_levels: int = N_LEVELS) -> np.ndarray:
    """Mean of the boolean top-1 correctness inside each equal-count uncertainty level, shape (n_levels,)."""
    correct = np.asarray(correct, dtype=np.float64).reshape(-1)
    level = uncertainty_levels(u, n_levels)
    if correct.size != level.size:
        raise ValueError(f"correct has {correct.size} queries, uncertainty has {level.size}")
    sums = np.bincount(level, weights=correct, minlength=n_levels)
    counts = np.bincount(level, minlength=n_levels)
    return sums / counts


def _average_ranks(x: np.ndarray) -> np.ndarray:
    # Ties get the mean of the ranks they span (the convention of Spearman's coefficient). Vectorised: the
    # bootstrap intervals call this a thousand times on every caption of an eval set.
    order = np.argsort(x, kind="stable")
    xs = x[order]
    first = np.concatenate([[True], xs[1:] != xs[:-1]])  # where each run of equal values starts
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], x.size)  # exclusive
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = (0.5 * (starts + ends - 1))[np.cumsum(first) - 1]
    return ranks


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    xc, yc = x - x.mean(), y - y.mean()
    den = math.sqrt(float(xc @ xc) * float(yc @ yc))
    return float(xc @ yc) / den if den > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ = Pearson correlation of the average ranks of ``x`` and ``y``; NaN if either is constant."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.size != y.size or x.size < 2:
        raise ValueError("spearman needs two sequences of equal length ≥ 2")
    return _pearson(_average_ranks(x), _average_ranks(y))


def r_squared(x: np.ndarray, y: np.ndarray) -> float:
    """R² of the least-squares line ``y ≈ a + b·x``: ``1 − SS_res / SS_tot``; NaN when ``y`` is constant.

    For a simple linear fit with intercept this equals the squared Pearson correlation.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.size != y.size or x.size < 2:
        raise ValueError("r_squared needs two sequences of equal length ≥ 2")
    xc, yc = x - x.mean(), y - y.mean()
    ss_tot = float(yc @ yc)
    sxx = float(xc @ xc)
    if ss_tot == 0 or sxx == 0:
        return float("nan")
    slope = float(xc @ yc) / sxx
    ss_res = float(((yc - slope * xc) ** 2).sum())
    return 1.0 - ss_res / ss_tot


def calibration_summary(correct: np.ndarray, u: np.ndarray, n_levels: int = N_LEVELS) -> dict[str, Any]:
    """``{levels, r1, recall_at_1, S, R2, score}`` for one retrieval direction.

    ``r1`` is R@1 per level (ascending uncertainty), ``recall_at_1`` the overall R@1,
    ``S = spearman(levels, r1)``, ``R2 = r_squared(levels, r1)``, ``score = −S·R²``.
    """
    r1 = recall_at_1_per_level(correct, u, n_levels)
    levels = np.arange(n_levels)
    s = spearman(levels, r1)
    r2 = r_squared(levels, r1)
    return {
        "levels": levels.tolist(),
        "r1": [float(v) for v in r1],
        "recall_at_1": float(np.mean(np.asarray(correct, dtype=np.float64))),
        "S": s,
        "R2": r2,
        "score": -s * r2,
    }
