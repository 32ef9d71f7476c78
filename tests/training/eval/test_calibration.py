"""The shared calibration metrics on data whose answers are known, and against scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from training.eval.uncertainty.calibration import (
    calibration_summary,
    r_squared,
    recall_at_1_per_level,
    spearman,
    uncertainty_levels,
)


def test_levels_are_equal_count_and_ordered() -> None:
    rng = np.random.default_rng(0)
    u = rng.normal(size=103)
    level = uncertainty_levels(u, 10)
    counts = np.bincount(level, minlength=10)
    assert counts.sum() == 103 and counts.max() - counts.min() <= 1
    # every query of a level is at least as uncertain as every query of the level below
    for k in range(9):
        assert u[level == k].max() <= u[level == k + 1].min()


def test_levels_break_ties_by_position() -> None:
    level = uncertainty_levels(np.zeros(20), 10)
    assert level.tolist() == [i // 2 for i in range(20)]
    with pytest.raises(ValueError, match="at least"):
        uncertainty_levels(np.zeros(5), 10)


def test_recall_per_level_matches_hand_count() -> None:
    u = np.arange(40, dtype=float)[::-1]  # query 39 is the most certain
    correct = np.zeros(40, dtype=bool)
    correct[36:] = True  # the four most certain queries are right → level 0 (the 4 smallest u) only
    r1 = recall_at_1_per_level(correct, u, 10)
    assert r1.tolist() == [1.0] + [0.0] * 9


def test_perfectly_linear_fall_scores_ideal() -> None:
    # level k (10 queries each) has 10 − k correct: R@1 = 1 − k/10 exactly
    u = np.repeat(np.arange(10.0), 10)
    correct = np.concatenate([np.arange(10) < 10 - k for k in range(10)])
    s = calibration_summary(correct, u)
    np.testing.assert_allclose(s["r1"], 1 - np.arange(10) / 10)
    assert (
        s["S"] == pytest.approx(-1.0) and s["R2"] == pytest.approx(1.0) and s["score"] == pytest.approx(1.0)
    )


def test_reversed_and_nonlinear_cases() -> None:
    u = np.repeat(np.arange(10.0), 10)
    rising = np.concatenate([np.arange(10) < k + 1 for k in range(10)])
    s = calibration_summary(rising, u)
    assert s["S"] == pytest.approx(1.0) and s["score"] == pytest.approx(-1.0)
    # monotone but convex: S = −1 exactly, R² < 1 and equal to scipy's linregress
    r1 = np.array([1.0, 0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01, 0.005, 0.0])
    assert spearman(np.arange(10), r1) == pytest.approx(-1.0)
    assert r_squared(np.arange(10), r1) == pytest.approx(stats.linregress(np.arange(10), r1).rvalue ** 2)
    assert r_squared(np.arange(10), r1) < 0.9


def test_against_scipy_with_ties() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.integers(0, 5, size=30).astype(float)
        y = rng.integers(0, 4, size=30) + 0.5 * x
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
        assert r_squared(x, y) == pytest.approx(stats.linregress(x, y).rvalue ** 2, abs=1e-12)


def test_constant_recall_is_nan() -> None:
    s = calibration_summary(np.ones(50, dtype=bool), np.arange(50.0))
    assert math.isnan(s["S"]) and math.isnan(s["R2"]) and math.isnan(s["score"])
