"""Score filters: exact sizes, hand-computed selections, deterministic ties, spec validation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.common.config import ConfigError
from pipeline.filters import scores as F
from pipeline.filters import specs as P
from pipeline.filters.registry import CsdUncertaintyAware
from pipeline.subsets.uid_files import kept_uids


def _uid(i: int) -> str:
    return f"{i:032x}"


def _scores(csd, text_unc=None, ok=None, cosine=None) -> pa.Table:
    n = len(csd)
    csd = np.asarray(csd, np.float32)
    return pa.table(
        {
            "uid": [_uid(i) for i in range(n)],
            "ok": np.ones(n, bool) if ok is None else np.asarray(ok),
            "csd": csd,
            "cosine": (1 - csd / 2) if cosine is None else np.asarray(cosine, np.float32),
            "text_unc": np.zeros(n, np.float32) if text_unc is None else np.asarray(text_unc, np.float32),
        }
    )


def test_csd_best_keeps_the_smallest_rows_with_exact_count():
    csd = [1.9, 0.4, 1.2, 0.1, 1.5, 0.8, 2.0, 0.6, 1.1, 0.3]
    keep, reason = F.csd_best(_scores(csd), 0.3)
    assert np.flatnonzero(keep).tolist() == [1, 3, 9]  # 0.1, 0.3, 0.4 by hand
    assert set(reason[~keep]) == {"csd_not_in_best_30%"} and (reason[keep] == "").all()
    for fraction, expected in ((0.2, 2), (0.25, 3), (0.05, 1), (1.0, 10)):  # round half up: 2.5 → 3
        assert F.csd_best(_scores(csd), fraction)[0].sum() == expected


def test_failed_images_never_compete_and_count_toward_nothing():
    csd = [0.0, 0.5, np.nan, 0.2, 0.9]
    keep, reason = F.csd_best(_scores(csd, ok=[False, True, True, True, True]), 0.5)
    assert reason[0] == "image_failed" and reason[2] == "score_missing"
    assert np.flatnonzero(keep).tolist() == [1, 3]  # round(0.5 · 3 scorable) = 2


def test_ties_are_broken_by_uid_whatever_the_row_order():
    t = _scores([0.5] * 6 + [0.1])
    out = kept_uids(t, P.apply("csd_best:fraction=0.5", t))  # 3.5 → 4: the 0.1 row and the 3 smallest uids
    assert out.tolist() == sorted([_uid(6), _uid(0), _uid(1), _uid(2)])
    shuffled = t.take(np.random.default_rng(1).permutation(7))
    assert kept_uids(shuffled, P.apply("csd_best:fraction=0.5", shuffled)).tolist() == out.tolist()


# The filter class holds the rule's defaults (text_unc_quantile, text_unc_low_quantile).
_UA_DEFAULTS = (CsdUncertaintyAware().text_unc_quantile, CsdUncertaintyAware().text_unc_low_quantile)


def test_uncertainty_aware_drops_top_decile_and_keeps_equal_size():
    rng = np.random.default_rng(0)
    n = 50
    csd = rng.uniform(0, 2, n)
    text_unc = rng.uniform(0, 1, n)
    csd[np.argsort(text_unc)[-5:]] = 0.0  # the 5 most uncertain captions have the best CSD
    t = _scores(csd, text_unc=text_unc)
    result = F.csd_uncertainty_aware(t, 0.2, *_UA_DEFAULTS)
    keep, reason = result
    top = set(np.argsort(text_unc)[-5:].tolist())
    assert {i for i in range(n) if reason[i] == "text_uncertainty_top_10%"} == top
    assert keep.sum() == F.csd_best(t, 0.2)[0].sum() == 10
    rest = np.array(sorted(set(range(n)) - top))
    assert set(np.flatnonzero(keep)) == set(rest[np.argsort(csd[rest])[:10]].tolist())
    assert result.counts() == {"kept": 10, "text_uncertainty_top_10%": 5, "csd_not_in_best_20%": 35}
    with pytest.raises(ValueError, match="probabilistic"):
        F.csd_uncertainty_aware(_scores(csd, text_unc=np.full(n, np.nan)), 0.2, *_UA_DEFAULTS)


def test_uncertainty_aware_can_drop_the_least_uncertain_tail_too():
    rng = np.random.default_rng(1)
    n = 40
    csd = rng.uniform(0, 2, n)
    text_unc = rng.permutation(n).astype(np.float64)  # distinct: ranks are the values
    csd[text_unc < 4] = 0.0  # the 4 least uncertain captions have the best CSD (as non-English ones did)
    t = _scores(csd, text_unc=text_unc)
    # Bottom 10% only (q = 1 drops nobody from the top): those 4 go, the size stays csd_best's.
    result = F.csd_uncertainty_aware(t, 0.25, text_unc_quantile=1.0, text_unc_low_quantile=0.1)
    keep, reason = result
    low = set(np.flatnonzero(text_unc < 4).tolist())
    assert {i for i in range(n) if reason[i] == "text_uncertainty_bottom_10%"} == low
    rest = np.array(sorted(set(range(n)) - low))
    assert set(np.flatnonzero(keep)) == set(rest[np.argsort(csd[rest])[:10]].tolist())
    assert result.counts() == {"kept": 10, "text_uncertainty_bottom_10%": 4, "csd_not_in_best_25%": 26}
    # Both tails: 4 from the top and 8 from the bottom, never the same row twice.
    both = F.csd_uncertainty_aware(t, 0.25, text_unc_quantile=0.9, text_unc_low_quantile=0.2)
    assert both.counts() == {
        "kept": 10,
        "text_uncertainty_top_10%": 4,
        "text_uncertainty_bottom_20%": 8,
        "csd_not_in_best_25%": 18,
    }
    assert set(np.flatnonzero(both.reason == "text_uncertainty_top_10%")) == set(
        np.flatnonzero(text_unc >= 36)
    )
    # The default drops no bottom tail: the same rows as before the parameter existed.
    assert _UA_DEFAULTS == (0.9, 0.0)
    assert (
        F.csd_uncertainty_aware(t, 0.25, *_UA_DEFAULTS).keep
        == F.csd_uncertainty_aware(t, 0.25, 0.9, 0.0).keep
    ).all()
    for q, q_low in ((0.9, 0.9), (0.9, -0.1), (1.2, 0.0)):
        with pytest.raises(ValueError, match="text_unc"):
            F.csd_uncertainty_aware(t, 0.25, text_unc_quantile=q, text_unc_low_quantile=q_low)
    spec = "csd_uncertainty_aware:fraction=0.25,text_unc_quantile=1,text_unc_low_quantile=0.1"
    assert kept_uids(t, P.apply(spec, t)).tolist() == sorted(_uid(i) for i in np.flatnonzero(keep))


def test_clip_score_best_and_threshold():
    cos = [0.1, 0.35, 0.2, 0.3, 0.5, -0.2]
    t = _scores(np.zeros(6), cosine=cos)
    keep, reason = F.clip_score_best(t, 0.5)
    assert np.flatnonzero(keep).tolist() == [1, 3, 4]
    assert reason[0] == "clip_score_not_in_top_50%"
    keep, reason = F.clip_score_threshold(t, 0.3)
    assert np.flatnonzero(keep).tolist() == [1, 3, 4]  # ≥ threshold, as DataComp
    assert reason[2] == "clip_score_below_0.3"


def test_random_control_same_size_seeded_and_order_free():
    t = _scores(np.linspace(0, 2, 40), ok=np.arange(40) % 7 != 0)
    result = P.apply("random_same_size:n_keep=11,seed=3", t)
    a = kept_uids(t, result)
    assert len(a) == 11 and result.counts()["image_failed"] == 6
    assert result.counts() == {"kept": 11, "image_failed": 6, "random_not_selected": 23}
    shuffled = t.take(np.random.default_rng(0).permutation(40))
    again = kept_uids(shuffled, P.apply("random_same_size:n_keep=11,seed=3", shuffled))
    assert again.tolist() == a.tolist()
    assert kept_uids(t, P.apply("random_same_size:n_keep=11,seed=4", t)).tolist() != a.tolist()
    with pytest.raises(ValueError):
        F.random_same_size(t, n_keep=35)


def test_apply_counts_reasons_and_sorts_uids():
    t = _scores([0.9, 0.1, 0.5, 0.3], ok=[True, True, True, False])
    out = P.apply("csd_best:fraction=0.5", t)
    assert kept_uids(t, out).tolist() == [_uid(1), _uid(2)]
    assert out.counts() == {"kept": 2, "csd_not_in_best_50%": 1, "image_failed": 1}
    assert P.parse_filter_spec("csd_best:fraction=0.5").params == {"fraction": 0.5}


def test_with_clip_scores_puts_our_cosine_in_datacomp_column():
    t = _scores(np.zeros(3), cosine=[0.1, 0.2, 0.3], ok=[True, False, True])
    meta = pa.table({"uid": [_uid(2), _uid(9), _uid(1), _uid(0)], "clip_b32_similarity_score": [9.0] * 4})
    got = F.with_clip_scores(meta, t).column("clip_b32_similarity_score").to_pylist()
    assert got[0] == pytest.approx(0.3) and got[3] == pytest.approx(0.1)
    assert got[1] is None and got[2] is None  # uid never scored; image failed


def test_filter_specs_parse_and_validate():
    specs = P.parse_filter_specs(
        "csd_best:fraction=0.2,csd_uncertainty_aware:fraction=0.2,text_unc_quantile=0.8,"
        "random_same_size:of=csd_best,seed=1"
    )
    assert [(s.label, s.name, s.params, s.of) for s in specs] == [
        ("csd_best", "csd_best", {"fraction": 0.2}, ""),
        ("csd_uncertainty_aware", "csd_uncertainty_aware", {"fraction": 0.2, "text_unc_quantile": 0.8}, ""),
        ("random_same_size", "random_same_size", {"seed": 1}, "csd_best"),
    ]
    assert P.parse_filter_spec("csd_best:fraction=0.1,label=csd10").label == "csd10"
    bad = {
        "csd_bst:fraction=0.2": r"filters\[0\]: unknown filter 'csd_bst'",
        "csd_best:fracton=0.2": r"filters\[0\]\.fracton: unknown parameter",
        "csd_best:fraction=abc": r"filters\[0\]\.fraction: input should be a valid number",
        "csd_best:fraction=1.5": r"filters\[0\]\.fraction: input should be less than or equal to 1",
        "random_same_size:seed=0": r"filters\[0\]\.n_keep",
        "random_same_size:of=nothing": r"filters\[0\]\.of: no filter labelled 'nothing'",
    }
    for spec, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            P.parse_filter_specs([spec])
    with pytest.raises(ConfigError, match=r"filters\[1\]\.label: subset name 'csd_best' used twice"):
        P.parse_filter_specs(["csd_best:fraction=0.1", "csd_best:fraction=0.2"])
