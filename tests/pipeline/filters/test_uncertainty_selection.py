"""Uncertainty-native selection (pipeline/filters/scores.py): the σ²- and inclusion-aware CSD filters and the
posterior-weighted subset, on hand-made score tables, without Ray (the columns they read:
tests/training/infer/test_scoring.py)."""

from __future__ import annotations

import numpy as np

from pipeline.filters import scores as SF
from pipeline.filters.registry import CsdPosterior
from pipeline.filters.specs import apply
from pipeline.subsets.uid_files import kept_uids


def _r(x: float) -> int:  # the filters' half-up rounding (Python's _r() rounds half to even)
    return int(np.floor(x + 0.5))


def _table(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "uid": np.array([f"{i:032x}" for i in rng.permutation(n)]),
        "ok": np.r_[np.ones(n - 5, bool), np.zeros(5, bool)],
        "dot": rng.uniform(-0.2, 0.9, n),
        "image_unc": rng.uniform(0.01, 0.05, n),
        "text_unc": rng.uniform(0.01, 0.3, n),
        "csd": rng.uniform(0.2, 2.5, n),
        "csd_std": rng.uniform(0.0, 0.5, n),
        "inclusion": rng.normal(0, 5, n),
        "cosine": rng.uniform(-0.2, 0.9, n),
    }


def test_csd_ucb_ranks_by_the_pessimistic_distance():
    t = _table()
    res = SF.csd_ucb(t, fraction=0.25, k=2.0)
    ok = np.flatnonzero(t["ok"])
    bound = t["csd"][ok] + 2.0 * t["csd_std"][ok]
    assert set(np.flatnonzero(res.keep)) == set(ok[np.argsort(bound)[: _r(0.25 * len(ok))]])
    assert set(res.reason[~t["ok"]]) == {"image_failed"}
    # k = 0 is csd_best
    assert np.array_equal(SF.csd_ucb(t, 0.25, k=0.0).keep, SF.csd_best(t, 0.25).keep)


def test_csd_inclusion_drops_the_least_included_first():
    t = _table()
    res = SF.csd_inclusion(t, fraction=0.3, inclusion_quantile=0.2)
    ok = np.flatnonzero(t["ok"])
    low = ok[np.argsort(t["inclusion"][ok])[: _r(0.2 * len(ok))]]
    assert not res.keep[low].any() and set(res.reason[low]) == {"inclusion_bottom_20%"}
    rest = np.setdiff1d(ok, low)
    assert set(np.flatnonzero(res.keep)) == set(rest[np.argsort(t["csd"][rest])[: _r(0.3 * len(ok))]])


def test_posterior_weights_draw_as_many_entries_as_csd_best_keeps():
    t = _table(n=400)
    res = SF.csd_posterior(t, fraction=0.9, scale=8.0, bias=-3.0, seed=1)
    n_ok = int(t["ok"].sum())
    assert res.repeat.sum() == _r(0.9 * n_ok) == SF.csd_best(t, 0.9).keep.sum()
    w = SF.posterior_weights(t, 8.0, -3.0)
    expected = 0.9 * n_ok * w / w[t["ok"]].sum()
    assert np.all(np.abs(res.repeat - np.where(t["ok"], expected, 0)) < 1.0)  # systematic sampling
    assert res.repeat.max() >= 2 and (res.repeat[t["ok"]] == 0).any()  # repeated and dropped
    assert set(res.reason[t["ok"] & (res.repeat == 0)]) == {"posterior_not_drawn"}
    uids = kept_uids(t, res)
    assert len(uids) == res.repeat.sum() and list(uids) == sorted(uids)  # a subset that up-samples


# The filter class holds the rule's default logit scale and bias.
_POSTERIOR_SCALARS = (CsdPosterior().scale, CsdPosterior().bias)


def test_posterior_subset_does_not_depend_on_row_order():
    t = _table(n=300)
    perm = np.random.default_rng(2).permutation(300)
    shuffled = {k: v[perm] for k, v in t.items()}
    a = kept_uids(t, SF.csd_posterior(t, 0.5, *_POSTERIOR_SCALARS, seed=3))
    b = kept_uids(shuffled, SF.csd_posterior(shuffled, 0.5, *_POSTERIOR_SCALARS, seed=3))
    assert list(a) == list(b)


def test_new_score_filters_in_the_registry():
    t = _table()
    assert apply("csd_ucb:fraction=0.1,k=0.5", t).keep.sum() == _r(0.1 * 195)
    assert apply("csd_inclusion:fraction=0.1", t).keep.sum() == _r(0.1 * 195)
    assert apply("csd_posterior:fraction=0.1,scale=5,bias=-2", t).repeat.sum() == _r(0.1 * 195)
